"""Test hosts as Linux network namespaces.

``Hosts`` makes one namespace per host name (A, B, C by default), each with its own address on
a private /24 (``10.77.N.1``, ``.2``, ``.3``), all plugged into a bridge that lives in a further
namespace, so no host sees another's loopback and the traffic between them crosses veth links
that a test can slow down (``tc tbf``), cut (``ip link set down``) or, where the kernel has it,
``netem``. The test process itself reaches the hosts through one more veth from its own
namespace into the bridge (address ``10.77.N.254``); nothing else is added to it.

Names carry the creating process id (``pdt<pid>-A``, root-side veth ``pdt<pid>``), so several
sessions can run at once, and namespaces left behind by a session that died (its pid gone) are
swept before new ones are made. ``down()`` runs from the fixture finalizer and at exit; it kills
whatever still runs inside the namespaces, then deletes them (which deletes their veths).

Everything needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and ``ip``/``tc`` from Debian's
iproute2; ``unavailable_reason()`` says exactly what is missing, for the skip message.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import pytest

from tests.helpers import cluster as c
from tests.helpers.last_use import until_last_use

PREFIX = "pdt"
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\w+)$")


class NetnsError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and r.returncode != 0:
        raise NetnsError(
            f"ip {' '.join(args)}: {r.stderr.strip() or r.stdout.strip()} (exit {r.returncode})"
        )
    return r


def _namespaces() -> list[str]:
    r = _ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    r = _ip("netns", "pids", ns, check=False)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _delete(ns: str) -> None:
    _kill_inside(ns)
    _ip("netns", "delete", ns, check=False)


def sweep_stale() -> list[str]:
    """Delete the namespaces (and root-side veths) of sessions whose process is gone."""
    removed = []
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m and not c.is_alive(int(m.group(1))):
            _delete(ns)
            _ip("link", "delete", f"{PREFIX}{m.group(1)}", check=False)
            removed.append(ns)
    return removed


_reason_cache: dict[str, Optional[str]] = {}


def unavailable_reason() -> Optional[str]:
    """Why namespaces cannot be used here (None when they can), tried for real once."""
    if "r" in _reason_cache:
        return _reason_cache["r"]
    reason = None
    if not sys.platform.startswith("linux"):
        reason = f"network namespaces need Linux, this is {sys.platform}"
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        reason = "`ip`/`tc` not found: install Debian's iproute2 (apt-get install -y iproute2)"
    elif os.geteuid() != 0:
        reason = (
            "creating network namespaces needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN); "
            f"running as uid {os.geteuid()}"
        )
    else:
        probe = f"{PREFIX}{os.getpid()}-probe"
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            reason = f"`ip netns add` failed: {r.stderr.strip()}"
        else:
            r = _ip(
                "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1", check=False
            )
            if r.returncode != 0:
                reason = f"cannot create a veth pair inside a namespace: {r.stderr.strip()}"
            _delete(probe)
    _reason_cache["r"] = reason
    return reason


def _free_subnet() -> int:
    used = (
        _ip("-4", "-o", "addr", "show", check=False).stdout
        + _ip("-4", "route", "show", check=False).stdout
    )
    for n in range(100, 250):
        if f"10.77.{n}." not in used:
            return n
    raise NetnsError("no free 10.77.N.0/24 subnet between N=100 and 249")


class Hosts:
    """Namespaces ``names`` joined by a bridge; see the module docstring."""

    def __init__(self, names: Sequence[str] = ("A", "B", "C"), subnet: Optional[int] = None):
        self.names = list(names)
        self.tag = f"{PREFIX}{os.getpid()}"
        self.subnet = subnet
        self.bridge_ns = f"{self.tag}-br"
        self.created: list[str] = []
        self._atexit = False

    # -- lifecycle --------------------------------------------------------------------------
    def up(self) -> "Hosts":
        sweep_stale()
        self.subnet = self._subnet_or_free()
        if not self._atexit:
            atexit.register(self.down)
            self._atexit = True
        try:
            self._make(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                ns = self.ns(name)
                self._make(ns)
                # host end "eth0" inside the host, bridge end "h<i>" on the bridge (the cable)
                _ip(
                    "-n",
                    self.bridge_ns,
                    "link",
                    "add",
                    self._port(name),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    ns,
                )
                _ip("-n", self.bridge_ns, "link", "set", self._port(name), "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(name)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip(
                "link",
                "add",
                self.tag,
                "type",
                "veth",
                "peer",
                "name",
                "client",
                "netns",
                self.bridge_ns,
            )
            _ip("-n", self.bridge_ns, "link", "set", "client", "master", "br0", "up")
            _ip("addr", "add", f"{self.client_addr}/24", "dev", self.tag)
            _ip("link", "set", self.tag, "up")
        except Exception:
            self.down()
            raise
        return self

    def _subnet_or_free(self) -> int:
        return self.subnet if self.subnet is not None else _free_subnet()

    def _make(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.created.append(ns)

    def down(self) -> None:
        """Kill what runs inside, delete the namespaces and the root-side veth. Idempotent."""
        for ns in reversed(self.created):
            _delete(ns)
        self.created.clear()
        _ip("link", "delete", self.tag, check=False)

    # -- addresses and commands -------------------------------------------------------------
    def ns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def addr(self, name: str) -> str:
        return f"10.77.{self.subnet}.{self.names.index(name) + 1}"

    @property
    def client_addr(self) -> str:
        return f"10.77.{self.subnet}.254"

    def _port(self, name: str) -> str:
        return f"h{self.names.index(name)}"

    def wrap(self, name: str, cmd: Sequence[str]) -> list[str]:
        """``cmd`` to run inside host ``name`` (``ip netns exec`` execs it: the pid is the
        command's)."""
        return ["ip", "netns", "exec", self.ns(name), *cmd]

    def run(self, name: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(
            self.wrap(name, cmd), capture_output=True, text=True, timeout=60, check=False
        )
        if check and r.returncode != 0:
            raise NetnsError(f"{' '.join(cmd)} in {name}: {r.stderr.strip()} (exit {r.returncode})")
        return r

    # -- faults -----------------------------------------------------------------------------
    def cut(self, name: str) -> None:
        """Unplug host ``name``'s cable (the bridge end of its veth goes down: no carrier)."""
        _ip("-n", self.bridge_ns, "link", "set", "dev", self._port(name), "down")

    def restore(self, name: str) -> None:
        _ip("-n", self.bridge_ns, "link", "set", "dev", self._port(name), "up")

    def rate_limit(
        self, name: str, rate: str, burst: str = "32kbit", latency: str = "500ms"
    ) -> None:
        """Token bucket on host ``name``'s outgoing traffic (everything it sends)."""
        self.run(
            name,
            "tc",
            "qdisc",
            "replace",
            "dev",
            "eth0",
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            burst,
            "latency",
            latency,
        )

    def netem(self, name: str, *spec: str) -> None:
        """``tc ... netem SPEC`` on host ``name``'s outgoing traffic; NetnsError where the kernel
        has no netem (``netem_reason()``)."""
        self.run(name, "tc", "qdisc", "replace", "dev", "eth0", "root", "netem", *spec)

    def clear_qdisc(self, name: str) -> None:
        self.run(name, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)

    def netem_reason(self) -> Optional[str]:
        """None when netem works here, else why not (e.g. the kernel has no sch_netem)."""
        name = self.names[0]
        try:
            self.netem(name, "delay", "1ms")
        except NetnsError as e:
            return f"tc netem is not available in this kernel ({e})"
        self.clear_qdisc(name)
        return None

    # -- pdserve processes ------------------------------------------------------------------
    def proc(
        self,
        host: str,
        name: str,
        cmd: list[str],
        port: int,
        log_dir: Path,
        env: Optional[dict] = None,
    ) -> c.Proc:
        """A ``cluster.Proc`` running ``cmd`` inside ``host``, reached at the host's address."""
        return c.Proc(name, self.wrap(host, cmd), port, log_dir, env, host=self.addr(host))

    def server(
        self,
        host: str,
        name: str,
        model_path: str,
        log_dir: Path,
        *args: str,
        env: Optional[dict] = None,
    ) -> c.Proc:
        port = c.free_port()
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--model-path",
            model_path,
            "--host",
            self.addr(host),
            "--port",
            str(port),
            "--torch-num-threads",
            "1",
            *args,
        ]
        return self.proc(host, name, cmd, port, log_dir, env)

    def prefill(
        self,
        host: str,
        name: str,
        model_path: str,
        log_dir: Path,
        *args: str,
        env: Optional[dict] = None,
    ) -> c.Proc:
        bport = c.free_port()
        p = self.server(
            host,
            name,
            model_path,
            log_dir,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bport),
            *args,
            env=env,
        )
        p.bootstrap_port = bport
        return p

    def decode(
        self,
        host: str,
        name: str,
        model_path: str,
        log_dir: Path,
        *args: str,
        env: Optional[dict] = None,
    ) -> c.Proc:
        return self.server(
            host, name, model_path, log_dir, "--disaggregation-mode", "decode", *args, env=env
        )

    def router(
        self,
        host: str,
        name: str,
        prefills: list[c.Proc],
        decode_urls: list[str],
        log_dir: Path,
        *args: str,
    ) -> c.Proc:
        port = c.free_port()
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "router",
            "--host",
            self.addr(host),
            "--port",
            str(port),
            *args,
        ]
        for p in prefills:
            cmd += ["--prefill", p.url, str(p.bootstrap_port)]
        for url in decode_urls:
            cmd += ["--decode", url]
        return self.proc(host, name, cmd, port, log_dir)


