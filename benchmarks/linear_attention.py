"""A linear-attention mixer layer's decode step and prefill scan: the torch code against pdserve's
CPU kernels.

  taskset -c 1 python benchmarks/linear_attention.py [--batches 1,8] [--tokens 16,256,1024]
      [--threads 1] [--dtype bfloat16] [--iters 30]

Decode: ``_step`` of each mixer (the convolution over the window, SiLU, the
recurrent update of each request's state at its slot of the pool, the output; not the projections
or the gated norm) with ``ops`` None (torch) and with the kernels, on random weights and states,
requests at scattered slots of a pool of 2 x batch. Prefill: ``_extend`` of one
request of ``--tokens`` new tokens after a prefix (torch: the chunked scan in blocks of 256, 64 or
16; the kernel: the recurrence token by token). Sizes:

- ``mamba2``: Granite-4.0-H-350M's layer (benchmarks/hybrid.py): 48 heads of 32, one group, state
  128, conv 4 (conv_dim 1,792; state 768 KiB per request).
- ``gated_deltanet``: Qwen3-Next-80B-A3B's layer, one rank: 16 key heads, 32 value heads,
  dk = dv = 128, conv 4 (conv_dim 8,192; state 2 MiB per request).
- ``kimi_delta``: Kimi-Linear-48B-A3B's Kimi Delta Attention layer, one rank: 32 heads,
  dk = dv = 128, conv 4, a decay per key channel (conv_dim 12,288; state 2 MiB per request);
  the Gated DeltaNet's ``_step`` / ``_extend`` given g [.., H, dk] (torch: blocks of 16 with the
  decays kept per channel).
- ``short_conv``: LFM2-1.2B's gated short convolution (hidden 2,048, conv 3, no recurrence: the
  convolution of B * x alone; state 8 KiB per request).

Each decode time is the median of ``--iters`` steps after 3 untimed ones, each prefill time the
median of 3 after one; "state GB/s" is the state's bytes read and written once per step over the
kernel's time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def mixers(dtype: torch.dtype) -> dict:
    from pdserve.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetDims
    from pdserve.layers.mamba2 import Mamba2Dims, Mamba2Mixer

    torch.manual_seed(0)
    m = Mamba2Mixer(Mamba2Dims(768, 48, 32, 1, 128, 4, 256, 1e-5), kv_layer=0)
    g = GatedDeltaNet(GatedDeltaNetDims(2048, 16, 32, 128, 128, 4, 1e-6), kv_layer=0)
    with torch.no_grad():
        for p in (m.conv1d.weight, m.conv1d.bias, m.D, g.conv1d.weight):
            p.normal_(0, 0.5)
        m.dt_bias.normal_(0, 1)
        m.A_log.uniform_(0, 2.5)
    from pdserve.models.kimi_linear import KimiDeltaAttention

    k = KimiDeltaAttention(GatedDeltaNetDims(2304, 32, 32, 128, 128, 4, 1e-5), kv_layer=0)
    with torch.no_grad():
        k.conv1d.weight.normal_(0, 0.5)
    from pdserve.layers.short_conv import ShortConvMixer

    c = ShortConvMixer(2048, 3, False, kv_layer=0)
    with torch.no_grad():
        c.conv.weight.normal_(0, 0.5)
    return {
        "mamba2": m.to(dtype),
        "gated_deltanet": g.to(dtype),
        "kimi_delta": k.to(dtype),
        "short_conv": c.to(dtype),
    }


def decays(name: str, mixer, n: int) -> torch.Tensor:
    """The log of the decay of n tokens: per value head, or per key channel (``kimi_delta``)."""
    d = mixer.dims
    shape = (n, d.value_heads, d.key_dim) if name == "kimi_delta" else (n, d.value_heads)
    return -torch.rand(shape) * (0.1 if name == "kimi_delta" else 1.0)


def step_inputs(name: str, mixer, batch: int, dtype: torch.dtype):
    """(the step's inputs, the pool's states, the slots)"""
    slots_n = 2 * batch
    if name == "short_conv":
        conv = torch.randn(slots_n, mixer.channels, mixer.kernel - 1).to(dtype)
        return (
            (torch.randn(batch, mixer.channels).to(dtype),),
            (conv,),
            torch.randperm(slots_n)[:batch],
        )
    d = mixer.dims
    conv = torch.randn(slots_n, d.conv_dim, d.conv_kernel - 1).to(dtype)
    slots = torch.randperm(slots_n)[:batch]
    if name == "mamba2":
        state = torch.randn(slots_n, d.heads, d.head_dim, d.state)
        inputs = (torch.randn(batch, d.conv_dim).to(dtype), torch.randn(batch, d.heads).to(dtype))
    else:
        state = torch.randn(slots_n, d.value_heads, d.key_dim, d.value_dim) * 0.1
        hv = d.value_heads
        inputs = (
            torch.randn(batch, d.conv_dim).to(dtype),
            decays(name, mixer, batch),
            torch.rand(batch, hv),
        )
    return inputs, (conv, state), slots


def extend_inputs(name: str, mixer, n: int, dtype: torch.dtype):
    """(the extend's inputs, the pool's states) of one request of n new tokens in slot 1"""
    if name == "short_conv":
        conv = torch.randn(2, mixer.channels, mixer.kernel - 1).to(dtype)
        return (torch.randn(n, mixer.channels).to(dtype),), (conv,)
    d = mixer.dims
    conv = torch.randn(2, d.conv_dim, d.conv_kernel - 1).to(dtype)
    if name == "mamba2":
        state = torch.randn(2, d.heads, d.head_dim, d.state)
        return (torch.randn(n, d.conv_dim).to(dtype), torch.randn(n, d.heads).to(dtype)), (
            conv,
            state,
        )
    state = torch.randn(2, d.value_heads, d.key_dim, d.value_dim) * 0.1
    hv = d.value_heads
    return (torch.randn(n, d.conv_dim).to(dtype), decays(name, mixer, n), torch.rand(n, hv)), (
        conv,
        state,
    )


def median_seconds(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batches", default="1,8")
    p.add_argument("--tokens", default="16,256,1024")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from pdserve import kernels

    ops = kernels.load()
    if ops is None:
        raise SystemExit(f"pdserve's CPU kernels are not available: {kernels.unavailable_reason()}")
    dtype = getattr(torch, a.dtype)
    print(f"{a.dtype}, {a.threads} thread(s), kernels at ISA {ops.isa()}")
    print("| layer | batch | torch ms | kernel ms | kernel / torch | state GB/s (kernel) |")
    print("|---|---|---|---|---|---|")
    for name, mixer in mixers(dtype).items():
        for batch in (int(b) for b in a.batches.split(",")):
            inputs, states, slots = step_inputs(name, mixer, batch, dtype)
            times = {}
            for label, impl in (("torch", None), ("kernel", ops)):
                mixer.ops = impl
                with torch.no_grad():
                    times[label] = median_seconds(
                        lambda: mixer._step(*inputs, *states, slots), a.iters
                    )
            moved = 2 * states[-1][0].nbytes * batch  # the recurrent state (or the window)
            print(
                f"| {name} | {batch} | {times['torch'] * 1e3:.3f} | {times['kernel'] * 1e3:.3f} "
                f"| {times['kernel'] / times['torch']:.3f} | {moved / times['kernel'] / 1e9:.1f} |"
            )
    print()
    print(
        "| layer | prefill tokens | torch ms | kernel ms | kernel / torch | kernel µs per token |"
    )
    print("|---|---|---|---|---|---|")
    for name, mixer in mixers(dtype).items():
        for n in (int(t) for t in a.tokens.split(",")):
            inputs, states = extend_inputs(name, mixer, n, dtype)
            times = {}
            for label, impl in (("torch", None), ("kernel", ops)):
                mixer.ops = impl
                with torch.no_grad():
                    times[label] = median_seconds(
                        lambda: mixer._extend(*inputs, 64, *states, 1), 3, warmup=1
                    )
            print(
                f"| {name} | {n} | {times['torch'] * 1e3:.2f} | {times['kernel'] * 1e3:.2f} "
                f"| {times['kernel'] / times['torch']:.3f} | {times['kernel'] / n * 1e6:.1f} |"
            )


if __name__ == "__main__":
    main()
