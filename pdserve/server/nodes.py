"""The hosts of one server (``--nnodes N --node-rank R --dist-init-addr HOST:PORT``): which ranks
each node runs and where they meet.

Node 0 runs the HTTP front end and ranks ``[0, W/N)`` of the ``W = tp_size * pp_size`` ranks;
node ``r`` runs ranks ``[r*W/N, (r+1)*W/N)`` and no HTTP server. Everything is derived from
``--dist-init-addr`` (node 0's address, the same on every node):

- ``tcp://HOST:PORT``: torch.distributed's rendezvous (rank 0's TCP store) and, through that
  store, the ranks' heartbeats (``heartbeat.py``);
- ``tcp://HOST:PORT+1``: the front end's PULL socket for outputs. Every DP-group leader connects
  a PUSH to it, wherever it runs. Only rank 0, always on node 0, receives from the front end (it
  broadcasts the inputs to every rank over torch.distributed), so its input socket stays ipc://.

A one-host server keeps both ZMQ sockets on ipc:// and joins its ranks on a loopback port
(``--dist-init-addr`` still chooses the rendezvous when given).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from dataclasses import dataclass
from typing import Optional

import msgspec

from pdserve.config import split_host_port

logger = logging.getLogger(__name__)

OUTPUT_PORT_OFFSET = 1  # the front end's output socket: --dist-init-addr's port + 1
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


@dataclass(frozen=True)
class NodeLayout:
    nnodes: int = 1
    node_rank: int = 0
    world_size: int = 1
    host: str = ""  # --dist-init-addr's host ("" when unset)
    port: int = 0

    @classmethod
    def from_args(cls, args) -> "NodeLayout":
        addr = getattr(args, "dist_init_addr", None)
        host, port = split_host_port(addr) if addr else ("", 0)
        return cls(
            nnodes=getattr(args, "nnodes", 1),
            node_rank=getattr(args, "node_rank", 0),
            world_size=getattr(args, "world_size", 1),
            host=host,
            port=port,
        )

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def ranks(self, node: Optional[int] = None) -> range:
        """The global ranks node ``node`` runs (this node's by default)."""
        node = self.node_rank if node is None else node
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def describe(self, node: Optional[int] = None) -> str:
        node = self.node_rank if node is None else node
        r = self.ranks(node)
        ranks = f"rank {r.start}" if len(r) == 1 else f"ranks {r.start}-{r.stop - 1}"
        return f"node {node} of {self.nnodes} ({ranks})"

    def _tcp(self, port: int) -> str:
        return f"tcp://[{self.host}]:{port}" if ":" in self.host else f"tcp://{self.host}:{port}"

    @property
    def init_address(self) -> str:
        """torch.distributed's ``init_method`` ("" when --dist-init-addr is unset)."""
        return self._tcp(self.port) if self.host else ""

    @property
    def output_address(self) -> str:
        """Where the group leaders send outputs to the front end ("" on one host: ipc://)."""
        return self._tcp(self.port + OUTPUT_PORT_OFFSET) if self.multi_node else ""

    def output_bind_address(self) -> str:
        """``output_address`` as node 0 binds it (ZMQ binds addresses, not host names)."""
        if ":" in self.host:
            return self.output_address
        return f"tcp://{socket.gethostbyname(self.host)}:{self.port + OUTPUT_PORT_OFFSET}"


def zmq_ipv6(address: str) -> bool:
    """Whether a ZMQ socket for ``address`` needs the IPV6 option."""
    return address.startswith("tcp://[")


def interface_towards(host: str) -> Optional[str]:
    """The name of the local network interface whose IPv4 address routes to ``host`` (None when
    it cannot be told, e.g. IPv6)."""
    try:
        target = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # no packet is sent: this only asks the routing table
            local = s.getsockname()[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    raw = fcntl.ioctl(
                        s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode())
                    )
                except OSError:
                    continue  # no IPv4 address on it
                if socket.inet_ntoa(raw[20:24]) == local:
                    return name
    except OSError:
        pass
    return None


def choose_gloo_interface(layout: NodeLayout) -> None:
    """Point gloo at the interface that reaches node 0: by default gloo binds the address the
    machine's host name resolves to, which on many hosts (containers, network namespaces) is
    loopback or an address the other nodes cannot reach. ``GLOO_SOCKET_IFNAME`` set by the
    operator wins."""
    if not layout.multi_node or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_towards(layout.host)
    if name is None:
        logger.warning(
            "cannot tell which interface reaches %s; gloo picks its own (set GLOO_SOCKET_IFNAME "
            "if the ranks cannot connect)",
            layout.host,
        )
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    logger.info("gloo uses interface %s (it reaches node 0 at %s)", name, layout.host)


def join_error(layout: NodeLayout, timeout_s: float, error: Exception) -> str:
    """What a failed rendezvous of a multi-host server means, for the start-up error."""
    return (
        f"the {layout.world_size} ranks of {layout.nnodes} nodes did not all join at "
        f"{layout.init_address} within --dist-timeout {timeout_s:g}s: start every node with the "
        f"same --nnodes and --dist-init-addr (node 0 listens on ports {layout.port} and "
        f"{layout.port + OUTPUT_PORT_OFFSET}) within that time ({type(error).__name__}: {error})"
    )


def gather_start_up(world, layout: NodeLayout, status: dict) -> dict:
    """Every rank's start-up outcome, exchanged over ``world`` (a collective: every rank calls it
    once, failed or not). Returns ``status`` when every rank is ready, else an error naming each
    rank that failed, so that every rank, and the front end through rank 0, stops alike."""
    mine = {"ok": status.get("status") == "ready", "message": status.get("message", "")}
    try:
        per = [msgspec.json.decode(b) for b in world.all_gather_bytes(msgspec.json.encode(mine))]
    except Exception as e:  # a rank died while loading, or is slower than --dist-timeout
        return {
            "status": "error",
            "message": f"not every rank of {layout.nnodes} nodes reported its start-up: "
            f"{type(e).__name__}: {e}",
        }
    bad = [
        f"rank {r} on node {layout.node_of(r)}: {s['message']}"
        for r, s in enumerate(per)
        if not s["ok"]
    ]
    if bad:
        return {"status": "error", "message": "failed to start: " + "; ".join(bad)}
    return status
