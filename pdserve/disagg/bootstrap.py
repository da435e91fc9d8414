"""Bootstrap server (one per prefill server) and its client.

Each prefill scheduler rank publishes its control endpoint and KV layout with ``PUT /route``.
Decode looks the instance up with ``GET /route`` (all indices -1: instance info, 503 until every
rank registered; with indices: that rank's endpoint) and then talks to the ranks over ZMQ.
The server holds topology only; buffer addresses travel peer to peer in ``Register``.

With a shared secret (``--disaggregation-secret``) a registration must carry
``X-PDServe-Timestamp`` (unix seconds) and ``X-PDServe-Auth`` (hex HMAC-SHA256 of
``"<timestamp>\n" + body``); the server answers 401 to one without a valid tag or with a
timestamp more than ``AUTH_WINDOW_S`` away from its clock, and logs it. Look-ups (GET) stay
open: they reveal endpoints, and every message sent to those endpoints is authenticated.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

logger = logging.getLogger(__name__)

# PUT /route body: every field is required
RANK_FIELDS = {
    "tp_size": int, "tp_rank": int, "dp_size": int, "dp_rank": int, "pp_size": int, "pp_rank": int,
    "rank_ip": str, "rank_port": int, "page_size": int, "kv_dtype": str, "layout": str,
    "model_fingerprint": str, "num_layers": int, "kv_heads": int, "head_dim": int,
}
# fields that describe the instance (must agree across ranks); the rest are per rank
INSTANCE_FIELDS = ("tp_size", "dp_size", "pp_size", "page_size", "kv_dtype", "layout",
                   "model_fingerprint", "num_layers", "kv_heads", "head_dim")
QUERY_PARAMS = ("prefill_dp_rank", "target_tp_rank", "target_pp_rank")
AUTH_HEADER, TIME_HEADER = "X-PDServe-Auth", "X-PDServe-Timestamp"
AUTH_WINDOW_S = 300.0


def registration_tag(secret: bytes, timestamp: str, body: bytes) -> str:
    return hmac.new(secret, timestamp.encode() + b"\n" + body, hashlib.sha256).hexdigest()


def check_registration_auth(secret: Optional[bytes], headers, body: bytes) -> Optional[str]:
    """Why a registration is not authentic, or None when it is (or no secret is set)."""
    if secret is None:
        return None
    tag, ts = headers.get(AUTH_HEADER), headers.get(TIME_HEADER)
    if not tag or not ts:
        return "registration is not authenticated (this bootstrap server requires --disaggregation-secret)"
    try:
        skew = abs(time.time() - float(ts))
    except ValueError:
        return f"bad {TIME_HEADER} header {ts!r}"
    if skew > AUTH_WINDOW_S:
        return f"registration timestamp is {skew:.0f}s away from this server's clock (limit {AUTH_WINDOW_S:.0f}s)"
    if not hmac.compare_digest(registration_tag(secret, ts, body), tag):
        return "registration has a bad HMAC (forged, tampered, or a different secret)"
    return None


class BootstrapError(RuntimeError):
    pass


class BootstrapNotReady(BootstrapError):
    """The instance has not registered all its ranks yet (HTTP 503)."""


class _RouteTable:
    def __init__(self, expected_ranks: int):
        self.expected_ranks = expected_ranks
        self.lock = threading.Lock()
        self.instance: Optional[dict[str, Any]] = None
        self.ranks: dict[tuple[int, int, int], dict[str, Any]] = {}  # (dp, tp, pp) -> rank info

    def put(self, info: dict[str, Any]) -> Optional[str]:
        """Store a rank; returns an error message for a bad body."""
        for name, kind in RANK_FIELDS.items():
            if name not in info:
                return f"missing field {name!r}"
            if not isinstance(info[name], kind) or isinstance(info[name], bool):
                return f"field {name!r} must be {kind.__name__}, got {info[name]!r}"
        sizes = {"tp": info["tp_size"], "dp": info["dp_size"], "pp": info["pp_size"]}
        for p, size in sizes.items():
            if not 0 <= info[f"{p}_rank"] < size:
                return f"{p}_rank {info[f'{p}_rank']} out of range for {p}_size {size}"
        instance = {k: info[k] for k in INSTANCE_FIELDS}
        with self.lock:
            if self.instance is not None and self.instance != instance:
                diff = [f"{k}: {self.instance[k]!r} vs {instance[k]!r}" for k in INSTANCE_FIELDS
                        if self.instance[k] != instance[k]]
                return "rank disagrees with the instance registered so far (" + "; ".join(diff) + ")"
            self.instance = instance
            key = (info["dp_rank"], info["tp_rank"], info["pp_rank"])
            self.ranks[key] = {"rank_ip": info["rank_ip"], "rank_port": info["rank_port"],
                               "dp_rank": key[0], "tp_rank": key[1], "pp_rank": key[2]}
        return None

    def complete(self) -> bool:
        with self.lock:
            return self.instance is not None and len(self.ranks) >= self.expected_ranks


class _Handler(BaseHTTPRequestHandler):
    server: "_HTTPServer"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args) -> None:  # route access logs to logging at DEBUG
        logger.debug("bootstrap %s - " + fmt, self.address_string(), *args)

    def _reply(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode() if not isinstance(body, bytes) else body
        self.send_response(code)
        self.send_header("Content-Type", "application/json" if not isinstance(body, bytes) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        url = urllib.parse.urlparse(self.path)
        if url.path != "/route":
            return self._reply(404, {"error": f"no route {url.path}"})
        try:
            length = int(self.headers.get("Content-Length", "0"))
            raw = self.rfile.read(length)
        except ValueError as e:
            return self._reply(400, {"error": f"bad Content-Length: {e}"})
        why = check_registration_auth(self.server.secret, self.headers, raw)
        if why:
            logger.warning("bootstrap: rejected registration from %s: %s", self.address_string(), why)
            return self._reply(401, {"error": why})
        try:
            info = json.loads(raw or b"null")
        except (ValueError, json.JSONDecodeError) as e:
            return self._reply(400, {"error": f"bad JSON body: {e}"})
        if not isinstance(info, dict):
            return self._reply(400, {"error": "body must be a JSON object"})
        err = self.server.table.put(info)
        if err:
            return self._reply(400, {"error": err})
        logger.info("bootstrap: registered prefill rank dp%s tp%s pp%s at %s:%s", info["dp_rank"],
                    info["tp_rank"], info["pp_rank"], info["rank_ip"], info["rank_port"])
        self._reply(200, {"ok": True})

    def do_GET(self) -> None:
        url = urllib.parse.urlparse(self.path)
        if url.path == "/health":
            return self._reply(200, b"OK")
        if url.path != "/route":
            return self._reply(404, {"error": f"no route {url.path}"})
        query = urllib.parse.parse_qs(url.query)
        idx = []
        for name in QUERY_PARAMS:
            vals = query.get(name)
            if not vals:
                return self._reply(400, {"error": f"missing query parameter {name}"})
            try:
                idx.append(int(vals[0]))
            except ValueError:
                return self._reply(400, {"error": f"{name} must be an integer, got {vals[0]!r}"})
        table = self.server.table
        if all(i == -1 for i in idx):
            if not table.complete():
                with table.lock:
                    n = len(table.ranks)
                return self._reply(503, {"error": f"{n} of {table.expected_ranks} prefill ranks registered"})
            with table.lock:
                return self._reply(200, dict(table.instance))
        if any(i < 0 for i in idx):
            return self._reply(400, {"error": "indices must be all -1 (instance info) or all >= 0"})
        with table.lock:
            rank = table.ranks.get(tuple(idx))
        if rank is None:
            return self._reply(404, {"error": "no prefill rank dp%d tp%d pp%d registered" % tuple(idx)})
        self._reply(200, rank)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    table: _RouteTable
    secret: Optional[bytes] = None


class BootstrapServer:
    """HTTP registry of one prefill instance's ranks, served from a daemon thread."""

    def __init__(self, host: str, port: int, expected_ranks: int = 1, secret: Optional[str] = None):
        if expected_ranks < 1:
            raise ValueError(f"expected_ranks: must be >= 1, got {expected_ranks}")
        self._httpd = _HTTPServer((host, port), _Handler)
        self._httpd.table = _RouteTable(expected_ranks)
        self._httpd.secret = secret.encode() if secret else None
        self.host = host
        self.port = self._httpd.server_address[1]  # port 0 picks a free one
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="pd-bootstrap", daemon=True)
        self._thread.start()
        logger.info("bootstrap server on %s:%d (expecting %d prefill ranks)", host, self.port, expected_ranks)

    @property
    def num_registered(self) -> int:
        with self._httpd.table.lock:
            return len(self._httpd.table.ranks)

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


