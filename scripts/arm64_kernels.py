"""Build pdserve's CPU kernels for aarch64 and run their unit tests under qemu-user, on emulated Arm
CPUs of each instruction-set tier (Advanced SIMD, dot products, BF16/I8MM): no Arm hardware.

    python3 scripts/arm64_kernels.py [--quick] [--cpus a64fx,neoverse-n1,max] [--jobs 2]
                                     [--setup-only] [--cache DIR] [-- PYTEST ARGS]

Phases, each timed (a Debian x86-64 host; root when a tool is missing or the userland not yet made):
  tools     Debian's cross g++, qemu-user-static, debootstrap and ninja (apt-get)
  root      a Debian bookworm arm64 userland with Python 3.11: debootstrap's first stage, its .debs
            unpacked with dpkg-deb (nothing in it is run natively: no binfmt_misc is needed)
  packages  aarch64 wheels from PyPI (torch, numpy, pytest): pip --target with --platform
  build     `python -m pdserve.kernels`, emulated, with CXX a wrapper of aarch64-linux-gnu-g++: qemu
            passes the execve of ninja and of the compiler (x86 programs) to the kernel, so they
            run natively; the build is build.py's own, cached by its key under <cache>/kernels
  tests     per CPU model (scripts/arm64_guest.py): the kernels' tiers and CPU features, then pytest
Everything is cached in ${PDSERVE_CACHE:-~/.cache/pdserve}/arm64: a second run only tests.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIRROR = os.environ.get("PDSERVE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# the host's tools, by the Debian package that has them
TOOLS = {
    "aarch64-linux-gnu-g++": "g++-aarch64-linux-gnu",
    "qemu-aarch64-static": "qemu-user-static",
    "debootstrap": "debootstrap",
    "ninja": "ninja-build",
    "dpkg-deb": "dpkg",
}
ROOT_PACKAGES = "python3,libpython3.11-dev,libgomp1"
# torch 2.10.0 is the newest CPU-only aarch64 torch on PyPI: from 2.11 on PyPI's aarch64 wheel is a
# CUDA 13 build whose libtorch_cpu.so needs libcudart.so.13 (GBs of NVIDIA wheels to import torch)
TORCH = "torch==2.10.0"
# torch's own dependencies are named here: pip would evaluate its markers for this host (x86-64)
WHEELS = (
    "numpy",
    "pytest",
    "pytest-timeout",
    "filelock",
    "typing-extensions",
    "sympy",
    "networkx",
    "jinja2",
    "fsspec",
    "setuptools",
)
PIP_TARGET = (
    "--platform",
    "manylinux_2_28_aarch64",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--only-binary=:all:",
)
# qemu 7.2's models: Advanced SIMD only (and SVE, which the kernels detect but do not use), + dot
# products, + BF16, I8MM and SVE. Not cortex-a57/a72 (ARMv8.0): torch's libraries execute ARMv8.1
# atomics (LSE) as they load.
# The properties each model runs with: torch's SVE code runs 10-15 times slower than its NEON code
# under qemu (an MLA kernel test: 42 s on max, 2.9 s on max without SVE), and the kernels do not use
# SVE. a64fx cannot turn it off.
QEMU_CPUS = {"max": "max,sve=off"}
# --quick: every tier once, each test once. neoverse-n1, the fastest to emulate, runs the tests at
# neon and neon_dotprod and every test without a tier parameter; max runs the neon_bf16 tier's
# tests; a64fx, the model without dot products (and the slowest to emulate: SVE), loads the
# kernels and runs the element-wise tests at neon (QUICK_SMOKE), which would stop on an instruction
# it lacks. The quick run leaves out the tests marked large_shape (a model-sized shape beside
# smaller ones that reach the same code paths), and of a test function's cases at a tier it runs
# only those that bring a parameter value (a size, tail, dtype, flag) not yet run at that tier.
QUICK_TIERS = {
    "a64fx": ("neon",),
    "neoverse-n1": ("neon", "neon_dotprod"),
    "max": ("neon_bf16",),
}
QUICK_UNTIERED = {"neoverse-n1": None, "a64fx": (), "max": ()}  # None: every one
QUICK_SMOKE = {"a64fx": ["-k", "rms_norm or rotary or silu_and_mul"]}
TESTS = (
    "tests/unit/test_cpu_kernels.py",
    "tests/unit/test_batch_invariance.py",
    "tests/unit/test_moe_kernel.py",
    "tests/unit/test_attention_sinks.py",
    "tests/unit/test_kernel_threads.py",
    "tests/unit/test_mla_kernel.py",
    "tests/unit/test_linear_attention_kernels.py",
)
# not kernel tests, and they need transformers (not in the arm64 userland)
DESELECT = (
    "tests/unit/test_attention_sinks.py::test_reference_is_hf_eager_attention",
    "tests/unit/test_attention_sinks.py::test_sinks_parameter_is_split_by_query_heads",
)


# the host's x86 tier caps (PDSERVE_CPU_ISA and what it sets for the libraries): no Arm CPU has
# those tiers, and the emulated tests choose theirs with PDSERVE_ARM64_TIERS
HOST_ONLY = (
    "PDSERVE_CPU_ISA",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "ATEN_CPU_CAPABILITY",
)


class SetupError(RuntimeError):
    """The arm64 environment could not be prepared on this host."""


class Arm64:
    def __init__(self, cache: Path):
        self.dir = cache
        self.root = cache / "root"
        self.site = cache / "site"
        self.cxx = cache / "bin/pdserve-aarch64-g++"
        # the emulated Python as a host program, next to python3.11 (where it finds its prefix): it
        # is sys.executable, so the tests that start `sys.executable` start it emulated too
        self.python = self.root / "usr/bin/python3.11-qemu"

    def tools(self) -> None:
        missing = sorted({pkg for tool, pkg in TOOLS.items() if not _which(tool)})
        if importlib.util.find_spec("pip") is None:
            missing.append("python3-pip")
        if not missing:
            return
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            raise SetupError(
                f"missing Debian packages {' '.join(missing)}, and this is not root on a Debian "
                "host to install them with apt-get"
            )
        _apt_install(missing)

    def make_root(self) -> None:
        """A bookworm arm64 userland with Python 3.11 in ``root`` (kept once complete)."""
        done = self.root / ".pdserve-complete"
        if done.exists():
            return
        if os.geteuid() != 0:
            raise SetupError(f"debootstrap needs root to make the arm64 userland in {self.root}")
        tmp = self.dir / "root.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        # --foreign: download and unpack only, run nothing of the target
        _run(
            [
                _which("debootstrap"),
                "--arch=arm64",
                "--foreign",
                "--variant=minbase",
                f"--include={ROOT_PACKAGES}",
                "bookworm",
                str(tmp),
                MIRROR,
            ],
            f"debootstrap from {MIRROR}",
        )
        debs = sorted((tmp / "var/cache/apt/archives").glob("*.deb"))
        for deb in debs:  # the second stage's unpacking, without its configuration
            _run(["dpkg-deb", "-x", str(deb), str(tmp)], f"dpkg-deb -x {deb.name}")
            deb.unlink()
        if not (tmp / "usr/bin/python3.11").exists():
            raise SetupError(f"debootstrap from {MIRROR} gave no usr/bin/python3.11 in {tmp}")
        _precompile(tmp / "usr/lib/python3.11")
        shutil.rmtree(self.root, ignore_errors=True)
        tmp.rename(self.root)
        done.write_text(f"{ROOT_PACKAGES} from {MIRROR}\n")

    def install_wheels(self) -> None:
        """aarch64 wheels in ``site``, which the emulated Python reads through a .pth file."""
        wanted = f"{TORCH} (no deps) {' '.join(WHEELS)}\n"
        done = self.site / ".pdserve-complete"
        if not (done.exists() and done.read_text() == wanted):
            tmp = self.dir / "site.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            pip = [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--target",
                str(tmp),
                *PIP_TARGET,
            ]
            _run([*pip, "--no-deps", TORCH], f"pip install {TORCH} for aarch64")
            _run([*pip, *WHEELS], "pip install the test wheels for aarch64")
            _precompile(tmp)
            shutil.rmtree(self.site, ignore_errors=True)
            tmp.rename(self.site)
            done.write_text(wanted)
        (self.root / "usr/lib/python3/dist-packages/pdserve-arm64.pth").write_text(f"{self.site}\n")

    def write_wrappers(self) -> None:
        """Two host scripts: ``python`` runs ``qemu-aarch64-static -0 <itself> python3.11`` (the CPU
        model and the root from QEMU_CPU and QEMU_LD_PREFIX); ``cxx``, the build's CXX, the cross
        g++, which runs natively and so sees the host's files: Python's headers include
        ``<aarch64-linux-gnu/python3.11/pyconfig.h>``, which is in the root."""
        self.cxx.parent.mkdir(parents=True, exist_ok=True)
        for path, cmd in (
            (
                self.python,
                f'{_which("qemu-aarch64-static")} -0 "$0" {self.root}/usr/bin/python3.11',
            ),
            (self.cxx, f"{_which('aarch64-linux-gnu-g++')} -idirafter {self.root}/usr/include"),
        ):
            path.write_text(
                f'#!/bin/sh\n# written by pdserve\'s scripts/arm64_kernels.py\nexec {cmd} "$@"\n'
            )
            path.chmod(0o755)

    def env(self, cpu: str, **more: str) -> dict:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PYTHON", "QEMU_", "VIRTUAL_ENV")) and k not in HOST_ONLY
        }
        # ninja from /usr/bin; the kernels build into <cache>/kernels, apart from the host's own
        env.update(
            QEMU_CPU=QEMU_CPUS.get(cpu, cpu),
            QEMU_LD_PREFIX=str(self.root),
            CXX=str(self.cxx),
            PDSERVE_CACHE=str(self.dir),
            PATH="/usr/bin:/bin",
            MAX_JOBS=os.environ.get("MAX_JOBS", "2"),
            **more,
        )
        return env

    def build(self) -> None:
        self.write_wrappers()
        _run(
            [str(self.python), "-m", "pdserve.kernels"],
            "the aarch64 kernel build",
            env=self.env("max"),
            show=True,
        )

    def test(
        self,
        cpu: str,
        tiers: tuple[str, ...],
        pytest_args: list[str],
        untiered: tuple[str, ...] | None = None,
        each_value: bool = False,
    ) -> dict:
        """One CPU model's pytest run (scripts/arm64_guest.py) at ``tiers`` (empty: all it has);
        ``untiered``: the only tests without a tier parameter to run (None: all); ``each_value``:
        a test function's cases at a tier until each of its parameters' values ran once."""
        t0 = time.monotonic()
        args = [
            "-q",
            "-p",
            "no:cacheprovider",
            "-rfE",
            *TESTS,
            *(f"--deselect={d}" for d in DESELECT),
            *pytest_args,
        ]
        proc = subprocess.Popen(
            [str(self.python), str(REPO / "scripts/arm64_guest.py"), *args],
            cwd=REPO,
            env=self.env(
                cpu,
                PDSERVE_ARM64_TIERS=",".join(tiers),
                **({} if untiered is None else {"PDSERVE_ARM64_UNTIERED": ",".join(untiered)}),
                **({"PDSERVE_ARM64_EACH_VALUE": "1"} if each_value else {}),
            ),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            errors="replace",
        )
        r = {"isa": "the kernels did not load", "tested": "none", "summary": ""}
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"[{cpu}] {line}", end="", flush=True)
            if line.startswith("isa: "):
                r["isa"] = line[len("isa: ") :].strip()
            elif line.startswith("tiers tested: "):
                r["tested"] = line[len("tiers tested: ") :].strip()
            if re.search(r"\b(passed|failed|errors?|no tests ran)\b.* in [0-9.]+s", line):
                r["summary"] = line.strip("= \n")
        r["rc"] = proc.wait()
        r["summary"] = r["summary"] or f"exit status {r['rc']}"
        r["seconds"] = time.monotonic() - t0
        return r


def _which(tool: str) -> str:
    """Debian's ``tool`` (the emulated processes' PATH is /usr/bin:/bin), or ''."""
    return shutil.which(tool, path="/usr/bin:/bin:/usr/sbin:/sbin") or ""


def _apt_install(packages: list[str]) -> None:
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if (
        subprocess.run(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        ).returncode
        != 0
    ):
        _run(["apt-get", "update", "-q"], "apt-get update")
        _run(cmd, f"apt-get install {' '.join(packages)}", env=env)


def _precompile(path: Path) -> None:
    """Byte-compile natively what the emulated Python would compile at its first imports (one .pyc
    format for every Python 3.11)."""
    if sys.version_info[:2] == (3, 11):
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", "-j", "2", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


def _run(cmd: list[str], what: str, env: dict | None = None, show: bool = False) -> None:
    """Run ``cmd`` (its output shown, or kept for the error); a failure raises naming ``what``."""
    if show:
        rc, out = subprocess.run(cmd, cwd=REPO, env=env).returncode, ""
    else:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, errors="replace"
        )
        rc, out = proc.returncode, (proc.stdout + proc.stderr).strip()
    if rc != 0:
        tail = "\n".join(out.splitlines()[-15:])
        raise SetupError(f"{what} failed (exit status {rc}){': ' + tail if tail else ''}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--cpus",
        default=",".join(QUICK_TIERS),
        help="qemu CPU models, the least capable first (default %(default)s)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="each Arm tier once: the tier-parametrized tests on "
        + ", ".join(f"{cpu} at {'+'.join(t)}" for cpu, t in QUICK_TIERS.items())
        + " (other models: all their tiers), each value of a test's parameters once per tier; "
        "the tests without a tier parameter on neoverse-n1 only; on a64fx only the element-wise "
        "tests",
    )
    p.add_argument(
        "--jobs", type=int, default=2, help="CPU models tested at once (default %(default)s)"
    )
    p.add_argument("--setup-only", action="store_true", help="prepare and build, run no tests")
    p.add_argument("--cache", type=Path, help="default: ${PDSERVE_CACHE:-~/.cache/pdserve}/arm64")
    p.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = p.parse_args(argv)
    cache = (
        args.cache
        or Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache/pdserve") / "arm64"
    )
    arm = Arm64(cache.resolve())
    times: list[tuple[str, float]] = []
    try:
        for name, step in (
            ("tools", arm.tools),
            ("root", arm.make_root),
            ("packages", arm.install_wheels),
            ("build", arm.build),
        ):
            print(f"arm64: {name} ...", flush=True)
            t0 = time.monotonic()
            step()
            times.append((name, time.monotonic() - t0))
            print(f"arm64: {name}: {times[-1][1]:.0f} s", flush=True)
    except SetupError as e:
        print(f"arm64: FAILED: {e}", file=sys.stderr)
        return 2
    cpus = [] if args.setup_only else args.cpus.split(",")
    t0 = time.monotonic()
    with ThreadPoolExecutor(
        max(1, args.jobs)
    ) as pool:  # the most capable first: the longest full run
        runs = {}
        for cpu in reversed(cpus):
            tiers = QUICK_TIERS.get(cpu, ()) if args.quick else ()
            untiered = QUICK_UNTIERED.get(cpu) if args.quick else None
            smoke = QUICK_SMOKE.get(cpu, ["-m", "not large_shape"]) if args.quick else []
            runs[cpu] = pool.submit(
                arm.test, cpu, tiers, [*smoke, *args.pytest_args], untiered, args.quick
            )
        results = {cpu: runs[cpu].result() for cpu in cpus}
    if cpus:
        times.append(("tests", time.monotonic() - t0))
    print("\narm64 summary: " + ", ".join(f"{n} {s:.0f} s" for n, s in times))
    for cpu, r in results.items():
        print(
            f"  {cpu:12} {'ok' if r['rc'] == 0 else 'FAILED':6} {r['seconds']:4.0f} s  "
            f"{r['summary']}\n  {'':25}isa: {r['isa']}; tiers tested: {r['tested']}"
        )
    return 1 if any(r["rc"] != 0 for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
