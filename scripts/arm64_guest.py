"""Run inside the emulated aarch64 Python by scripts/arm64_kernels.py: say which tiers pdserve's
kernels see on this CPU model, then run pytest with the given arguments.

``PDSERVE_ARM64_SKIP_TIERS`` (comma-separated): the tests parametrized over tiers (fixtures ``path``
and ``flash_path``) run only at the other tiers; a line ``tiers tested: ...`` says which.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402

from pdserve import kernels  # noqa: E402

TIER_FIXTURES = ("path", "flash_path")


class SkipTiers:
    """Deselects the tier-parametrized tests at ``tiers``."""

    def __init__(self, tiers: set[str]):
        self.tiers = tiers

    def pytest_collection_modifyitems(self, config, items):
        def skipped(item):
            params = getattr(item, "callspec", None)
            return params is not None and any(params.params.get(f) in self.tiers for f in TIER_FIXTURES)

        drop = [i for i in items if skipped(i)]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [i for i in items if not skipped(i)]


def main() -> int:
    ops = kernels.load()
    if ops is None:
        print(f"pdserve's kernels did not load: {kernels.unavailable_reason()}", file=sys.stderr)
        return 3
    tiers = list(ops.available_isas())
    skip = {t for t in os.environ.get("PDSERVE_ARM64_SKIP_TIERS", "").split(",") if t}
    print(f"isa: {ops.isa()}; available_isas: {', '.join(tiers)}; "
          f"cpu_features: {' '.join(ops.cpu_features()) or 'none'}", flush=True)
    print(f"tiers tested: {','.join(t for t in tiers if t not in skip) or 'none'}", flush=True)
    return pytest.main(sys.argv[1:], plugins=[SkipTiers(skip)])


if __name__ == "__main__":
    sys.exit(main())
