"""Workers found through DNS (``--prefill-dns NAME:PORT[:BOOTSTRAP_PORT]``, ``--decode-dns
NAME:PORT``): every ``--dns-interval`` seconds each name is resolved (A and AAAA records), each
address that appeared is added like ``POST /workers`` adds a worker (``membership.py``: health
checked and paired first; one that is not ready yet is tried again at the next round), each
address that went away is drained. A Kubernetes headless Service, a Consul service or a Docker
network alias all publish their members this way.

Only a definite answer changes membership: a name that does not exist (NXDOMAIN) or has no
address has no workers, but a resolver that times out or fails (SERVFAIL) leaves the workers as
they are, so a DNS outage never drains a cluster. Workers added another way (command line, API)
are never drained by DNS.

Resolvers: the system's (``getaddrinfo``: /etc/hosts, search domains and all), or with
``--dns-server HOST[:PORT]`` plain DNS queries to that server (dnspython).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from dataclasses import dataclass

from pdserve.router.args import dns_server_address
from pdserve.router.membership import Membership, MembershipError
from pdserve.router.workers import DECODE, PREFILL, WorkerPool

logger = logging.getLogger(__name__)

_NO_SUCH_NAME = {getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, n)}


@dataclass(frozen=True)
class Target:
    role: str
    name: str
    port: int
    bootstrap_port: int | None = None

    @property
    def source(self) -> str:
        return f"dns {self.name}"

    def url(self, address: str) -> str:
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        return f"http://{host}:{self.port}"


def targets(args) -> list[Target]:
    return [Target(PREFILL, n, p, b) for n, p, b in args.prefill_dns] + [
        Target(DECODE, n, p) for n, p in args.decode_dns
    ]


class SystemResolver:
    async def addresses(self, name: str) -> set[str] | None:
        """The name's addresses; empty when it has none; None when the resolver failed."""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                name, None, type=socket.SOCK_STREAM
            )
        except socket.gaierror as e:
            return set() if e.errno in _NO_SUCH_NAME else None
        return {info[4][0] for info in infos}


class ServerResolver:
    """Queries one DNS server directly (``--dns-server``)."""

    def __init__(self, server: str, timeout: float):
        import dns.asyncresolver

        host, port = dns_server_address(server)
        self.resolver = dns.asyncresolver.Resolver(configure=False)
        self.resolver.nameservers = [host]
        self.resolver.port = port
        self.resolver.lifetime = timeout

    async def addresses(self, name: str) -> set[str] | None:
        import dns.exception
        import dns.resolver

        found: set[str] = set()
        failed = None
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self.resolver.resolve(name, rdtype)
            except dns.resolver.NXDOMAIN:
                return set()
            except dns.resolver.NoAnswer:
                continue
            except dns.exception.DNSException as e:
                failed = failed or f"{rdtype}: {e!r}"
                continue
            found |= {r.address for r in answer}
        if (
            failed and not found
        ):  # addresses of one family are enough; none, after a failure, says nothing
            logger.warning(
                "DNS query for %s failed (%s); keeping its workers as they are", name, failed
            )
            return None
        return found


class DNSDiscovery:
    def __init__(self, pool: WorkerPool, membership: Membership, args):
        self.pool = pool
        self.membership = membership
        self.interval = args.dns_interval
        self.targets = targets(args)
        timeout = min(args.dns_interval, 5.0)
        self.resolver = (
            ServerResolver(args.dns_server, timeout) if args.dns_server else SystemResolver()
        )
        self._adding: dict[str, asyncio.Task] = {}
        self._refused: dict[str, str] = {}  # url -> why it was last refused (logged once)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.resolve_all()
        self._task = asyncio.create_task(self._loop(), name="router-dns")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._adding.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.resolve_all()

    async def resolve_all(self) -> None:
        await asyncio.gather(*(self.resolve(t) for t in self.targets))

    async def resolve(self, target: Target) -> None:
        addresses = await self.resolver.addresses(target.name)
        if addresses is None:
            return
        urls = {target.url(a) for a in addresses}
        for worker in [
            w for w in self.pool.workers if w.source == target.source and w.draining is None
        ]:
            if worker.url not in urls:
                self.membership.remove(worker, f"its address left DNS name {target.name}")
        for url in sorted(urls):
            if self.pool.find(url) is None and url not in self._adding:
                self._adding[url] = asyncio.create_task(
                    self._add(target, url), name=f"router-dns-add-{url}"
                )

    async def _add(self, target: Target, url: str) -> None:
        try:
            await self.membership.add(
                url,
                "prefill" if target.role == PREFILL else "decode",
                target.bootstrap_port,
                source=target.source,
            )
            self._refused.pop(url, None)
        except MembershipError as e:
            if self._refused.get(url) != str(e):  # said once per reason; tried again every round
                logger.warning("DNS name %s: not adding %s yet: %s", target.name, url, e)
            self._refused[url] = str(e)
        finally:
            self._adding.pop(url, None)
