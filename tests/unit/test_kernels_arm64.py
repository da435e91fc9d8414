"""pdserve's kernels on aarch64, without Arm hardware: scripts/arm64_kernels.py --quick
cross-compiles them with Debian's aarch64 g++ and runs their unit tests in an emulated Python
(qemu-user) on three CPU models, so the NEON, dot-product, BF16/I8MM and SVE tiers each run once
(docs/arm64.md).

The first run prepares an arm64 userland and wheels (as root on Debian, with network) and builds
the kernels, all cached; a host that cannot fails here saying why. Later runs only test (minutes:
the emulation is 10-50 times slower than the host)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_kernels_pass_their_tests_on_emulated_arm_cpus():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/arm64_kernels.py"), "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        errors="replace",
    )
    out = proc.stdout.splitlines()
    # the setup step that failed (stderr), each model's failures and error lines, the summary
    why = [
        ln
        for ln in proc.stderr.splitlines() + out
        if re.match(r"(arm64: FAILED|\[[\w-]+\] (FAILED|ERROR|E) )", ln)
    ]
    summary = out[
        next((i for i, ln in enumerate(out) if ln.startswith("arm64 summary")), len(out)) :
    ]
    rc = proc.returncode
    assert rc == 0, "\n".join([f"scripts/arm64_kernels.py --quick exited {rc}:", *why, *summary])
