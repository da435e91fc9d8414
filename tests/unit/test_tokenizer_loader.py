"""``pdserve.tokenizer.load_tokenizer``: the tokenizer AutoTokenizer gives, for model kinds where
AutoTokenizer keeps the checkpoint's generic class and kinds where it swaps in its own; the
second load of a checkpoint whose tokenizer works in the ``tokenizers`` library builds a recorded
tokenizer in a process that imports neither torch nor transformers, and it behaves as
AutoTokenizer's does (vocabulary, special tokens, encodings, decodings, chat template); a
tokenizer the record cannot stand for is loaded through AutoTokenizer every time; edited files
are looked at again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, TokenizersBackend

from pdserve import records
from pdserve import tokenizer as loader
from tests.helpers.checkpoints import smollm2_tokenizer_dir

TEXTS = ["Hello world", "  leading spaces\tand tabs\n", "héllo wörld — 東京 🙂", "<|im_start|>x"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def checkpoint(root, model_type: str):
    """The test checkpoints' tokenizer with a config of ``model_type`` (no weights: the choice
    of tokenizer class reads neither)."""
    d = root / model_type
    shutil.copytree(smollm2_tokenizer_dir(), d)
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return d


def same_behaviour(a, b) -> None:
    assert a.get_vocab() == b.get_vocab() and len(a) == len(b) and a.vocab_size == b.vocab_size
    assert a.all_special_tokens == b.all_special_tokens
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (
        b.bos_token_id,
        b.eos_token_id,
        b.pad_token_id,
    )
    assert a.model_max_length == b.model_max_length and a.padding_side == b.padding_side
    assert a.chat_template == b.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = a.encode(text, add_special_tokens=special)
            assert ids == b.encode(text, add_special_tokens=special)
            assert a.decode(ids) == b.decode(ids)
            assert a(text, add_special_tokens=special)["input_ids"] == ids
            for skip in (True, False):
                assert a.decode(ids, skip_special_tokens=skip) == b.decode(
                    ids, skip_special_tokens=skip
                )
    every = list(range(len(b)))
    assert a.decode(every) == b.decode(every)
    assert a.convert_ids_to_tokens(every) == b.convert_ids_to_tokens(every)
    prompt = dict(tokenize=False, add_generation_prompt=True)
    assert a.apply_chat_template(MESSAGES, **prompt) == b.apply_chat_template(MESSAGES, **prompt)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / loader.KIND


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "deepseek_v3", "qwen2", "phi3"])
def test_same_tokenizer_as_autotokenizer_first_and_second_time(tmp_path, cache, model_type):
    d = checkpoint(tmp_path, model_type)
    ref = AutoTokenizer.from_pretrained(d)
    first = loader.load_tokenizer(str(d))
    assert type(first) is type(ref)  # the first load is AutoTokenizer's own
    (record,) = cache.iterdir()
    recorded = record.read_text().strip() != loader.HF
    second = loader.load_tokenizer(str(d))
    assert isinstance(second, loader.Tokenizer) == recorded
    if type(ref) is TokenizersBackend:
        assert recorded  # the generic class always works in the tokenizers library
    same_behaviour(first, ref)
    same_behaviour(second, ref)


def test_kinds_where_autotokenizer_swaps_the_class_are_covered(tmp_path, cache):
    """The parametrization above reaches both of AutoTokenizer's outcomes here."""
    kinds = {
        t: type(AutoTokenizer.from_pretrained(checkpoint(tmp_path, t))) for t in ("llama", "qwen2")
    }
    assert kinds["llama"] is TokenizersBackend
    assert kinds["qwen2"] is not TokenizersBackend


