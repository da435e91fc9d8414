"""This host as the servers name it: which host and network namespace a process runs in, and the
local address that reaches a peer. Imports nothing heavy (the HTTP front end uses both and loads
no engine module)."""

from __future__ import annotations

import os
import socket


def host_identity() -> str:
    """``<boot id>/<network namespace inode>``: equal for two processes on one host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        net = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        net = "unknown-netns"
    return f"{boot}/{net}"


def route_ip(peer_host: str) -> str:
    """The local address used to reach ``peer_host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((peer_host, 9))
            return sock.getsockname()[0]
    except OSError:
        return "127.0.0.1"