def wait_reachable(hosts: Hosts, timeout: float = 10.0) -> None:
    """Until the test process can open a TCP connection path to every host (ARP/bridge ready):
    a refused connection proves the path works."""
    import socket

    def ok(addr: str) -> bool:
        try:
            socket.create_connection((addr, 9), timeout=0.5).close()
            return True
        except ConnectionRefusedError:
            return True
        except OSError:
            return False

    for name in hosts.names:
        addr = hosts.addr(name)
        c.wait_for(lambda a=addr: ok(a), timeout, f"host {name} to be reachable", interval=0.1)


def start_all(procs: Sequence[c.Proc]) -> None:
    for p in procs:
        p.start(wait=False)
    for p in procs:
        p.wait_ready()


def stop_all(procs: Sequence[c.Proc]) -> None:
    for p in reversed(list(procs)):
        p.stop()


def since(t0: float) -> float:
    return time.monotonic() - t0


# ---- session fixtures (tests/e2e/conftest.py imports them) -------------------------------------

# UCX (under NIXL) over TCP on the namespace's own interface: no shared-memory transports, no
# loopback device, so the bytes cross the veth links like they would cross a NIC.
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
PD_ARGS = [
    "--page-size",
    "16",
    "--chunked-prefill-size",
    "256",
    "--max-total-tokens",
    "65536",
    "--served-model-name",
    "tiny-llama",
    "--disaggregation-bootstrap-timeout",
    "10",
    "--disaggregation-waiting-timeout",
    "10",
]


