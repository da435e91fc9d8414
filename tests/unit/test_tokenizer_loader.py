"""``pdserve.tokenizer.load_tokenizer``: the tokenizer AutoTokenizer gives, for model kinds where
AutoTokenizer keeps the checkpoint's generic class and kinds where it swaps in its own; the
second load of a checkpoint whose recorded class is the generic one builds it in a process that
imports neither torch nor transformers' configuration classes; edited files are looked at again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

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
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab()
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
    prompt = dict(tokenize=False, add_generation_prompt=True)
    assert a.apply_chat_template(MESSAGES, **prompt) == b.apply_chat_template(MESSAGES, **prompt)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizer-classes"


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "deepseek_v3", "qwen2", "phi3"])
def test_same_tokenizer_as_autotokenizer_first_and_second_time(tmp_path, cache, model_type):
    d = checkpoint(tmp_path, model_type)
    ref = AutoTokenizer.from_pretrained(d)
    first = loader.load_tokenizer(str(d))
    (record,) = cache.iterdir()
    generic = type(ref) is TokenizersBackend
    assert (record.read_text().strip() == loader.GENERIC) == generic
    second = loader.load_tokenizer(str(d))
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
        "print(json.dumps({'cls': type(t).__name__, 'ids': t.encode('Hello world'),\n"
        "  'torch': 'torch' in sys.modules,\n"
        "  'config': 'transformers.configuration_utils' in sys.modules}))\n"
    )
    env = {"PDSERVE_CACHE": str(cache.parent), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_recorded_generic_class_loads_without_torch(tmp_path, cache):
    d = checkpoint(tmp_path, "llama")
    cold = _load_in_a_fresh_process(d, cache)
    assert cold["torch"] and cold["config"]  # AutoTokenizer decided
    warm = _load_in_a_fresh_process(d, cache)
    assert not warm["torch"] and not warm["config"]
    assert warm["cls"] == cold["cls"] == "TokenizersBackend" and warm["ids"] == cold["ids"]


def test_a_recorded_special_class_still_goes_through_autotokenizer(tmp_path, cache):
    d = checkpoint(tmp_path, "qwen2")
    cold = _load_in_a_fresh_process(d, cache)
    warm = _load_in_a_fresh_process(d, cache)
    assert warm["torch"] and warm["cls"] == cold["cls"] != "TokenizersBackend"


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
