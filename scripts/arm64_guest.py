"""Run inside the emulated aarch64 Python by scripts/arm64_kernels.py: say which tiers pdserve's
kernels see on this CPU model, then run pytest with the given arguments.

``PDSERVE_ARM64_TIERS`` (comma-separated, each one the CPU must have; unset or empty: all it has):
the tiers at which the tests parametrized over tiers (by conftest's ``isa`` and ``flash_isa``) run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402

from pdserve import kernels  # noqa: E402


class OnlyTiers:
    """Deselects the tests parametrized with a tier of ``have`` (a parameter's value is its name)
    other than ``tiers``."""

    def __init__(self, tiers: list[str], have: list[str]):
        self.others = set(have) - set(tiers)

    def pytest_collection_modifyitems(self, config, items):
        keep, drop = [], []
        for item in items:
            params = item.callspec.params.values() if hasattr(item, "callspec") else ()
            (drop if any(isinstance(p, str) and p in self.others for p in params) else keep).append(
                item
            )
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep


def main() -> int:
    ops = kernels.load()
    if ops is None:
        print(
            f"ERROR pdserve's kernels did not load: {kernels.unavailable_reason()}", file=sys.stderr
        )
        return 3
    have = list(ops.available_isas())
    print(
        f"isa: {ops.isa()}; available_isas: {', '.join(have)}; "
        f"cpu_features: {' '.join(ops.cpu_features()) or 'none'}",
        flush=True,
    )
    tiers = [t for t in os.environ.get("PDSERVE_ARM64_TIERS", "").split(",") if t] or have
    if set(tiers) - set(have):
        print(
            f"ERROR this CPU model lacks the tiers {', '.join(sorted(set(tiers) - set(have)))} it "
            "is to test",
            file=sys.stderr,
        )
        return 3
    print(f"tiers tested: {', '.join(tiers)}", flush=True)
    return pytest.main(sys.argv[1:], plugins=[OnlyTiers(tiers, have)])


if __name__ == "__main__":
    sys.exit(main())
