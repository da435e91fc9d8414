"""pdserve on hosts with less than this one: the kernels capped at a lower instruction-set tier
(``PDSERVE_CPU_ISA``; in-process ``ops.set_isa``), as on an AVX2-only x86 host (or a plain NEON
Arm host), and at ``scalar`` (no SIMD at all).

At such a tier oneDNN's bf16 matmuls count as unavailable (they need AVX-512), so ``--dtype auto``
probes pdserve's own kernels and bf16 runs on them at every row count. And once on a CPU that
really lacks AVX-512, emulated by qemu-user, against this host capped at avx2. Checked at each tier:
the demo model starts with ``--dtype auto`` and answers; float32 equals HF token for token; bf16
equals HF up to ties; ``--enable-deterministic-inference`` gives one answer fresh and cached; and,
at the lowest SIMD tier, a PD cluster whose servers run with ``PDSERVE_CPU_ISA`` serves the
colocated engine's bits.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pdserve
from pdserve import kernels
from pdserve.models.demo import ensure_demo_model
from tests.e2e.test_demo_engine import readme_answers
from tests.e2e.test_deterministic import GREEDY, SEEDED, WIDE_LLAMA, one, others, result, target
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import as_bf16_checkpoint, build_tiny_checkpoint
from tests.helpers.isa_probe import probe

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


def lower_tiers() -> list[str]:
    """The lowest SIMD tier (an AVX2-only or plain NEON host) and scalar, where this host has
    more."""
    tiers = kernels.load().available_isas()
    return [
        t for t in dict.fromkeys([tiers[min(1, len(tiers) - 1)], "scalar"]) if t != tiers[-1]
    ] or [tiers[0]]


@pytest.fixture(params=lower_tiers())
def tier(request, monkeypatch):
    """This process's kernels capped at a tier; ``PDSERVE_CPU_ISA`` set too, so that oneDNN's bf16
    matmuls are not taken (what ``--dtype auto`` and the bf16 layers ask)."""
    ops = kernels.load()
    before = ops.isa_tier()
    monkeypatch.setenv("PDSERVE_CPU_ISA", request.param)
    ops.set_isa(request.param)
    yield request.param
    ops.set_isa(before)


def engine(path: str, **kw) -> pdserve.Engine:
    return pdserve.Engine(model_path=path, torch_num_threads=1, max_total_tokens=4096, **kw)


def test_demo_model_with_dtype_auto_answers(tier, caplog):
    caplog.set_level("INFO", logger="pdserve")
    eng = engine(ensure_demo_model())
    try:
        why = next(r.getMessage() for r in caplog.records if "compute dtype" in r.getMessage())
        # the probe ran without oneDNN's bf16 (or, at scalar, chose float32 for slow bf16)
        assert "oneDNN" not in why or "pdserve kernels" in why, why
        assert kernels.load().isa() == tier
        ids = eng.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True,
        )
        out = eng.generate(
            input_ids=list(ids if isinstance(ids, list) else ids["input_ids"]),
            sampling_params={"temperature": 0, "max_new_tokens": 16},
        )
        assert "Paris" in out["text"], out["text"]
        assert eng.check_integrity()["in_use_pages"] == 0
    finally:
        eng.shutdown()


def test_demo_model_against_hf_in_both_dtypes(tier):
    from tests.e2e.test_demo_engine import test_demo_model_in_both_dtypes_against_hf

    test_demo_model_in_both_dtypes_against_hf()


def test_readme_example_is_deterministic(tier):
    eng = engine(ensure_demo_model(), dtype="bfloat16", enable_deterministic_inference=True)
    try:
        fresh, warm, partial = readme_answers(eng)
    finally:
        eng.shutdown()
    assert "Paris" in fresh[0], fresh[0]
    assert warm == fresh and partial == fresh


@pytest.fixture(scope="module")
def low_tier_pd(tmp_path_factory):
    """A 1P1D cluster whose servers run at the lowest SIMD tier (bf16, deterministic)."""
    tier = lower_tiers()[0]
    path = build_tiny_checkpoint("llama", **WIDE_LLAMA)
    logs = tmp_path_factory.mktemp("isa")
    args = [
        "--dtype",
        "bfloat16",
        "--enable-deterministic-inference",
        "--max-total-tokens",
        "8192",
        "--chunked-prefill-size",
        "32",
    ]
    P, _ = c.prefill("P", path, logs, *args)
    D = c.decode("D", path, logs, *args)
    for p in (P, D):
        p.env["PDSERVE_CPU_ISA"] = tier
    c.start_all([P, D])
    R = c.router("R", [P], [D], logs)
    c.start_all([R])
    yield tier, path, P, D, R
    c.stop_all((R, D, P))


def test_pd_at_the_lowest_tier_serves_the_colocated_bits(low_tier_pd, monkeypatch):
    tier, path, P, D, R = low_tier_pd
    assert f"ISA {tier}, forced by PDSERVE_CPU_ISA" in P.log_tail(400) + D.log_tail(400)
    ops = kernels.load()
    before = ops.isa_tier()
    monkeypatch.setenv("PDSERVE_CPU_ISA", tier)
    ops.set_isa(tier)
    ids = target()
    prompts, params = others(8, seed=5)
    try:
        eng = pdserve.Engine(
            model_path=path,
            dtype="bfloat16",
            torch_num_threads=1,
            max_total_tokens=8192,
            page_size=4,
            enable_deterministic_inference=True,
        )
        try:
            want = [
                one(eng, p, sp)
                for p, sp in zip([ids] + prompts + [ids], [GREEDY] + params + [SEEDED])
            ]
        finally:
            eng.shutdown()
    finally:
        ops.set_isa(before)
    body = {
        "input_ids": [ids] + prompts + [ids],
        "sampling_params": [GREEDY] + params + [SEEDED],
        "return_logprob": True,
    }
    r = localhttp.post(f"{R.url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert [result(o) for o in r.json()] == want
    for s in (P, D):
        info = s.wait_idle()
        assert info["in_use_pages"] == 0, info


QEMU_X86 = shutil.which("qemu-x86_64-static")
# what caps the tiers of pdserve's kernels, oneDNN, MKL and ATen below what the CPU has
CAPS = ("PDSERVE_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")


def host_is_the_emulated_kind() -> bool:
    """An x86-64 CPU with AVX2, FMA and F16C and no AVX-512 or AVX-VNNI, as EPYC-Milan-v1 is."""
    with open("/proc/cpuinfo") as f:
        flags = next((set(line.split()) for line in f if line.startswith("flags")), set())
    return {"avx2", "fma", "f16c"} <= flags and not flags & {"avx512f", "avx_vnni"}


@pytest.mark.skipif(
    platform.machine() != "x86_64", reason="emulates an x86-64 CPU: meaningful on x86-64 hosts"
)
def test_on_a_cpu_without_avx512(tmp_path, monkeypatch):
    """The same process on a CPU that really lacks AVX-512: qemu-user emulating an AMD EPYC Milan
    (Zen 3: AVX2, FMA, F16C; no AVX-512, no AVX-VNNI), or the host itself when it is such a CPU,
    reports that to the kernels, torch and oneDNN alike. The kernels run at avx2 with no higher
    tier offered, oneDNN has no bf16, ``--dtype auto`` probes pdserve's kernels instead of
    crashing, and a deterministic bf16 engine gives the bits this host gives with its kernels
    capped at avx2."""
    model = as_bf16_checkpoint(build_tiny_checkpoint("llama"), str(tmp_path / "bf16"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    capped = {k for k in CAPS if k in env}
    for key in CAPS:
        env.pop(key, None)
    # a host whose own CPU has no AVX-512 (and no cap that could hide one) is such a CPU: the probe
    # runs there natively, with the same checks, instead of under a 20x slower emulation
    emulate = (
        [] if not capped and host_is_the_emulated_kind() else [QEMU_X86, "-cpu", "EPYC-Milan-v1"]
    )
    assert QEMU_X86 or not emulate, (
        "qemu-x86_64-static is missing (scripts/install.sh --test installs qemu-user-static)"
    )
    run = subprocess.run(
        [*emulate, sys.executable, "-m", "tests.helpers.isa_probe", model],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    emulated = json.loads(run.stdout.strip().splitlines()[-1])
    assert emulated["isa"] == "avx2" and emulated["tiers"] == ["scalar", "avx2"], emulated
    assert emulated["features"] == ["avx2+fma+f16c"] and emulated["onednn_bf16"] is False, emulated
    assert "pdserve kernels" in emulated["auto_why"], emulated["auto_why"]
    ops = kernels.load()
    before = ops.isa_tier()
    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx2")
    ops.set_isa("avx2")
    try:
        here = probe(model)
    finally:
        ops.set_isa(before)
    assert (emulated["output_ids"], emulated["logprobs"]) == (here["output_ids"], here["logprobs"])


def test_a_refusal_at_start_up_is_one_line(tmp_path):
    """What a host cannot serve is refused when the server starts, in one line naming the missing
    instructions, not with a stack trace: w8a8_int8 with no SIMD int8 dot products (scalar)."""
    s = c.server("S", build_tiny_checkpoint("llama"), tmp_path, "--quantization", "w8a8_int8")
    s.env["PDSERVE_CPU_ISA"] = "scalar"
    s.start(wait=False)
    assert s.proc.wait(timeout=120) != 0
    log = s.log_path.read_text()
    assert (
        "needs SIMD int8 dot products (AVX2, AVX-VNNI or AVX512-VNNI on x86-64, NEON on Arm)" in log
    ), log
    assert "Traceback" not in log, log
