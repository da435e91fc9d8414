"""Which decodes a decode may move its requests to and take moved requests from
(``--migration-peers``): the URL a caller names, checked before any connection is made.

``POST /migrate`` and ``/switch_role``'s ``migrate_to`` make a decode connect to the URLs in the
body (their ``/server_info``, then the KV transfer), and ``POST /migrate_in`` makes it connect to
the ``bootstrap_host`` in the body. Without a list anyone who reaches the server could point it
at any host and port. Entries (comma-separated):

- ``HOST`` or ``HOST:PORT`` (``[V6]:PORT`` for IPv6; a URL's scheme is ignored): that host, on any
  port or on that port. Names match names as written (no DNS look-up: ``localhost`` is not
  ``127.0.0.1``);
- ``ADDR/PREFIX`` (``10.0.0.0/8``, ``fd00::/8``): any address of that network, given as an address;
- ``*``: any host (what a server did before this list existed).

The default is none: a decode moves nothing until it is told its peers (``pdserve launch`` lists
the decodes it starts). ``/migrate_in`` takes a request only from a peer's host (its bootstrap
port is any free one, so ports are not compared there).
Imports nothing heavy: the config and the router use it.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import re
import urllib.parse
from typing import Optional, Union

IP = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_LAST_LABEL = r"[A-Za-z](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"  # a top label is never all digits
NAME_PATTERN = rf"(?:{_LABEL}\.)*{_LAST_LABEL}\.?"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
IPV4_PATTERN = rf"(?:{_OCTET}\.){{3}}{_OCTET}"
IPV6_PATTERN = r"\[[0-9A-Fa-f:.]{2,45}\]"
IPV6_BARE_PATTERN = r"[0-9A-Fa-f:.]{2,45}"  # a bootstrap_host names an IPv6 address bare
PORT_PATTERN = (
    r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
)
SCHEME_PATTERN = r"(?:[Hh][Tt][Tt][Pp][Ss]?://)?"
_NAME = re.compile(NAME_PATTERN + r"\Z")
MAX_NAME = 253


@dataclasses.dataclass(frozen=True)
class Target:
    """A server's base URL: scheme, host (lower case, no brackets) and port."""

    scheme: str
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def _ip(host: str) -> Optional[IP]:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def check_host(host: str) -> str:
    """``host`` (an address, ``[V6]`` included, or a DNS name) in lower case without brackets;
    ValueError saying why it is none."""
    h = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if _ip(h) is not None:
        return str(_ip(h))
    if ":" in h or host.startswith("["):
        raise ValueError(f"{host!r} is not an IP address")
    if not h.isascii() or not _NAME.match(h) or len(h) > MAX_NAME:
        raise ValueError(
            f"{host!r} is not a host name (letters, digits and hyphens in dot-separated labels; "
            "an internationalised name in its xn-- form)"
        )
    return h.lower().rstrip(".")


def parse_target(text: str, default_port: bool = True) -> Target:
    """A server's base URL (``http://host:port``, ``host:port``, ``https://[v6]:port``); ValueError
    saying why ``text`` is not one. Nothing is resolved or connected."""
    t = text.strip()
    if not t:
        raise ValueError("is empty")
    if not t.isascii() or not t.isprintable():
        raise ValueError(
            f"{text!r} has characters a URL cannot have (give an internationalised host name "
            "in its xn-- form)"
        )
    if "://" not in t:
        t = "http://" + t
    try:
        parts = urllib.parse.urlsplit(t)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{text!r} is not a URL: {e}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"{text!r}: the scheme must be http or https")
    if "@" in parts.netloc:
        raise ValueError(f"{text!r}: a server URL carries no user name or password")
    if parts.path not in ("", "/") or parts.query or parts.fragment or "?" in t or "#" in t:
        raise ValueError(f"{text!r}: name the server's base URL (scheme, host, port), no path")
    netloc_host = parts.netloc.rpartition(":")[0] if port is not None else parts.netloc
    if not netloc_host:
        raise ValueError(f"{text!r} has no host")
    host = check_host(netloc_host)
    if port == 0:
        raise ValueError(f"{text!r}: port 0 is no server's port")
    if port is None and default_port:
        port = 443 if parts.scheme.lower() == "https" else 80
    return Target(parts.scheme.lower(), host, port if port is not None else 0)


