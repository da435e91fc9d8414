"""``pdserve.models.hf_config``: the recorded configuration of every family the tests build has
every attribute of ``AutoConfig``'s object, with its value and type (fields, derived values,
properties, nested configurations, the aliases of ``attribute_map``), the first time and the next;
a later process reads it without transformers' configuration classes; edited files are read
again; what the record cannot hold fails loudly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoConfig

from pdserve.models import hf_config
from tests.helpers.checkpoints import ARCHS, tiny_config


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / hf_config.KIND


def config_dir(root, arch: str, **overrides):
    d = root / arch
    tiny_config(arch, **overrides).save_pretrained(d)
    return d


def same_attributes(ref, got, path: str = "") -> None:
    attrs = hf_config.snapshot(ref)
    assert attrs, path
    for name, value in attrs.items():
        where = f"{path}{name}"
        if name in got._unrecorded:
            with pytest.raises(TypeError, match=name):
                getattr(got, name, None)
            continue
        mine = getattr(got, name)
        if name == "per_layer_config":  # a heterogeneous configuration's layers (a view there)
            assert len(mine) == len(value), where
            for i, (layer, recorded) in enumerate(zip(value, mine)):
                same_attributes(layer, recorded, f"{where}[{i}].")
            continue
        if hf_config._is_config(value):
            same_attributes(value, mine, where + ".")
            continue
        assert type(mine) is type(value), where
        assert mine == value, where
    for alias in getattr(ref, "attribute_map", None) or {}:
        assert getattr(got, alias) == getattr(ref, alias), f"{path}{alias} (alias)"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_attribute_as_autoconfig_gives_it_first_time_and_next(tmp_path, cache, arch):
    d = config_dir(tmp_path, arch)
    ref = AutoConfig.from_pretrained(d)
    first = hf_config.load_hf_config(str(d))
    assert len(list(cache.iterdir())) == 1
    second = hf_config.load_hf_config(str(d))
    assert isinstance(first, hf_config.RecordedConfig)
    same_attributes(ref, first)
    same_attributes(ref, second)


def test_what_the_record_holds_beyond_json(tmp_path, cache):
    """Tuples, sets, dicts with int keys and dtypes come back as themselves, not as lists and
    strings; writes to an alias go where the class sends them."""
    d = config_dir(tmp_path, "gpt_oss", id2label={0: "a", 1: "b"}, dtype="bfloat16")
    hf_config.load_hf_config(str(d))
    got = hf_config.load_hf_config(str(d))
    import torch

    assert got.id2label == {0: "a", 1: "b"}
    assert got.dtype is torch.bfloat16
    ref = AutoConfig.from_pretrained(d)
    sets = [n for n, v in hf_config.snapshot(ref).items() if isinstance(v, set)]
    assert sets and all(isinstance(getattr(got, n), set) for n in sets)
    alias, target = next(iter(ref.attribute_map.items()))
    setattr(got, alias, 7)
    setattr(ref, alias, 7)
    assert getattr(got, target) == getattr(ref, target) == 7


def _load_in_a_fresh_process(d, cache) -> dict:
    code = (
        "import json, sys\n"
        "from pdserve.models.hf_config import load_hf_config\n"
        f"c = load_hf_config({str(d)!r})\n"
        "print(json.dumps({'layers': c.num_hidden_layers, 'cls': type(c).__name__,\n"
        "  'classes': 'transformers.models.auto.configuration_auto' in sys.modules}))\n"
    )
    env = {"PDSERVE_CACHE": str(cache.parent), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_recorded_config_loads_without_the_configuration_classes(tmp_path, cache):
    d = config_dir(tmp_path, "qwen3_moe")
    cold = _load_in_a_fresh_process(d, cache)
    assert cold["classes"]  # AutoConfig read it
    warm = _load_in_a_fresh_process(d, cache)
    assert not warm["classes"]
    assert warm == {**cold, "classes": False} and warm["cls"] == "RecordedConfig"


def test_edited_files_are_read_again(tmp_path, cache):
    d = config_dir(tmp_path, "llama")
    assert hf_config.load_hf_config(str(d)).num_hidden_layers == 2
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 3}))
    assert hf_config.load_hf_config(str(d)).num_hidden_layers == 3
    assert len(list(cache.iterdir())) == 2


def test_an_unreadable_record_is_replaced(tmp_path, cache, caplog):
    d = config_dir(tmp_path, "llama")
    hf_config.load_hf_config(str(d))
    (record,) = cache.iterdir()
    record.write_text("{not json")
    assert hf_config.load_hf_config(str(d)).hidden_size == tiny_config("llama").hidden_size
    assert "unreadable config record" in caplog.text
    assert json.loads(record.read_text())["format"] == hf_config.FORMAT


def test_unknown_attributes_are_attribute_errors(tmp_path, cache):
    got = hf_config.load_hf_config(str(config_dir(tmp_path, "llama")))
    assert getattr(got, "no_such_field", "default") == "default"


def test_copies_are_independent_records(tmp_path, cache):
    """As the draft heads use it: a shallow copy, then fields changed on the copy only."""
    import copy

    got = hf_config.load_hf_config(str(config_dir(tmp_path, "deepseek_v3")))
    layers = got.num_hidden_layers
    mine = copy.copy(got)
    mine.num_hidden_layers = layers + 1
    assert got.num_hidden_layers == layers and mine.num_hidden_layers == layers + 1
    assert copy.deepcopy(got).hidden_size == got.hidden_size
    with pytest.raises(TypeError, match="per_layer_config"):
        getattr(mine, "per_layer_config", None)
