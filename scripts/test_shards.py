"""Run the test suite as N pytest processes side by side, each on its own share of the test files,
and report one total; or turn JUnit XML reports into the suite's time table.

    python3 scripts/test_shards.py run [--shards N] [--report-dir DIR] [-- PYTEST ARGS]
    python3 scripts/test_shards.py table REPORT.xml [...] [--write-durations]

``run`` starts N pytest processes that share one queue of the test files
(tests/helpers/file_queue.py): each collects every file and takes the next file whenever it ends
one, so the processes end within one file of each other even when a file's time shifts with what
runs beside it. The queue holds the longest files first, by their recorded times
(``tests/durations.json``: seconds per file, from the last measured run; a file without one counts
as ``DEFAULT_S`` of its folder). Session fixtures (servers, clusters) start at most once per
process and stop when no file left in the queue uses them (tests/helpers/last_use.py); ports,
checkpoints and caches are safe between processes (tests/helpers/ports.py, checkpoints.py). Files
that must not run beside each other are one unit of the queue (``TOGETHER``). Each process's
output is shown when it ends; the last line totals them, and the exit status is non-zero if any
failed.

``table`` prints a Markdown table of seconds per file and per folder from JUnit reports (pytest
``--junitxml``), and with ``--write-durations`` records the per-file times for ``run``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.helpers.file_queue import QUEUE_ENV, write_queue  # noqa: E402

DURATIONS = REPO / "tests/durations.json"
# a file without a recorded time: end-to-end files start servers, the others mostly do not
DEFAULT_S = {"tests/e2e": 60.0, "tests/conformance": 60.0}
DEFAULT_OTHER_S = 15.0
# files that must run in one process: the network-namespace tests each pick a free 10.77.N.0/24
# subnet and would race for it
TOGETHER = (re.compile(r"tests/e2e/test_netns"),)
PYTEST = ("-q", "-p", "no:cacheprovider", "--timeout=900", "--durations=25")


def test_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py"))


def recorded() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def estimate(path: str, seconds: dict[str, float]) -> float:
    if path in seconds:
        return seconds[path]
    return DEFAULT_S.get(str(Path(path).parent), DEFAULT_OTHER_S)


def queue_units(files: list[str], seconds: dict[str, float]) -> list[list[str]]:
    """Units (a file, or the files of one TOGETHER pattern), longest first."""
    units: dict[str, list[str]] = defaultdict(list)
    for f in files:
        key = next((p.pattern for p in TOGETHER if p.search(f)), f)
        units[key].append(f)
    cost = {k: sum(estimate(f, seconds) for f in fs) for k, fs in units.items()}
    return [sorted(units[k]) for k in sorted(units, key=lambda k: (-cost[k], k))]


def counts(report: Path) -> dict[str, int]:
    """passed / failed / errors / skipped of one JUnit report."""
    c = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    try:
        root = ET.parse(report).getroot()
    except (OSError, ET.ParseError):
        return c
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            c["failed"] += 1
        elif "error" in kinds:
            c["errors"] += 1
        elif "skipped" in kinds:
            c["skipped"] += 1
        else:
            c["passed"] += 1
    return c


def run(args: argparse.Namespace) -> int:
    files = test_files()
    seconds = recorded()
    units = queue_units(files, seconds)
    shards = range(max(1, min(args.shards, len(units))))
    out_dir = Path(args.report_dir or os.environ.get("PDSERVE_TEST_REPORTS") or "/tmp")
    out_dir = out_dir / f"pdserve-test-shards-{os.getpid()}"
    write_queue(out_dir / "queue", units)
    total_s = sum(estimate(f, seconds) for f in files)
    print(
        f"{len(files)} files in a queue of {len(units)} units for {len(shards)} processes, "
        f"about {total_s:.0f} s in all as last measured",
        flush=True,
    )
    env = {**os.environ, QUEUE_ENV: str(out_dir / "queue")}
    procs = []
    t0 = time.monotonic()
    for i in shards:
        log = open(out_dir / f"shard{i}.log", "wb")
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *PYTEST,
            "-p",
            "tests.helpers.file_queue",
            f"--junitxml={out_dir / f'shard{i}.xml'}",
            *args.pytest_args,
            *files,
        ]
        procs.append(
            (i, subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env), log)
        )
    codes = {}
    for i, p, log in procs:
        codes[i] = p.wait()
        log.close()
    wall = time.monotonic() - t0
    total = defaultdict(int)
    for i, _, _ in procs:
        print(f"\n===== shard {i} (exit {codes[i]}) =====", flush=True)
        sys.stdout.write((out_dir / f"shard{i}.log").read_text(errors="replace"))
        for k, v in counts(out_dir / f"shard{i}.xml").items():
            total[k] += v
    failed = total["failed"] + total["errors"]
    bad = {i: c for i, c in codes.items() if c != 0}
    print(f"\nreports in {out_dir}; {len(shards)} shards in {wall:.0f} s; exit codes {codes}")
    print(f"suite: {total['passed']} passed, {failed} failed, {total['skipped']} skipped")
    return 1 if bad or failed else 0


def table(args: argparse.Namespace) -> int:
    per_file: dict[str, float] = defaultdict(float)
    tests: dict[str, int] = defaultdict(int)
    for report in args.reports:
        for case in ET.parse(report).getroot().iter("testcase"):
            parts = case.get("classname", "").split(".")
            last = next((i for i, x in enumerate(parts) if x.startswith("test_")), len(parts) - 1)
            path = "/".join(parts[: last + 1]) + ".py"
            per_file[path] += float(case.get("time") or 0)
            tests[path] += 1
    folders: dict[str, float] = defaultdict(float)
    for f, s in per_file.items():
        folders[str(Path(f).parent)] += s
    print("| folder | seconds |\n|---|---|")
    for d, s in sorted(folders.items(), key=lambda kv: -kv[1]):
        print(f"| `{d}` | {s:.0f} |")
    print(f"| all | {sum(folders.values()):.0f} |\n")
    print("| file | tests | seconds |\n|---|---|---|")
    for f, s in sorted(per_file.items(), key=lambda kv: -kv[1]):
        print(f"| `{f}` | {tests[f]} | {s:.0f} |")
    if args.write_durations:
        DURATIONS.write_text(
            json.dumps({f: round(s, 1) for f, s in sorted(per_file.items())}, indent=1) + "\n"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the suite as N pytest processes")
    r.add_argument(
        "--shards",
        type=int,
        default=int(os.environ.get("PDSERVE_TEST_SHARDS") or min(4, len(os.sched_getaffinity(0)))),
        help="pytest processes (default: $PDSERVE_TEST_SHARDS, else the cores, at most 4)",
    )
    r.add_argument("--report-dir", help="where the shards' logs and JUnit reports go")
    r.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    t = sub.add_parser("table", help="seconds per file and folder from JUnit reports")
    t.add_argument("reports", nargs="+", type=Path)
    t.add_argument("--write-durations", action="store_true", help=f"record them in {DURATIONS}")
    args = p.parse_args(argv)
    return run(args) if args.command == "run" else table(args)


if __name__ == "__main__":
    sys.exit(main())