def _load_in_a_fresh_process(d, cache) -> dict:
    code = (
        "import json, sys\n"
        "from pdserve.tokenizer import load_tokenizer\n"
        f"t = load_tokenizer({str(d)!r})\n"
        "ids = t.encode('Hello world')\n"
        "text = t.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)\n"
        "print(json.dumps({'cls': type(t).__name__, 'ids': ids, 'text': text,\n"
        "  'torch': 'torch' in sys.modules, 'transformers': 'transformers' in sys.modules,\n"
        "  'config': 'transformers.configuration_utils' in sys.modules}))\n"
    )
    env = {"PDSERVE_CACHE": str(cache.parent), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_recorded_tokenizer_loads_without_transformers(tmp_path, cache):
    d = checkpoint(tmp_path, "llama")
    cold = _load_in_a_fresh_process(d, cache)
    assert cold["torch"] and cold["config"]  # AutoTokenizer decided
    assert cold["cls"] == "TokenizersBackend"
    warm = _load_in_a_fresh_process(d, cache)
    assert not warm["torch"] and not warm["transformers"]
    assert warm["cls"] == "Tokenizer" and warm["ids"] == cold["ids"]
    assert (
        warm["text"] == cold["text"]
    )  # decoded as a server's detokenizer asks, still no transformers


def test_what_the_record_cannot_stand_for_goes_through_autotokenizer(tmp_path, cache):
    """Decoded text cleaned of spaces is transformers' Python, not the tokenizers library's: such
    a tokenizer is recorded as "load through AutoTokenizer", and is, in a fresh process too."""
    d = checkpoint(tmp_path, "llama")
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(
        json.dumps({**config, "clean_up_tokenization_spaces": True})
    )
    cold = _load_in_a_fresh_process(d, cache)
    (record,) = cache.iterdir()
    assert record.read_text().strip() == loader.HF
    warm = _load_in_a_fresh_process(d, cache)
    assert warm["torch"] and warm["cls"] == cold["cls"] == "TokenizersBackend"


def test_a_record_that_would_differ_is_not_kept(tmp_path, cache, monkeypatch):
    """The probes decide: a recorded tokenizer that encodes one text differently from the class
    AutoTokenizer built is not recorded."""
    d = checkpoint(tmp_path, "llama")
    real = loader.Tokenizer.encode

    def off_by_one(self, text, add_special_tokens=True, **kwargs):
        ids = real(self, text, add_special_tokens, **kwargs)
        return ids[:-1] if "東京" in text else ids

    monkeypatch.setattr(loader.Tokenizer, "encode", off_by_one)
    loader.load_tokenizer(str(d))
    (record,) = cache.iterdir()
    assert record.read_text().strip() == loader.HF


def test_what_a_recorded_tokenizer_does_not_do_itself_goes_to_transformers(tmp_path, cache):
    d = checkpoint(tmp_path, "llama")
    loader.load_tokenizer(str(d))
    t = loader.load_tokenizer(str(d))
    assert isinstance(t, loader.Tokenizer) and t._hf is None
    ref = AutoTokenizer.from_pretrained(d)
    prompt = dict(tokenize=True, add_generation_prompt=True, return_dict=False)
    assert t.apply_chat_template(MESSAGES, **prompt) == ref.apply_chat_template(MESSAGES, **prompt)
    assert type(loader.transformers_tokenizer(t)) is type(ref)
    assert t.padding_side == ref.padding_side  # any other attribute: transformers' tokenizer


def test_edited_files_are_decided_again(tmp_path, cache):
    """The record is per file contents: a config that now names another kind is looked at."""
    d = checkpoint(tmp_path, "llama")
    loader.load_tokenizer(str(d))
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    t = loader.load_tokenizer(str(d))
    assert type(t) is type(AutoTokenizer.from_pretrained(d)) is not TokenizersBackend
    assert len(list(cache.iterdir())) == 2


def test_hub_ids_and_object_arguments_are_not_recorded(tmp_path, cache):
    assert records.key("org/model-name", {}) == ""
    d = checkpoint(tmp_path, "llama")
    assert records.key(str(d), {"local_files_only": True})
    assert records.key(str(d), {"local_files_only": True}) != records.key(str(d), {})
    assert records.key(str(d), {"config": object()}) == ""


# templates that use what transformers' Jinja environment adds: namespace, loop controls, tojson
# with its arguments, dict(), raise_exception, the generation tag, the special tokens' variables
FEATURES_TEMPLATE = (
    "{% set ns = namespace(n=0, sys='') %}{{ bos_token }}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.sys = m['content'] %}"
    "{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "<{{ m['role'] }} n={{ ns.n }}>"
    "{% if m.content is string %}{{ m['content'] }}{% else %}"
    "{{ m['content'] | tojson(indent=2, sort_keys=True) }}{% endif %}"
    "{% if m.reasoning_content is defined %}[think]{{ m.reasoning_content }}{% endif %}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
    "{{ dict(name=c.function.name, args=c.function.arguments) | tojson }}{% endfor %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}"
    "{% if loop.index > 5 %}{% break %}{% endif %}\n{% endfor %}"
    "{% if tools %}TOOLS {{ tools | tojson(separators=(',', ':')) }}\n{% endif %}"
    "{% if ns.sys %}SYSTEM {{ ns.sys }}{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not "
    "enable_thinking %}[no think]{% endif %}{% endif %}"
    "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('a tool cannot come first') }}"
    "{% endif %}"
)
CHATS = [
    [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi", "thinking": "t"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a\n  b"}],
    [{"role": "tool", "content": "x"}],
    [{"role": "user", "content": [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}]}],
    [{"role": "user", "content": str(i)} for i in range(8)],
    [
        {"role": "user", "content": "call it"},
        {"role": "assistant", "content": "", "tool_calls": [loader.CALL], "reasoning": "r"},
        {"role": "tool", "content": "21C", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is 21C"},
    ],
]


