"""Fixtures shared by the unit tests: routers, and the two code paths of the CPU kernels."""

from __future__ import annotations

import pytest

from pdserve.router.args import RouterArgs
from tests.unit.test_router import RunningRouter


@pytest.fixture
def make_router():
    routers = []

    def make(prefill=(), decode=(), worker=(), wait=True, **kw) -> RunningRouter:
        kw.setdefault("health_check_interval", 0.2)
        kw.setdefault("health_failure_threshold", 1)
        kw.setdefault("load_poll_interval", 0.05)
        args = RouterArgs(prefill=[(p.url, p.bootstrap_port) for p in prefill], decode=[d.url for d in decode],
                          worker=[w.url for w in worker], **kw)
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


@pytest.fixture(params=["simd", "scalar"])
def path(request, ops):
    """Run a kernel test on the AVX-512 code (where the CPU has it) and on the portable scalar code;
    ``ops`` is the test module's fixture for the loaded kernels."""
    if request.param == "simd" and ops.isa() == "scalar":
        pytest.skip("this CPU has no AVX-512: only the scalar code runs here")
    ops.set_force_scalar(request.param == "scalar")
    yield request.param
    ops.set_force_scalar(False)
