"""GPT-OSS's non-MoE parts against HF transformers: YaRN RoPE tables (and the rotation that uses
them, in PyTorch and in the CPU kernel) and GPT-OSS's RMSNorm."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from pdserve import kernels
from pdserve.layers.norm import GptOssRMSNorm, RMSNorm
from pdserve.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    attention_factor,
    inv_frequencies,
    rope_parameters,
)

torch.set_num_threads(1)

# around and well past the original context of both configs below (4,096 and 32,768)
POSITIONS = torch.tensor([0, 1, 77, 4095, 4096, 4097, 9000, 32767, 32768, 40000, 131071])


def tables(config, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = RotaryEmbedding(head_dim, rope_parameters(config), 4096)
    rotary.reserve(int(POSITIONS.max()) + 1, torch.device("cpu"))
    return rotary(POSITIONS)


def test_yarn_tables_equal_gpt_oss_rotary_embedding():
    config = GptOssConfig(num_hidden_layers=2)
    assert (
        rope_parameters(config)["rope_type"] == "yarn"
        and config.rope_parameters["truncate"] is False
    )
    cos, sin = tables(config, config.head_dim)
    x = torch.zeros(1, dtype=torch.float32)
    hf_cos, hf_sin = hf_gpt_oss.GptOssRotaryEmbedding(config)(
        x, POSITIONS[None]
    )  # [1, T, head_dim / 2]
    half = config.head_dim // 2
    for ours, theirs in ((cos, hf_cos[0]), (sin, hf_sin[0])):
        assert torch.equal(ours[:, :half], theirs) and torch.equal(ours[:, half:], theirs)
    assert (
        abs(cos[0, 0].item() - (0.1 * torch.log(torch.tensor(32.0)).item() + 1)) < 1e-6
    )  # the attention factor


def test_yarn_tables_equal_qwen_rotary_embedding():
    config = Qwen2Config(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        max_position_embeddings=131072,
        rope_theta=1e6,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    )
    cos, sin = tables(config, 32)
    hf_cos, hf_sin = Qwen2RotaryEmbedding(config)(
        torch.zeros(1, dtype=torch.float32), POSITIONS[None]
    )
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    # a transformers-4 style dict config (rope_theta and rope_scaling outside) reads the same
    legacy = {
        "rope_theta": 1e6,
        "max_position_embeddings": 131072,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    assert torch.equal(tables(legacy, 32)[0], cos)


@pytest.mark.parametrize(
    "extra",
    [
        {
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        {
            "factor": 8.0,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "original_max_position_embeddings": 2048,
        },  # truncates
        {
            "factor": 40.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
        },
        {"factor": 4.0, "attention_factor": 1.25, "original_max_position_embeddings": 8192},
        {"factor": 0.5, "original_max_position_embeddings": 8192},  # no attention scaling below 1
        {
            "factor": None,
            "original_max_position_embeddings": 16384,
        },  # factor from max_position_embeddings
        {"factor": 2.0},  # original context from max_position_embeddings
    ],
)
def test_yarn_parameters_equal_transformers(extra):
    config = Qwen2Config(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        max_position_embeddings=65536,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, **extra},
    )
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    params = rope_parameters(config)
    assert torch.equal(inv_frequencies(64, params), hf_inv)
    assert attention_factor(params) == hf_factor


def test_llama_rope_types_keep_no_attention_factor():
    for params in (
        {"rope_type": "default", "rope_theta": 1e4},
        {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    ):
        assert attention_factor(params) == 1.0
        assert RotaryEmbedding(16, params, 8).scaling == 1.0
    with pytest.raises(ValueError, match="rope_type: 'dynamic' is not supported"):
        rope_parameters({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}})
    # a type that is supported but lacks its fields names them
    with pytest.raises(ValueError, match="rope_type 'longrope' needs \\['short_factor'"):
        rope_parameters({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})


@pytest.fixture(scope="module")
def ops():
    mod = kernels.load()
    assert mod is not None, f"CPU kernels did not build: {kernels.unavailable_reason()}"
    return mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_gpt_oss_halves(ops, dtype):
    """GPT-OSS rotates the halves (``torch.chunk``) with first*cos - second*sin, second*cos +
    first*sin: the same products and sums as rotate-half, so the same bits; in PyTorch and in the
    CPU kernel, which takes the float32 tables and rounds them as HF's ``cos.to(dtype)`` does."""
    config = GptOssConfig(num_hidden_layers=2)
    cos, sin = tables(config, 64)
    t = POSITIONS.numel()
    hf_cos, hf_sin = hf_gpt_oss.GptOssRotaryEmbedding(config)(
        torch.zeros(1, dtype=dtype), POSITIONS[None]
    )
    gen = torch.Generator().manual_seed(0)
    qkv = (3 * torch.randn(t, (8 + 2 * 2) * 64, generator=gen)).to(dtype)
    q, k = qkv[:, : 8 * 64].view(t, 8, 64), qkv[:, 8 * 64 : 10 * 64].view(t, 2, 64)
    hf_q, hf_k = hf_gpt_oss.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin
    )
    hf_q, hf_k = hf_q[0].transpose(0, 1), hf_k[0].transpose(0, 1)
    assert torch.equal(apply_rotary(q, cos.to(dtype), sin.to(dtype)), hf_q)
    assert torch.equal(apply_rotary(k, cos.to(dtype), sin.to(dtype)), hf_k)
    ops.rotary_embedding(q, k, cos, sin)  # in place, into the qkv rows
    assert torch.equal(q, hf_q) and torch.equal(k, hf_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpt_oss_rms_norm_equals_hf(dtype):
    gen = torch.Generator().manual_seed(1)
    hidden = 2880
    x = (4 * torch.randn(6, hidden, generator=gen)).to(dtype)
    residual = torch.randn(6, hidden, generator=gen).to(dtype)
    weight = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype)
    ours = GptOssRMSNorm(hidden, 1e-5).to(dtype)
    ours.weight.data.copy_(weight)
    hf = hf_gpt_oss.GptOssRMSNorm(hidden, 1e-5).to(dtype)
    hf.weight.data.copy_(weight)
    hf32 = hf_gpt_oss.GptOssRMSNorm(hidden, 1e-5)  # HF keeps this module's weight in float32
    hf32.weight.data.copy_(weight.float())
    with torch.no_grad():
        want = hf(x)
        assert want.dtype == dtype
        assert torch.equal(ours(x), want) and torch.equal(hf32(x), want)
        # the fused form: the residual stream adds in the activation dtype, as HF's decoder layer
        # does
        out, stream = ours(x, residual)
        assert torch.equal(stream, x + residual) and torch.equal(out, hf(x + residual))
        if dtype == torch.bfloat16:  # Llama's rounding (cast, then the weight) gives other bits
            llama = RMSNorm(hidden, 1e-5).to(dtype)
            llama.weight.data.copy_(weight)
            assert not torch.equal(llama(x), want)
