"""Ports for test servers.

A port taken with ``bind(0)`` comes from the kernel's ephemeral range, the same range every
outgoing connection (gloo, ZMQ, HTTP clients) takes its local port from. A test server that is
handed such a port binds it only after its start-up (tens of seconds under load), and by then an
outgoing connection may hold it: "address already in use". So the ports handed out here come from
below the ephemeral range, where the kernel never picks one by itself, each at most once per
process, and free when handed out. Each comes with the next BLOCK - 1 ports, free as well and handed
to nobody else: servers derive ports from a given one (a DP group's KV-event publisher at port +
group, a multi-host front end's output socket at --dist-init-addr's port + 1).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading

# above the ports transfer engines pick for themselves (Mooncake's RPC ports: 12000-17999)
LOW = 20000
BLOCK = 4


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HIGH = max(LOW + 1000, _ephemeral_low())
_lock = threading.Lock()
# each process walks the range from its own offset, so concurrent test processes rarely meet
_blocks = (_HIGH - LOW) // BLOCK
_next = itertools.count((os.getpid() * 7919) % _blocks)


def _free(port: int) -> bool:
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as s:
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((host, port))
        except OSError as e:
            if family == socket.AF_INET6 and e.errno in (97, 99):  # no IPv6 here
                continue
            return False
    return True


def free_port() -> int:
    """A port no test of this process was handed before, free on every address right now, with
    the BLOCK - 1 ports after it."""
    with _lock:
        for _ in range(_blocks):
            port = LOW + (next(_next) % _blocks) * BLOCK
            if all(_free(port + i) for i in range(BLOCK)):
                return port
    raise RuntimeError(f"no free block of {BLOCK} ports in {LOW}-{_HIGH - 1}")
