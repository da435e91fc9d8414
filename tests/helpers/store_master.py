"""A real ``mooncake_master`` for tests (``pdserve.server.store_master``), stopped in teardown;
``store_args`` builds the server arguments a Mooncake tier backend reads."""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace
from typing import Iterator

import pytest

from pdserve.server.store_master import StoreMaster


@contextlib.contextmanager
def running_master(log_dir: str) -> Iterator[StoreMaster]:
    """A master on free loopback ports, logging to ``log_dir``/mooncake_master.log; killed when
    the block ends, however it ends."""
    pytest.importorskip("mooncake.store", reason="the Mooncake package is not installed")
    master = StoreMaster(log_path=os.path.join(log_dir, "mooncake_master.log"))
    try:
        yield master.wait_ready()
    finally:
        master.kill()
        master.stop()


def store_args(extra_config: str, page_size: int = 4) -> SimpleNamespace:
    """What ``MooncakeStoreBackend`` reads of ``ServerArgs``."""
    return SimpleNamespace(
        hicache_storage_backend_extra_config=extra_config,
        host="127.0.0.1",
        page_size=page_size,
    )