@dataclasses.dataclass(frozen=True)
class _Entry:
    host: Optional[str] = None  # a name or an address, as check_host gives it
    port: Optional[int] = None  # None: any port
    network: Optional[Network] = None

    def matches(self, host: str, port: Optional[int]) -> bool:
        if self.network is not None:
            ip = _ip(host)
            return ip is not None and ip.version == self.network.version and ip in self.network
        return host == self.host and (self.port is None or port is None or port == self.port)


class MigrationPeers:
    """``--migration-peers``, parsed; ValueError naming a bad entry."""

    def __init__(self, spec: Optional[str]):
        self.spec = spec or ""
        self.any = False
        self.entries: list[_Entry] = []
        for raw in (e.strip() for e in self.spec.split(",")):
            if not raw:
                continue
            if raw == "*":
                self.any = True
            elif "/" in raw and "://" not in raw:
                try:
                    self.entries.append(_Entry(network=ipaddress.ip_network(raw, strict=False)))
                except ValueError as e:
                    raise ValueError(f"{raw!r} is not a network: {e}") from None
            else:
                t = parse_target(raw, default_port=False)
                self.entries.append(_Entry(host=t.host, port=t.port or None))

    @staticmethod
    @functools.lru_cache(maxsize=16)
    def of(spec: Optional[str]) -> "MigrationPeers":
        """The parsed list of ``spec``, parsed once per process (the routes ask on every call)."""
        return MigrationPeers(spec)

    def __bool__(self) -> bool:
        return self.any or bool(self.entries)

    def allows(self, target: Target) -> bool:
        return self.any or any(e.matches(target.host, target.port) for e in self.entries)

    def allows_url(self, text: str) -> bool:
        """Whether ``text`` is a server URL among the peers (False for what is no URL)."""
        try:
            return self.allows(parse_target(text))
        except ValueError:
            return False

    def allows_host(self, host: str) -> bool:
        """A host a moved request may come from (any port: a bootstrap port is any free one)."""
        return self.any or any(e.matches(host, None) for e in self.entries)

    def refusal(self, what: str, name: str) -> str:
        listed = self.spec if self else "none"
        return (
            f"{what}: {name} is not among this server's --migration-peers ({listed}); start it "
            "with --migration-peers naming the decodes it may exchange requests with"
        )

    # ---- the schemas /openapi.json publishes for these fields -----------------------------------
    def target_schema(self) -> dict:
        """A URL this server may move requests to, as a pattern (exact for host entries)."""
        if not self:
            return {"not": {}, "description": "no peers: start with --migration-peers"}
        return {"type": "string", "pattern": self._pattern(with_port=True)}

    def host_schema(self) -> dict:
        if not self:
            return {"not": {}, "description": "no peers: start with --migration-peers"}
        return {"type": "string", "pattern": self._pattern(with_port=False)}

    def _pattern(self, with_port: bool) -> str:
        v6 = IPV6_PATTERN if with_port else IPV6_BARE_PATTERN
        hosts = []
        if self.any:
            hosts.append((f"(?:{NAME_PATTERN}|{IPV4_PATTERN}|{v6})", None))
        for e in self.entries:
            if e.network is not None:
                hosts.append((IPV4_PATTERN if e.network.version == 4 else v6, None))
            else:
                bracketed = ":" in e.host and with_port
                hosts.append((re.escape(f"[{e.host}]" if bracketed else e.host), e.port))
        alternatives = []
        for host, port in hosts:
            if not with_port:
                alternatives.append(host)
            elif port is None:
                alternatives.append(f"{SCHEME_PATTERN}{host}(?::{PORT_PATTERN})?/?")
            else:
                alternatives.append(f"{SCHEME_PATTERN}{host}:{port}/?")
        return "^(?:" + "|".join(dict.fromkeys(alternatives)) + ")$"
