"""LoRA pieces on their own: what an adapter directory may hold (refusals name the field), the
layer's delta for mixed rows against the plain formula, ``--lora-paths`` and the flags LoRA does
not run with, and the router's prompt keys per adapter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pdserve.config import ServerArgs
from pdserve.lora import layer
from pdserve.lora.adapter import AdapterError, read_adapter
from pdserve.lora_args import parse_lora_paths
from pdserve.router.kv_index import PromptBlocks

PREFIX = "base_model.model.model.layers.0.self_attn.q_proj"


def write_adapter(d, config: dict, tensors: dict) -> str:
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    save_file(tensors, str(d / "adapter_model.safetensors"))
    return str(d)


def pair(r: int, n_in: int = 8, n_out: int = 6) -> dict:
    return {
        f"{PREFIX}.lora_A.weight": torch.randn(r, n_in),
        f"{PREFIX}.lora_B.weight": torch.randn(n_out, r),
    }


def test_an_adapter_reads_its_pairs_and_folds_the_scaling_into_b(tmp_path):
    tensors = pair(4)
    path = write_adapter(tmp_path / "a", {"r": 4, "lora_alpha": 8}, tensors)
    a = read_adapter("a", path, max_rank=64)
    ((module, (A, B)),) = a.modules.items()
    assert module == "model.layers.0.self_attn.q_proj" and a.rank == 4
    assert torch.equal(A, tensors[f"{PREFIX}.lora_A.weight"])
    assert torch.equal(B, tensors[f"{PREFIX}.lora_B.weight"] * 2)
    rs = read_adapter(
        "b",
        write_adapter(tmp_path / "b", {"r": 4, "lora_alpha": 8, "use_rslora": True}, tensors),
        64,
    )
    assert torch.allclose(rs.modules[module][1], tensors[f"{PREFIX}.lora_B.weight"] * 4)
    # the same files key the same namespace; other files another
    assert read_adapter("c", path, 64).namespace_key == a.namespace_key != rs.namespace_key
    assert a.namespace_key % 16 == 0 and 0 < a.namespace_key < 2**31


@pytest.mark.parametrize(
    "config, tensors, why",
    [
        ({"r": 4, "use_dora": True}, pair(4), "use_dora=True is not supported"),
        ({"r": 4, "bias": "all"}, pair(4), "bias='all' is not supported"),
        ({"r": 4, "modules_to_save": ["lm_head"]}, pair(4), "modules_to_save"),
        ({"r": 128}, pair(128), "rank r=128 is outside [1, --max-lora-rank 64]"),
        ({"r": 4, "peft_type": "IA3"}, pair(4), "peft_type 'IA3' is not LORA"),
        ({"r": 2}, pair(4), "not [r=2, in] and [out, r=2]"),
        ({"r": 4}, {f"{PREFIX}.lora_A.weight": torch.randn(4, 8)}, "has lora_A only"),
        ({"r": 4}, {"something.weight": torch.randn(2, 2)}, "not a LoRA A or B weight"),
    ],
)
def test_what_pdserve_does_not_run_is_refused_by_name(tmp_path, config, tensors, why):
    path = write_adapter(tmp_path / "x", config, tensors)
    with pytest.raises(AdapterError, match="LoRA adapter 'x'") as e:
        read_adapter("x", path, max_rank=64)
    assert why in str(e.value)


def test_a_directory_without_the_files_is_refused(tmp_path):
    with pytest.raises(AdapterError, match="needs adapter_config.json and"):
        read_adapter("x", str(tmp_path), max_rank=64)


def test_the_delta_of_mixed_rows_is_each_rows_own_adapter():
    torch.manual_seed(0)
    lora = layer.LinearLora([5, 3])  # a merged layer of two parts
    a1, b1, a2, b2, a3 = (torch.randn(s) for s in [(4, 7), (5, 4), (2, 7), (3, 2), (4, 7)])
    b3 = torch.randn(3, 4)
    lora.set(0, 0, a1, b1)  # slot 0 adapts part 0
    lora.set(1, 1, a2, b2)  # slot 1 adapts part 1
    lora.set(1, 0, a3, b1)  # ... and part 0
    with pytest.raises(ValueError, match="B has 3 output rows here, the layer's part has 5"):
        lora.set(2, 0, a3, b3)
    x, y = torch.randn(6, 7), torch.randn(6, 8)
    # requests of 2, 1, 3 tokens under slots 1, base, 0
    with layer.active([1, -1, 0], [2, 1, 3]):
        got = lora(x, y.clone())
    want = y.clone()
    want[:2, :5] += x[:2] @ a3.t() @ b1.t()
    want[:2, 5:] += x[:2] @ a2.t() @ b2.t()
    want[3:, :5] += x[3:] @ a1.t() @ b1.t()
    assert torch.allclose(got, want, atol=1e-5)
    with layer.active([0, 0, 0], [2, 1, 3]):  # one adapter for every row
        got = lora(x, y.clone())
    assert torch.allclose(
        got, y + torch.cat([x @ a1.t() @ b1.t(), torch.zeros(6, 3)], 1), atol=1e-5
    )
    assert torch.equal(lora(x, y.clone()), y)  # outside a LoRA forward: unchanged
    with layer.active([-1, -1, -1], [2, 1, 3]):  # only base rows: unchanged
        assert torch.equal(lora(x, y.clone()), y)


def test_lora_paths_and_the_flags_lora_does_not_run_with(tmp_path):
    assert parse_lora_paths(["a=/x/y", "/p/q/"]) == {"a": "/x/y", "q": "/p/q/"}
    with pytest.raises(ValueError, match="'a' is given twice"):
        parse_lora_paths(["a=/x", "a=/y"])
    args = ServerArgs(model_path="m", lora_paths=["a=/x"])
    assert args.enable_lora
    for flags, name in (
        ({"speculative_algorithm": "NGRAM"}, "--speculative-algorithm"),
        ({"pp_size": 2}, "--pp-size"),
    ):
        with pytest.raises(ValueError, match=f"enable_lora: .*{name}"):
            ServerArgs(model_path="m", enable_lora=True, **flags)
    with pytest.raises(ValueError, match="max_lora_rank"):
        ServerArgs(model_path="m", max_lora_rank=0)


def test_the_router_keys_prompts_by_adapter():
    ids = list(range(100, 164))
    base, a, b = PromptBlocks(ids), PromptBlocks(ids, "a"), PromptBlocks(ids, "b")
    assert base.hashes(16) != a.hashes(16) != b.hashes(16)
    assert a.hashes(16) == PromptBlocks(ids, "a").hashes(16)
    assert not set(base.hashes(16)) & set(a.hashes(16))


def test_the_router_learns_an_adapters_seed_from_a_workers_events():
    """A worker's adapter blocks chain from a key of the adapter's contents, which the router
    cannot know from the name: the first stored blocks named by the adapter show it, and the
    prompts for that adapter are matched against it from then on."""
    from pdserve.kv_events import BlockStored, chain_hashes, namespace_hash
    from pdserve.router.kv_index import GroupFeed

    feed = GroupFeed(None, None, 0, "tcp://127.0.0.1:1", None, b"")
    feed.block_size, feed.expected = 4, 0  # in sync
    ids = list(range(100, 116))
    seed = namespace_hash(0x1230)  # the worker's key for adapter 'a'
    hashes = chain_hashes(seed, ids, 4)
    prompt = PromptBlocks(ids, "a")
    assert feed.matched_blocks(prompt) == 0
    feed.apply([BlockStored(hashes[:2], seed, ids[:8], 4, lora_name="a")])
    feed.apply([BlockStored(hashes[2:], hashes[1], ids[8:], 4, lora_name="a")])
    assert feed.adapter_seeds == {"a": seed}  # the continuation is not taken for a seed
    assert feed.matched_blocks(prompt) == 4
    assert feed.matched_blocks(PromptBlocks(ids, "b")) == 0
    assert feed.matched_blocks(PromptBlocks(ids)) == 0