# ---- client ------------------------------------------------------------------------------


def _url(host: str, port: int, path: str) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"http://{host}:{port}{path}"


_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP proxy


def _http(method: str, url: str, body: Optional[dict] = None, timeout: float = 5.0,
          secret: Optional[str] = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data else {}
    if secret and data is not None:
        ts = f"{time.time():.3f}"
        headers.update({TIME_HEADER: ts, AUTH_HEADER: registration_tag(secret.encode(), ts, data)})
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with _opener.open(req, timeout=timeout) as resp:
            raw = resp.read()
            code = resp.status
    except urllib.error.HTTPError as e:
        raw, code = e.read(), e.code
    try:
        return code, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return code, raw.decode(errors="replace")


def register_rank(host: str, port: int, info: dict[str, Any], attempts: int = 30,
                  backoff: float = 0.1, max_backoff: float = 2.0, timeout: float = 5.0,
                  secret: Optional[str] = None) -> None:
    """PUT this rank's info (signed when ``secret`` is given), retrying with exponential backoff
    while the server is not up. A 4xx answer (bad body, failed authentication) is not retried."""
    url = _url(host, port, "/route")
    delay, last = backoff, ""
    for attempt in range(attempts):
        try:
            code, body = _http("PUT", url, info, timeout, secret)
        except OSError as e:
            code, body = None, str(e)
        if code == 200:
            return
        if code is not None and 400 <= code < 500:
            raise BootstrapError(f"bootstrap server {host}:{port} rejected rank registration: {body}")
        last = f"HTTP {code}: {body}" if code else body
        if attempt + 1 < attempts:
            time.sleep(delay)
            delay = min(delay * 2, max_backoff)
    raise BootstrapError(f"could not register with bootstrap server {host}:{port} after {attempts} attempts: {last}")


def _get_route(host: str, port: int, dp: int, tp: int, pp: int, timeout: float) -> dict[str, Any]:
    q = urllib.parse.urlencode({"prefill_dp_rank": dp, "target_tp_rank": tp, "target_pp_rank": pp})
    try:
        code, body = _http("GET", _url(host, port, f"/route?{q}"), timeout=timeout)
    except OSError as e:
        raise BootstrapNotReady(f"bootstrap server {host}:{port} unreachable: {e}") from None
    if code == 503:
        raise BootstrapNotReady(f"bootstrap server {host}:{port} not ready: {body}")
    if code != 200:
        raise BootstrapError(f"bootstrap server {host}:{port} answered HTTP {code}: {body}")
    return body


def fetch_prefill_info(host: str, port: int, timeout: float = 5.0) -> dict[str, Any]:
    """Instance info (sizes, layout, compatibility fields). Raises ``BootstrapNotReady`` while
    the server is unreachable or incomplete, ``BootstrapError`` otherwise."""
    return _get_route(host, port, -1, -1, -1, timeout)


def fetch_rank_info(host: str, port: int, dp_rank: int, tp_rank: int, pp_rank: int,
                    timeout: float = 5.0) -> dict[str, Any]:
    """``{rank_ip, rank_port, dp_rank, tp_rank, pp_rank}`` of one prefill rank."""
    return _get_route(host, port, dp_rank, tp_rank, pp_rank, timeout)


def health(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        code, _ = _http("GET", _url(host, port, "/health"), timeout=timeout)
    except OSError:
        return False
    return code == 200


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``"[::1]:8998"``) -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bootstrap address must be HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)