@pytest.fixture(scope="session")
def netns_hosts(request):
    """Hosts A, B, C until the last test that uses them; skips with the exact reason where
    namespaces cannot be made."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    hosts = Hosts().up()
    down = until_last_use(request, hosts.down)
    try:
        wait_reachable(hosts)
        yield hosts
    finally:
        down()


# what the namespace suites use; all started together on first use, each skipped if not installed
NETNS_BACKENDS = ("mooncake", "nixl", "local")


@pytest.fixture(scope="session")
def netns_pd(request, netns_hosts, tiny_llama_path, tmp_path_factory):
    """``get(backend)``: prefill in A, decode in B, router in C with that transfer backend. On the
    first call the pairs of every ``NETNS_BACKENDS`` entry start at once (startup dominates on a
    small machine) and stay until the last test that uses them."""
    from pdserve.disagg.transfer import get_backend

    clusters: dict[str, dict] = {}
    missing: dict[str, str] = {}
    started: list[c.Proc] = []
    tried: list[bool] = []

    def start() -> None:
        h, pairs = netns_hosts, {}
        for backend in NETNS_BACKENDS:
            try:
                get_backend(backend)
            except ValueError as e:
                missing[backend] = str(e)
                continue
            logs = tmp_path_factory.mktemp(f"netns-{backend}")
            args = [*PD_ARGS, "--disaggregation-transfer-backend", backend]
            env = UCX_ENV if backend == "nixl" else None
            pairs[backend] = (
                h.prefill("A", f"P-{backend}", tiny_llama_path, logs, *args, env=env),
                h.decode("B", f"D-{backend}", tiny_llama_path, logs, *args, env=env),
                logs,
            )
            started.extend(pairs[backend][:2])
        start_all(started)
        routers = {
            b: h.router("C", f"R-{b}", [P], [D.url], logs, "--health-check-interval", "1")
            for b, (P, D, logs) in pairs.items()
        }
        started.extend(routers.values())
        start_all(list(routers.values()))
        for b, (P, D, logs) in pairs.items():
            clusters[b] = {
                "backend": b,
                "prefill": P,
                "decode": D,
                "router": routers[b],
                "logs": logs,
            }

    def get(backend: str) -> dict:
        if not tried:
            tried.append(True)
            start()
        if backend in missing:
            pytest.skip(missing[backend])
        return clusters[backend]

    stop = until_last_use(request, lambda: stop_all(started))
    try:
        yield get
    finally:
        stop()
