"""Flags and PDSERVE_* variables of PD failure handling, and the fault injector's semantics."""

from __future__ import annotations

import argparse

import pytest

from pdserve.config import ServerArgs
from pdserve.disagg.faults import FaultInjector


def parse(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(
        parser.parse_args(["--model-path", "m", "--device", "cpu", *argv])
    )


def test_defaults_detect_a_dead_peer_within_3s():
    a = parse([])
    assert a.disaggregation_heartbeat_interval * a.disaggregation_heartbeat_misses <= 3.0
    assert a.disaggregation_bootstrap_timeout == a.disaggregation_waiting_timeout == 30.0
    assert 0 < a.disaggregation_prealloc_timeout <= 10 and a.disaggregation_fault_prob == 0.0


def test_flags_and_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_DISAGGREGATION_FAULT_PROB", "0.2")
    monkeypatch.setenv("PDSERVE_DISAGGREGATION_FAULT_MODE", "drop_status,delay_transfer")
    monkeypatch.setenv("PDSERVE_DISAGGREGATION_FAULT_DELAY", "0.5")
    monkeypatch.setenv("PDSERVE_DISAGGREGATION_PREALLOC_TIMEOUT", "2.5")
    monkeypatch.setenv("PDSERVE_DISAGGREGATION_MAX_PREALLOC_QUEUE", "7")
    monkeypatch.setenv("PDSERVE_DISAGGREGATION_SECRET", "from-env")
    a = parse([])
    assert (
        a.disaggregation_fault_prob,
        a.disaggregation_fault_mode,
        a.disaggregation_fault_delay,
    ) == (0.2, "drop_status,delay_transfer", 0.5)
    assert (a.disaggregation_prealloc_timeout, a.disaggregation_max_prealloc_queue) == (2.5, 7)
    assert a.disaggregation_secret == "from-env"
    a = parse(
        ["--disaggregation-fault-prob", "0.05", "--disaggregation-secret", "flag"]
    )  # a flag wins
    assert a.disaggregation_fault_prob == 0.05 and a.disaggregation_secret == "flag"


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("disaggregation_fault_prob", 1.5, "must be in [0, 1]"),
        ("disaggregation_fault_mode", "explode", "comma-separated list"),
        ("disaggregation_fault_mode", "", "comma-separated list"),
        ("disaggregation_fault_delay", -1.0, "must be >= 0"),
        ("disaggregation_heartbeat_misses", 0, "must be >= 1"),
        ("disaggregation_prealloc_timeout", 0.0, "must be > 0"),
        ("disaggregation_max_prealloc_queue", -1, "must be >= 0"),
        ("disaggregation_secret", "", "must not be empty"),
    ],
)
def test_bad_values_name_the_field(field, value, needle):
    with pytest.raises(ValueError, match=field) as e:
        ServerArgs(model_path="m", device="cpu", **{field: value})
    assert needle in str(e.value)


def test_fault_injector_decides_once_per_room():
    off = FaultInjector(0.0, "fail_transfer")
    assert not off.enabled and off.mode(1) is None
    every = FaultInjector(1.0, "drop_status,corrupt_aux_room", seed=3)
    modes = [every.mode(room) for room in range(200)]
    assert set(modes) == {"drop_status", "corrupt_aux_room"}
    assert [every.mode(room) for room in range(200)] == modes  # same answer for a room
    assert sum(every.stats()["injected"].values()) == 200
    some = FaultInjector(0.05, "fail_transfer", seed=1)
    hits = sum(some.mode(room) is not None for room in range(4000))
    assert 120 < hits < 280  # about 5 % of rooms
    some.forget(7)
    assert 7 not in some._rooms
