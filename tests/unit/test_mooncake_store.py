"""The Mooncake Store tier backend against a real ``mooncake_master`` on TCP: two clients (two
servers) see each other's entries, corrupt entries are misses, and a store that is stopped,
absent costs only misses, within each call's deadline, behind a circuit breaker."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from pdserve.engine.kv_tier.base import backend_class
from pdserve.engine.kv_tier.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from pdserve.engine.kv_tier.mooncake_config import MooncakeStoreConfig
from tests.helpers.store_master import running_master, store_args

pytest.importorskip("mooncake.store", reason="the Mooncake package is not installed")

LAYOUT = "tiny-ps4-tp0of1-0123456789abcdef"
PAGE_NBYTES = 4096
SMALL = {"global_segment_size": "32MB", "local_buffer_size": "16MB"}


def wait_for(cond, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def backend(master, **overrides):
    cls = backend_class("mooncake")
    extra = json.dumps({**master.client_config(**SMALL), **overrides})
    b = cls(store_args(extra), LAYOUT, PAGE_NBYTES)
    return b


def framed(i: int) -> bytes:
    """An entry's bytes (the backend stores them verbatim; the tier frames and checks them)."""
    return i.to_bytes(8, "little") + bytes([i % 251]) * PAGE_NBYTES


def stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (a signal takes effect thread by thread)."""
    tasks = os.listdir(f"/proc/{pid}/task")
    states = []
    for t in tasks:
        with open(f"/proc/{pid}/task/{t}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return all(s in "Tt" for s in states)


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    with running_master(str(tmp_path_factory.mktemp("mooncake"))) as m:
        yield m


def test_entries_are_shared_between_clients_and_checked(master):
    a, b = backend(master), backend(master)
    try:
        wait_for(lambda: a.joined and b.joined, what="both clients joined")
        keys = [f"{LAYOUT}/{i:016x}" for i in range(3)]
        for i, key in enumerate(keys[:2]):
            assert a.put(key, framed(i))
        assert b.exists(keys) == 2  # leading present keys only
        assert b.get(keys[1]) == framed(1) and b.get(keys[0]) == framed(0)
        assert b.get(keys[2]) is None
        assert b.stats()["hits"] == 2 and b.stats()["misses"] == 1
        assert a.stats()["puts"] == 2 and a.stats()["put_failures"] == 0
    finally:
        a.close()
        b.close()


def test_a_stopped_master_costs_misses_within_the_deadline(master):
    b = backend(master, timeout_s=0.5, breaker_cooldown_s=0.5)
    try:
        wait_for(lambda: b.joined, what="joined")
        key = f"{LAYOUT}/{7:016x}"
        assert b.put(key, framed(7))
        os.kill(master.proc.pid, signal.SIGSTOP)  # a hung master: its calls block
        wait_for(lambda: stopped(master.proc.pid), what="the master stopped")
        try:
            start = time.monotonic()
            assert b.exists([key]) == 0
            assert time.monotonic() - start < 2.0  # the deadline, not Mooncake's own timeouts
            assert b.breaker.state == OPEN
            start = time.monotonic()
            assert b.get(key) is None and not b.put(key, framed(7))
            assert time.monotonic() - start < 0.2  # refused at once while open
            assert b.stats()["refused"] >= 2
        finally:
            os.kill(master.proc.pid, signal.SIGCONT)
        # after the cool-down a probe goes through and calls resume
        wait_for(lambda: b.exists([key]) == 1, what="calls resumed after SIGCONT")
        assert b.breaker.state == CLOSED
        assert b.get(key) == framed(7)
    finally:
        b.close()


def test_an_absent_master_is_only_misses(tmp_path):
    with running_master(str(tmp_path)) as m:
        address = m.address
    cls = backend_class("mooncake")
    extra = json.dumps({"master_server_address": address, **SMALL, "timeout_s": 0.5})
    start = time.monotonic()
    b = cls(store_args(extra), LAYOUT, PAGE_NBYTES)  # joining runs in the background
    try:
        key = f"{LAYOUT}/{1:016x}"
        assert b.get(key) is None and b.exists([key]) == 0 and not b.put(key, framed(1))
        assert time.monotonic() - start < 1.0
        assert not b.joined
    finally:
        b.close()


def test_a_killed_master_costs_misses_and_a_quick_close(tmp_path):
    with running_master(str(tmp_path)) as m:
        b = backend(m)
        wait_for(lambda: b.joined, what="joined")
        key = f"{LAYOUT}/{3:016x}"
        assert b.put(key, framed(3)) and b.get(key) == framed(3)
        m.kill()
        assert not b.put(key, framed(3)) and b.exists([key]) == 0
        assert b.get(key) is None
        start = time.monotonic()
        b.close()  # Mooncake's own close would hold the GIL for seconds against a dead master
        assert time.monotonic() - start < 1.5


def test_breaker_opens_probes_and_backs_off():
    now = [0.0]
    br = CircuitBreaker("t", failures=2, cooldown_s=1.0, max_cooldown_s=3.0, clock=lambda: now[0])
    br.record(False)
    assert br.state == CLOSED and br.allow()
    br.record(False)
    assert br.state == OPEN and not br.allow()
    now[0] = 1.0
    assert br.allow() and br.state == HALF_OPEN
    assert not br.allow()  # one probe at a time
    br.record(False)  # the probe failed: twice the cool-down
    assert br.state == OPEN and br.retry_at == 3.0
    now[0] = 3.0
    assert br.allow()
    br.record(True)
    assert br.state == CLOSED and br.allow()


@pytest.mark.parametrize(
    "extra, message",
    [
        ("{not json", "not valid JSON"),
        ('["a"]', "must be a JSON object"),
        ("{}", "needs the master's address"),
        ('{"master_server_address": "nohost"}', "master_server_address"),
        ('{"master_server_address": "h:1", "global_segment_size": "lots"}', "global_segment_size"),
        ('{"master_server_address": "h:1", "protocol": "udp"}', "protocol"),
        ('{"master_server_address": "h:1", "timeout_s": 0}', "timeout_s"),
        ('{"master_server_address": "h:1", "master_adress": "h:2"}', "unknown key"),
    ],
)
def test_config_errors_name_the_flag(extra, message, monkeypatch):
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    with pytest.raises(ValueError, match=message) as e:
        MooncakeStoreConfig.resolve(extra)
    assert "hicache" in str(e.value)


def test_config_from_environment_and_flag(monkeypatch):
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.1:50051")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1GB")
    cfg = MooncakeStoreConfig.resolve(None, "10.0.0.2")
    assert cfg.master_server_address == "10.0.0.1:50051"
    assert cfg.global_segment_size == 1 << 30 and cfg.local_hostname == "10.0.0.2"
    assert cfg.metadata_server == "P2PHANDSHAKE" and cfg.protocol == "tcp"
    cfg = MooncakeStoreConfig.resolve('{"master_server_address": "127.0.0.1:9"}', "0.0.0.0")
    assert cfg.master_server_address == "127.0.0.1:9" and cfg.local_hostname == "127.0.0.1"


def test_local_buffer_must_hold_a_page(master):
    cls = backend_class("mooncake")
    extra = master.client_config_json(local_buffer_size=1024)
    with pytest.raises(ValueError, match="local_buffer_size"):
        cls(store_args(extra), LAYOUT, PAGE_NBYTES)


def test_server_args_check_the_store_settings_at_start_up(monkeypatch):
    from pdserve.config import ServerArgs

    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    base = dict(model_path="m", enable_hierarchical_cache=True, hicache_storage_backend="mooncake")
    with pytest.raises(ValueError, match="hicache_storage_backend_extra_config: .*master"):
        ServerArgs(**base)
    with pytest.raises(ValueError, match="hicache_storage_backend_extra_config: not valid JSON"):
        ServerArgs(**base, hicache_storage_backend_extra_config="{oops")
    args = ServerArgs(
        **base, hicache_storage_backend_extra_config='{"master_server_address": "127.0.0.1:1"}'
    )
    assert args.hicache_storage_backend == "mooncake"