def _rendered(t, template, chat, **kw):
    try:
        return t.apply_chat_template(chat, chat_template=template, tokenize=False, **kw)
    except Exception as e:
        return type(e).__name__


@pytest.mark.parametrize(
    "template",
    [None, FEATURES_TEMPLATE, (Path(__file__).parents[1] / "e2e/data/tools_think_template.jinja")],
    ids=["checkpoint", "features", "tools-think"],
)
def test_a_recorded_tokenizer_renders_chats_as_transformers(tmp_path, cache, template):
    """Conversations beyond the record's probes, rendered here and by transformers: the same text
    or the same error, for every mode the servers use."""
    if isinstance(template, Path):
        template = template.read_text()
    d = checkpoint(tmp_path, "llama")
    ref = AutoTokenizer.from_pretrained(d)
    loader.load_tokenizer(str(d))
    t = loader.load_tokenizer(str(d))
    assert isinstance(t, loader.Tokenizer) and t._renders_chat
    modes = (
        {"add_generation_prompt": True},
        {"add_generation_prompt": True, "tools": [loader.TOOL], "enable_thinking": False},
        {},
    )
    for chat in CHATS:
        for kw in modes:
            assert _rendered(t, template, chat, **kw) == _rendered(ref, template, chat, **kw)
    assert t._hf is None  # every one of them rendered without transformers
    # a final message to continue: rendered here when it is text the template keeps, else (parts,
    # a template that drops it) by transformers, which also raises what it raises
    for chat in CHATS:
        kw = {"continue_final_message": True}
        assert _rendered(t, template, chat, **kw) == _rendered(ref, template, chat, **kw)


def test_a_rendering_that_would_differ_is_left_to_transformers(tmp_path, cache, monkeypatch):
    from pdserve import chat_template

    d = checkpoint(tmp_path, "llama")
    real = chat_template.render
    monkeypatch.setattr(chat_template, "render", lambda *a, **k: real(*a, **k) + " ")
    loader.load_tokenizer(str(d))
    (record,) = cache.iterdir()
    assert json.loads(record.read_text())["renders_chat"] is False
    monkeypatch.setattr(chat_template, "render", real)
    t = loader.load_tokenizer(str(d))
    assert isinstance(t, loader.Tokenizer) and not t._renders_chat
    ref = AutoTokenizer.from_pretrained(d)
    prompt = dict(tokenize=False, add_generation_prompt=True)
    assert t.apply_chat_template(MESSAGES, **prompt) == ref.apply_chat_template(MESSAGES, **prompt)
    assert t._hf is not None  # through transformers
