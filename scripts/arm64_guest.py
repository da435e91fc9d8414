"""Run inside the emulated aarch64 Python by scripts/arm64_kernels.py: say which tiers pdserve's
kernels see on this CPU model, then run pytest with the given arguments.

``PDSERVE_ARM64_TIERS`` (comma-separated, each one the CPU must have; unset or empty: all it has):
the tiers at which the tests parametrized over tiers (by conftest's ``isa`` and ``flash_isa``) run.
``PDSERVE_ARM64_UNTIERED`` (set: comma-separated test ids, empty for none): the only tests without a
tier parameter that run; unset: all of them.
``PDSERVE_ARM64_EACH_VALUE=1``: of a test function's cases at one tier, only as many as it takes for
each value of each of its other parameters (every size, tail, dtype, flag it is given) to run once
at that tier: the cases are taken in their order, a case kept when it brings a value not yet run.
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
    other than ``tiers``; of the tests without a tier parameter, keeps only those whose node id
    ends with one of ``untiered`` (None: all of them)."""

    def __init__(
        self,
        tiers: list[str],
        have: list[str],
        untiered: list[str] | None = None,
        each_value: bool = False,
    ):
        self.have = set(have)
        self.others = set(have) - set(tiers)
        self.untiered = untiered
        self.each_value = each_value
        self.seen: dict[tuple[str, str], set] = {}  # (function, tier): the values run at it

    def _dropped(self, item) -> bool:
        params = item.callspec.params.values() if hasattr(item, "callspec") else ()
        tiers = {p for p in params if isinstance(p, str) and p in self.have}
        if tiers:
            return bool(tiers & self.others) or (self.each_value and not self._new_value(item))
        return self.untiered is not None and not item.nodeid.endswith(tuple(self.untiered))

    def _new_value(self, item) -> bool:
        """Whether ``item`` runs a value of one of its parameters that no kept case of its
        function ran at its tier yet (then it is kept, and its values count as run)."""
        params = item.callspec.params
        tier = next(v for v in params.values() if isinstance(v, str) and v in self.have)
        values = {(k, repr(v)) for k, v in params.items() if v != tier}
        seen = self.seen.setdefault((item.nodeid.split("[")[0], tier), set())
        if seen and values <= seen:
            return False
        seen.update(values)
        return True

    def pytest_collection_modifyitems(self, config, items):
        keep, drop = [], []
        for item in items:
            (drop if self._dropped(item) else keep).append(item)
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
    raw = os.environ.get("PDSERVE_ARM64_UNTIERED")
    untiered = None if raw is None else [t for t in raw.split(",") if t]
    each_value = os.environ.get("PDSERVE_ARM64_EACH_VALUE") == "1"
    return pytest.main(sys.argv[1:], plugins=[OnlyTiers(tiers, have, untiered, each_value)])


if __name__ == "__main__":
    sys.exit(main())
