"""Where a server finds its Mooncake Store and how it joins it, as SGLang's Mooncake L3 reads it:
the keys of ``--hicache-storage-backend-extra-config`` (a JSON object) win over the ``MOONCAKE_*``
environment, which wins over the defaults.

==========================  ==============================  ================================
extra-config key            environment                     default
==========================  ==============================  ================================
master_server_address       MOONCAKE_MASTER                 (required) ``host:port``
metadata_server             MOONCAKE_TE_META_DATA_SERVER    ``P2PHANDSHAKE``
global_segment_size         MOONCAKE_GLOBAL_SEGMENT_SIZE    4 GiB contributed to the store
local_buffer_size           MOONCAKE_LOCAL_BUFFER_SIZE      16 MiB (a get lands there first)
protocol                    MOONCAKE_PROTOCOL               ``tcp`` (``rdma`` with devices)
device_name                 MOONCAKE_DEVICE                 ``""`` (RDMA devices, comma list)
local_hostname              MOONCAKE_LOCAL_HOSTNAME         the server's ``--host`` if it is
                                                            an address, else 127.0.0.1
==========================  ==============================  ================================

Sizes are bytes or strings such as ``"512MB"``, ``"4GiB"``. pdserve's own keys bound how a
store that is down or slow affects serving: ``timeout_s`` (each call's deadline, 2 s),
``breaker_failures`` (consecutive failures that stop calls, 3), ``breaker_cooldown_s`` (the
first pause before a retry, 2 s; doubled after each failed retry up to
``breaker_max_cooldown_s``, 30 s).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from typing import Optional

from pdserve.config import is_loopback, split_host_port

FLAG = "hicache_storage_backend_extra_config"

ENV = {
    "master_server_address": "MOONCAKE_MASTER",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "local_buffer_size": "MOONCAKE_LOCAL_BUFFER_SIZE",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
}

_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)


def parse_size(name: str, value) -> int:
    """Bytes from an int or a string like ``"4GB"`` / ``"512 MiB"``; ValueError naming ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{FLAG}: {name} must be a size, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ValueError(f"{FLAG}: {name} must be bytes or e.g. '4GB', got {value!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper().replace("I", "")])
    if n <= 0:
        raise ValueError(f"{FLAG}: {name} must be > 0, got {value!r}")
    return n


@dataclass
class MooncakeStoreConfig:
    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = 4 << 30
    local_buffer_size: int = 16 << 20
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    timeout_s: float = 2.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 2.0
    breaker_max_cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        try:
            split_host_port(self.master_server_address)
        except ValueError as e:
            raise ValueError(f"{FLAG}: master_server_address (MOONCAKE_MASTER) {e}") from None
        self.global_segment_size = parse_size("global_segment_size", self.global_segment_size)
        self.local_buffer_size = parse_size("local_buffer_size", self.local_buffer_size)
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"{FLAG}: protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        for name in ("timeout_s", "breaker_cooldown_s", "breaker_max_cooldown_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{FLAG}: {name} must be a number > 0, got {value!r}")
        if self.breaker_max_cooldown_s < self.breaker_cooldown_s:
            raise ValueError(
                f"{FLAG}: breaker_max_cooldown_s ({self.breaker_max_cooldown_s}) is below "
                f"breaker_cooldown_s ({self.breaker_cooldown_s})"
            )
        if not isinstance(self.breaker_failures, int) or self.breaker_failures < 1:
            raise ValueError(f"{FLAG}: breaker_failures must be an int >= 1")

    @classmethod
    def resolve(cls, extra_config: Optional[str], server_host: str = "127.0.0.1"):
        """The configuration from the flag's JSON (``extra_config``), the environment and the
        defaults; ValueError naming the flag and the key for anything wrong."""
        given = parse_extra_config(extra_config)
        known = {f.name for f in fields(cls)}
        # SGLang's other backends' keys may share the JSON; only unknown mooncake-looking keys
        # are errors, so a typo in ours is caught
        typos = sorted(k for k in given if k not in known and _looks_like_ours(k))
        if typos:
            raise ValueError(f"{FLAG}: unknown key(s) {typos}; known: {sorted(known)}")
        values = {k: v for k, v in given.items() if k in known}
        for key, env in ENV.items():
            if key not in values and os.environ.get(env):
                values[key] = os.environ[env]
        if "master_server_address" not in values:
            raise ValueError(
                f"--hicache-storage-backend mooncake needs the master's address: "
                f'{FLAG} {{"master_server_address": "host:port"}} or MOONCAKE_MASTER'
            )
        if "local_hostname" not in values:
            host = server_host.strip("[]")
            values["local_hostname"] = (
                host if _is_address(host) and host not in ("0.0.0.0", "::") else "127.0.0.1"
            )
        return cls(**values)

    @property
    def master_is_local(self) -> bool:
        return is_loopback(split_host_port(self.master_server_address)[0])


def parse_extra_config(raw: Optional[str]) -> dict:
    """``--hicache-storage-backend-extra-config`` as a dict (``{}`` when not given)."""
    if raw is None or not str(raw).strip():
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{FLAG}: not valid JSON ({e}): {raw!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{FLAG}: must be a JSON object, got {raw!r}")
    return value


def _looks_like_ours(key: str) -> bool:
    return any(word in key for word in ("mooncake", "master", "segment", "breaker", "buffer"))


def _is_address(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def check_args(args, bad) -> None:
    """Start-up check of ``--hicache-storage-backend mooncake``'s settings (``bad(field, why)``)."""
    try:
        MooncakeStoreConfig.resolve(getattr(args, FLAG), args.host)
    except ValueError as e:
        bad(FLAG, str(e).removeprefix(f"{FLAG}: "))
