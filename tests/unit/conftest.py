"""Fixtures shared by the unit tests: routers, fake workers, and the instruction-set tiers of the
CPU kernels."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from pdserve.router.args import RouterArgs

if TYPE_CHECKING:
    from tests.unit.test_router import RunningRouter


@pytest.fixture
def make_router():
    # imported here: the kernel tests share this file and run without the router's packages
    # (fastapi, aiohttp, ...) in scripts/arm64_kernels.py's emulated aarch64 Python
    from tests.unit.test_router import RunningRouter

    routers = []

    def make(prefill=(), decode=(), worker=(), wait=True, **kw) -> RunningRouter:
        kw.setdefault("health_check_interval", 0.2)
        kw.setdefault("health_failure_threshold", 1)
        kw.setdefault("load_poll_interval", 0.05)
        args = RouterArgs(
            prefill=[(p.url, p.bootstrap_port) for p in prefill],
            decode=[d.url for d in decode],
            worker=[w.url for w in worker],
            **kw,
        )
        r = RunningRouter(args)
        routers.append(r)
        if wait:
            r.wait_ready()
        return r

    yield make
    for r in routers:
        r.stop()


@pytest.fixture(scope="module")
def workers(request):
    """Fake workers in the roles the test module lists in ``WORKER_ROLES``, shared by its tests."""
    from tests.helpers.fake_workers import FakeCluster

    c = FakeCluster()
    for role in request.module.WORKER_ROLES:
        c.add(role)
    yield c
    c.close()


@pytest.fixture
def pd(workers):
    """The module's fake workers, reset, in ``WORKER_ROLES`` order."""
    for w in workers.workers:
        w.reset()
    return tuple(workers.workers)


def host_isas() -> list[str]:
    """The instruction-set tiers pdserve's kernels can run on this CPU (``scalar`` up to the host's
    own), or one name that makes the tests fail with the reason the kernels did not load."""
    from pdserve import kernels

    ops = kernels.load()
    return (
        ops.available_isas()
        if ops is not None
        else [f"kernels-unavailable: {kernels.unavailable_reason()}"]
    )


def pytest_generate_tests(metafunc):
    # ``isa``: one run of the test per tier this host can run, not only its best one;
    # ``flash_isa``: the tiers the bf16 flash kernel has code for (all but scalar)
    if "isa" in metafunc.fixturenames:
        metafunc.parametrize("isa", host_isas(), indirect=True)
    if "flash_isa" in metafunc.fixturenames:
        metafunc.parametrize("flash_isa", [t for t in host_isas() if t != "scalar"], indirect=True)


@pytest.fixture
def isa(request, ops):
    """Run a kernel test with the kernels capped at one instruction-set tier (``ops.set_isa``):
    ``scalar``, ``avx2``, ``avx2_vnni``, ``avx512``, ``avx512_bf16``, ``amx`` (or ``neon``,
    ``neon_dotprod``, ``neon_bf16``), whichever this CPU has; ``ops`` is the test module's
    fixture for the loaded kernels."""
    before = ops.isa_tier()
    ops.set_isa(request.param)
    yield request.param
    ops.set_isa(before)


@pytest.fixture
def flash_isa(request, ops):
    """As ``isa``, over the tiers the bf16 flash kernel runs on (a scalar-only CPU has none: the
    cpu backend then takes the decode kernel and SDPA, test_cpu_kernels checks that it says so)."""
    before = ops.isa_tier()
    ops.set_isa(request.param)
    assert ops.flash_supported(64), f"the flash kernel does not run at tier {request.param}"
    yield request.param
    ops.set_isa(before)
