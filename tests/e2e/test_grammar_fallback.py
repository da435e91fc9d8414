"""The default grammar engine without its package: ``pip install pdserve`` brings llguidance, not
xgrammar (the default, as in SGLang), so a server without xgrammar serves structured outputs with
llguidance and says so in its log, rather than refusing every ``response_format``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from pdserve import grammar
from pdserve.config import ServerArgs
from tests.helpers.checkpoints import build_tiny_checkpoint


@pytest.fixture
def missing(monkeypatch):
    """Make the packages named in the returned set look uninstalled to ``resolve_backend``."""
    gone: set[str] = set()
    real = grammar.importlib.util.find_spec
    monkeypatch.setattr(
        grammar.importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name)
    )
    return gone


def test_a_missing_xgrammar_gives_way_to_llguidance_saying_so(missing):
    missing.add("xgrammar")
    name, why = grammar.resolve_backend("xgrammar")
    assert name == "llguidance"
    assert "'xgrammar' is not installed" in why and "llguidance" in why
    args = ServerArgs(model_path="unused")
    assert args.grammar_backend == "llguidance"
    assert args.start_notes() == [why]


def test_an_installed_engine_or_none_is_kept(missing):
    for name in ("xgrammar", "llguidance", "none"):
        assert grammar.resolve_backend(name) == (name, "")
        assert ServerArgs(model_path="unused", grammar_backend=name).start_notes() == []


def test_no_engine_installed_keeps_the_name_and_its_error(missing):
    missing.update({"xgrammar", "llguidance"})
    assert grammar.resolve_backend("xgrammar") == ("xgrammar", "")


# an offline engine on the default flags in a Python where `import xgrammar` fails
_WITHOUT_XGRAMMAR = textwrap.dedent(
    """
    import json, sys
    sys.modules["xgrammar"] = None  # as if not installed: import raises, find_spec finds nothing
    import pdserve
    eng = pdserve.Engine(model_path=sys.argv[1], torch_num_threads=1, max_total_tokens=4096)
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    out = eng.generate(input_ids=eng.tokenizer.encode("Answer in JSON:"),
                       sampling_params={"temperature": 0, "max_new_tokens": 64,
                                        "json_schema": json.dumps(schema)})
    print("RESULT " + json.dumps({"backend": eng.server_args.grammar_backend,
                                  "text": out["text"],
                                  "finish": out["meta_info"]["finish_reason"]["type"]}))
    """
)


def test_default_flags_without_xgrammar_answer_schema_valid_json():
    import jsonschema

    path = build_tiny_checkpoint("llama")
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_XGRAMMAR, path],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["backend"] == "llguidance"
    assert "'xgrammar' is not installed" in proc.stderr  # the warning is logged
    assert result["finish"] == "stop", result
    jsonschema.validate(
        json.loads(result["text"]),
        {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}},
    )
