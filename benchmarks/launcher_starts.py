"""What a test's server start costs, started as a fresh interpreter or forked from the tests'
preloaded launcher (``tests/helpers/launcher.py``), side by side (alternately):

    python benchmarks/launcher_starts.py [--rounds 2] [--few 2] [--many 8]

Each run is a Python process that starts a tiny Llama server through ``tests.helpers.cluster``,
sends it one 8-token generation, stops it, and does so ``--few`` or ``--many`` times in a row;
its CPU seconds (its own and its children's, the launcher's included: it is waited for at exit)
and wall time are measured from outside. The cost of one more server is the difference between
the two counts divided by the servers between them; what is left is the fixed part (the test
process's imports, and with the launcher its own start). Prints medians over the rounds."""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = """
import sys
from pathlib import Path
from tests.helpers import cluster as c
from tests.helpers.checkpoints import build_tiny_checkpoint

path = build_tiny_checkpoint("llama")
logs = Path(sys.argv[1])
for i in range(int(sys.argv[2])):
    s = c.server(f"s{i}", path, logs)
    s.start()
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}
    assert s.http.post("/generate", json=body).status_code == 200
    s.stop()
"""


def run(launcher: bool, servers: int, logs: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one run of ``servers`` starts."""
    env = {**os.environ, "PDSERVE_TEST_LAUNCHER": "1" if launcher else "0"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", RUN, str(logs), str(servers)], cwd=ROOT, env=env, check=True
    )
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--few", type=int, default=2)
    p.add_argument("--many", type=int, default=8)
    p.add_argument("--logs", type=Path, default=Path("/tmp/launcher-starts"))
    args = p.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[bool, int], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for launcher in (False, True):
            for n in (args.few, args.many):
                runs.setdefault((launcher, n), []).append(run(launcher, n, args.logs))
    med = {k: tuple(statistics.median(x[i] for x in v) for i in (0, 1)) for k, v in runs.items()}
    span = args.many - args.few
    print(f"{'start':<22} {'CPU s/server':>13} {'wall s/server':>14} {'fixed CPU s':>12}")
    per = {}
    for launcher in (False, True):
        few, many = med[(launcher, args.few)], med[(launcher, args.many)]
        cpu, wall = (many[0] - few[0]) / span, (many[1] - few[1]) / span
        per[launcher] = cpu
        name = "forked from launcher" if launcher else "fresh interpreter"
        print(f"{name:<22} {cpu:>13.2f} {wall:>14.2f} {few[0] - args.few * cpu:>12.2f}")
    print(f"CPU per server, launcher / fresh: {per[True] / per[False]:.2f}")


if __name__ == "__main__":
    main()
