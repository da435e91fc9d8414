"""The fault-injecting relay of tests/helpers/tcp_relay.py against a loopback echo server."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.helpers.tcp_relay import Relay


@pytest.fixture
def relay():
    srv = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: _echo(c), daemon=True).start()

    threading.Thread(target=echo, daemon=True).start()
    r = Relay("127.0.0.1", "127.0.0.1", srv.getsockname()[1]).start()
    yield r
    r.stop()
    srv.close()


def _echo(conn: socket.socket) -> None:
    with conn:
        try:
            while data := conn.recv(4096):
                conn.sendall(data)
        except ConnectionResetError:
            pass  # the relay's reset reaches this side too


def _roundtrip(sock: socket.socket, payload: bytes = b"ping") -> float:
    t0 = time.monotonic()
    sock.sendall(payload)
    assert sock.recv(4096) == payload
    return time.monotonic() - t0


def test_passthrough_delay_stall_reset(relay):
    with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as s:
        assert _roundtrip(s) < 0.1
        relay.delay(50)  # each direction holds the chunk 50 ms
        assert 0.09 < _roundtrip(s) < 1.0
        relay.stall()
        s.sendall(b"held")
        s.settimeout(0.3)
        with pytest.raises(socket.timeout):
            s.recv(4096)
        relay.passthrough()
        s.settimeout(5)
        assert s.recv(4096) == b"held"  # nothing lost, only held
        assert relay.reset() == 2  # both sides of the one connection
        with pytest.raises(ConnectionResetError):
            s.sendall(b"x")
            s.recv(4096)
    with socket.create_connection(
        ("127.0.0.1", relay.port), timeout=5
    ) as s:  # new connections still work
        assert _roundtrip(s) < 0.1
    st = relay.stats()
    assert st["connections"] == 2 and st["resets"] == 2 and st["bytes_up"] >= 12
