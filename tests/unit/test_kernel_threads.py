"""pdserve's kernels give the same bits on 1 and 2 threads: every output is computed by one thread
in a fixed order (each ``at::parallel_for`` splits rows, panels or (request, head) tasks, never a
sum), and the build uses torch's OpenMP runtime, so 2 threads do split the work."""

from __future__ import annotations

import math
import os
import subprocess
import time

import pytest
import torch

from pdserve import kernels
from pdserve.layers.linear import PackedW8A8, pack_vnni16
from pdserve.layers.moe.fused import PackedExperts


@pytest.fixture(scope="module")
def ops():
    mod = kernels.load()
    assert mod is not None, f"CPU kernels did not build: {kernels.unavailable_reason()}"
    return mod


def at_1_and_2_threads(fn):
    """fn()'s results at 1 and at 2 threads (fn builds fresh outputs on each call)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn()
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        two = fn()
    finally:
        torch.set_num_threads(before)
    return one, two


def assert_same(pair):
    one, two = pair
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_the_module_uses_torchs_openmp_runtime(ops):
    needed = subprocess.run(
        ["readelf", "-d", str(kernels.kernel_build().library)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "libgomp.so.1" in needed, (
        "built without -fopenmp: at::parallel_for would run on one thread"
    )
    # the module's libgomp.so.1 resolves to the one already loaded under that name (torch's); copies
    # other wheels vendor under mangled names (sentencepiece.libs/libgomp-<hash>.so) serve only them
    with open("/proc/self/maps") as f:
        runtimes = {
            line.split()[-1]
            for line in f
            if os.path.basename(line.split()[-1]).startswith("libgomp.so")
        }
    assert len(runtimes) == 1, f"two OpenMP runtimes named libgomp.so loaded: {runtimes}"


def _cpu_ticks_per_thread() -> dict[str, int]:
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            ticks[tid] = int(f.read().rsplit(")", 1)[1].split()[11])  # utime, in clock ticks
    return ticks


def test_two_threads_share_the_work(ops):
    """At 2 threads a prefill-size GEMM runs on two OS threads, about half each (a build without
    OpenMP runs it all on the calling thread)."""
    x, packed = torch.randn(256, 512).bfloat16(), pack_vnni16(torch.randn(2048, 512))
    out = torch.empty(256, 2048, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ops.linear_vnni(out, x, packed, None)
        start, deadline = _cpu_ticks_per_thread(), time.monotonic() + 60
        while True:  # until 40 ticks of CPU time are spent, so the split is measurable
            ops.linear_vnni(out, x, packed, None)
            now = _cpu_ticks_per_thread()
            spent = sorted((now[t] - start.get(t, 0) for t in now), reverse=True)
            if sum(spent) >= 40 or time.monotonic() > deadline:
                break
    finally:
        torch.set_num_threads(before)
    assert spent[1] >= 0.3 * sum(spent), f"CPU ticks per thread: {spent[:4]}"


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_linear_vnni(ops, isa, rows, out_dtype):
    gen = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(1000, 384, generator=gen), torch.randn(1000, generator=gen).to(out_dtype)
    x, packed = torch.randn(rows, 384, generator=gen).bfloat16(), pack_vnni16(w)

    def run():
        out = torch.empty(rows, 1000, dtype=out_dtype)
        ops.linear_vnni(out, x, packed, bias)
        return [out]

    assert_same(at_1_and_2_threads(run))


@pytest.mark.parametrize("rows", [2, 40])
def test_linear_w8a8(ops, isa, rows):
    gen = torch.Generator().manual_seed(rows)
    lin = PackedW8A8(
        0.1 * torch.randn(700, 320, generator=gen), torch.randn(700, generator=gen), ops
    )
    x = torch.randn(rows, 320, generator=gen).bfloat16()
    assert_same(at_1_and_2_threads(lambda: [lin(x)]))


def _pool(gen, lens, kvh, D, page, dtype):
    pages = sum(-(-n // page) for n in lens)
    kc = torch.randn(pages + 1, kvh, page, D, generator=gen).to(dtype)
    vc = torch.randn(pages + 1, kvh, page, D, generator=gen).to(dtype)
    width = max(-(-n // page) for n in lens)
    perm = (torch.randperm(pages, generator=gen) + 1).to(torch.int32)
    table, used = torch.zeros(len(lens), width, dtype=torch.int32), 0
    for b, n in enumerate(lens):
        table[b, : -(-n // page)] = perm[used : used + -(-n // page)]
        used += -(-n // page)
    return kc, vc, table


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention(ops, isa, kv_dtype):
    gen = torch.Generator().manual_seed(1)
    lens = [1, 17, 300, 45, 129]
    kc, vc, table = _pool(gen, lens, 2, 64, 16, kv_dtype)
    q = torch.randn(len(lens), 6, 64, generator=gen).to(kv_dtype)

    def run():
        out = torch.empty_like(q)
        ops.paged_decode_attention(
            out, q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), 0.125, 0
        )
        return [out]

    assert_same(at_1_and_2_threads(run))


def test_flash_attention(ops, flash_isa):
    gen = torch.Generator().manual_seed(2)
    lens, new = [150, 70, 33], [150, 20, 1]  # a prefill, a chunk after a prefix, a decode row
    kc, vc, table = _pool(gen, lens, 2, 64, 16, torch.bfloat16)
    q = torch.randn(sum(new), 6, 64, generator=gen).bfloat16()
    starts = torch.tensor([0, 150, 170, 171], dtype=torch.int32)

    def run():
        out = torch.empty_like(q)
        ops.paged_attention_bf16(
            out,
            q,
            kc,
            vc,
            table,
            torch.tensor(lens, dtype=torch.int32),
            starts,
            1 / math.sqrt(64),
            0,
        )
        return [out]

    assert_same(at_1_and_2_threads(run))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_silu(ops, isa, dtype):
    gen = torch.Generator().manual_seed(3)
    x, res = (torch.randn(70, 576, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(576, generator=gen).to(dtype)
    qk = torch.randn(70, 6, 64, generator=gen).to(dtype)
    ang = torch.outer(torch.arange(70.0), 1 / 10000 ** (torch.arange(0, 64, 2) / 64))
    cos, sin = torch.cat([ang.cos()] * 2, 1), torch.cat([ang.sin()] * 2, 1)
    gu = torch.randn(70, 2 * 900, generator=gen).to(dtype)

    def run():
        out, r = torch.empty_like(x), res.clone()
        ops.rms_norm(out, x.clone(), r, w, 1e-6)
        q, k = qk[:, :4].clone(), qk[:, 4:].clone()
        ops.rotary_embedding(q, k, cos, sin)
        act = torch.empty(70, 900, dtype=dtype)
        ops.silu_and_mul(act, gu)
        return [out, r, q, k, act]

    assert_same(at_1_and_2_threads(run))


@pytest.mark.parametrize("quantization", [None, "w8a8_int8"])
def test_fused_moe(ops, quantization):
    if quantization and not ops.has_int8_dot():
        pytest.skip("this CPU has no AVX512-VNNI")
    gen = torch.Generator().manual_seed(4)
    E, H, inter, T, K = 6, 128, 96, 200, 2
    experts = PackedExperts(
        torch.randn(E, 2 * inter, H, generator=gen) * 0.1,
        torch.randn(E, H, inter, generator=gen) * 0.1,
        ops=ops,
        quantization=quantization,
    )
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, K, generator=gen)
    assert_same(at_1_and_2_threads(lambda: [experts(x, ids, weights)]))


def test_a_long_kernel_call_lets_other_python_threads_run(ops):
    """A kernel call runs without the GIL: a Python thread beside it (PD's I/O thread answering
    heartbeats) keeps running during a call that takes a good fraction of a second on one core."""
    import threading

    from pdserve.layers.linear import PackedF32

    torch.manual_seed(0)
    linear = PackedF32(torch.randn(1024, 1024), None, ops)
    x = torch.randn(512, 1024)
    ticks: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    thread = threading.Thread(target=ticker, daemon=True)
    thread.start()
    try:
        time.sleep(0.05)
        calls = []
        while not calls or calls[-1][1] - calls[-1][0] < 0.2:  # one call of at least 0.2 s
            x = torch.cat([x, x]) if calls else x
            start = time.perf_counter()
            linear(x)
            calls.append((start, time.perf_counter()))
    finally:
        stop.set()
        thread.join()
        torch.set_num_threads(before)
    start, end = calls[-1]
    during = [t for t in ticks if start < t < end]
    # every millisecond or so without the GIL; none while a call held it
    assert len(during) > (end - start) / 0.01, (len(during), end - start)
