"""A late write after a cut link never lands in reused pages (Mooncake over TCP, NIXL over UCX/TCP).

Prefill's side of the backend runs in host A, decode's in B (``tests/helpers/kv_window_peer.py``,
the real backends, decode's pool in the backend's own allocator with a window for the session).
A's egress is rate-limited so that a 1 MiB write is still under way when A's cable is cut: its
bytes wait in A's TCP send buffer. Decode then does what it does when it declares the prefill
dead (fences the session's window), another request takes the pages (the pool is filled with
that request's pattern and digested), and A's cable comes back: TCP delivers the queued bytes.
The pool must still hold exactly the other request's bytes. The same run without the fence shows
what the fence prevents: the queued bytes of the failed write land in the other request's pages.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.helpers import netns as nx

NBYTES = 1 << 20
RATE = "2mbit"  # 1 MiB takes about 4 s


class Peer:
    def __init__(self, hosts, host: str, role: str, backend: str):
        env = nx.UCX_ENV if backend == "nixl" else {}
        cmd = [
            "env",
            *(f"{k}={v}" for k, v in env.items()),
            sys.executable,
            "-m",
            "tests.helpers.kv_window_peer",
            role,
            backend,
            hosts.addr(host),
            str(NBYTES),
        ]
        self.p = subprocess.Popen(
            hosts.wrap(host, cmd),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def line(self) -> dict:
        while True:  # the libraries log to stdout too
            out = self.p.stdout.readline()
            if not out:
                raise AssertionError(f"peer exited ({self.p.poll()})")
            if out.startswith("{"):
                return json.loads(out)

    def ask(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self.line()

    def close(self) -> None:
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
            self.p.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "unfenced"])
def test_no_late_write_into_reused_pages(netns_hosts, backend, fenced):
    from pdserve.disagg.transfer import get_backend

    try:
        get_backend(backend)
    except ValueError as e:
        pytest.skip(str(e))
    h = netns_hosts
    D = Peer(h, "B", "decode", backend)
    P = Peer(h, "A", "prefill", backend)
    try:
        first = D.line()
        P.p.stdin.write(json.dumps(first) + "\n")
        P.p.stdin.flush()
        h.rate_limit("A", RATE)
        assert P.ask("write")["started"]
        time.sleep(1.0)  # about a quarter has landed, the rest is queued behind the rate limit
        h.cut("A")
        time.sleep(0.5)
        if fenced:
            assert D.ask("fence")["fenced"]
        other = D.ask("reuse")["digest"]
        time.sleep(1.0)
        h.clear_qdisc("A")
        h.restore("A")
        t0 = time.monotonic()
        done = P.ask("wait")
        took = time.monotonic() - t0
        assert done["done"], "the write neither finished nor failed within 120 s"
        after = D.ask("check")
        print(
            f"MEASURED {backend} fenced={fenced}: write error {done['error']!r}; writer bytes in "
            f"the pool {after['writer_bytes_in_pool']}, in the fenced window "
            f"{after['writer_bytes_in_window']}; the write ended {took:.1f}s after the restore"
        )
        if fenced:
            assert after["digest"] == other and after["writer_bytes_in_pool"] == 0
            # not vacuous: bytes of the failed write did arrive after the fence (they landed in the
            # window's scratch memory), or the receiver refused their headers (the write failed)
            assert after["writer_bytes_in_window"] > 0 or done["error"]
        else:  # the hazard the fence closes: the queued bytes overwrite the other request's pages
            assert after["digest"] != other and after["writer_bytes_in_pool"] > 0
    finally:
        h.restore("A")
        h.clear_qdisc("A")
        P.close()
        D.close()
