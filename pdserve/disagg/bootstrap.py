"""Bootstrap server (one per prefill server) and its client.

Each prefill scheduler rank publishes its control endpoint and KV layout with ``PUT /route``
(ranks are keyed by ``(dp_rank, tp_rank, pp_rank)``). Decode looks the instance up with
``GET /route`` (all indices -1: instance info, 503 until every rank of every DP group registered;
with indices: that rank's endpoint) and then talks to the ranks over ZMQ. The server holds
topology only; buffer addresses travel peer to peer in ``Register``. It also keeps which DP
group took each room (``POST /register_dp_rank``, ``POST /query_dp_ranks``, see ``dp_rooms``).

With a shared secret (``--disaggregation-secret``) every request but ``GET /health`` must carry
``X-PDServe-Timestamp`` (unix seconds) and ``X-PDServe-Auth``: hex HMAC-SHA256 of
``"<timestamp>\n" + body``, where a GET's body is its request target (``/route?...``); the server
answers 401 to one without a valid tag or more than ``AUTH_WINDOW_S`` off its clock, and logs it.
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
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from pdserve.disagg.dp_rooms import (
    DEFAULT_ENTRY_TTL_S,
    MAX_QUERY_ROOMS,
    DPRoomTable,
    parse_query,
    parse_registration,
)

logger = logging.getLogger(__name__)

# PUT /route body: every field is required
RANK_FIELDS = {
    "tp_size": int,
    "tp_rank": int,
    "dp_size": int,
    "dp_rank": int,
    "pp_size": int,
    "pp_rank": int,
    "rank_ip": str,
    "rank_port": int,
    "page_size": int,
    "kv_dtype": str,
    "layout": str,
    "model_fingerprint": str,
    "num_layers": int,
    "kv_heads": int,
}
# fields that describe the instance (must agree across ranks); the rest are per rank
INSTANCE_FIELDS = (
    "tp_size",
    "dp_size",
    "pp_size",
    "page_size",
    "kv_dtype",
    "layout",
    "model_fingerprint",
    "num_layers",
    "kv_heads",
)
QUERY_PARAMS = ("prefill_dp_rank", "target_tp_rank", "target_pp_rank")
AUTH_HEADER, TIME_HEADER = "X-PDServe-Auth", "X-PDServe-Timestamp"
AUTH_WINDOW_S = 300.0
MAX_BODY_BYTES = 1 << 20


def registration_tag(secret: bytes, timestamp: str, body: bytes) -> str:
    return hmac.new(secret, timestamp.encode() + b"\n" + body, hashlib.sha256).hexdigest()


def check_registration_auth(secret: Optional[bytes], headers, body: bytes) -> Optional[str]:
    """Why a registration is not authentic, or None when it is (or no secret is set)."""
    if secret is None:
        return None
    tag, ts = headers.get(AUTH_HEADER), headers.get(TIME_HEADER)
    if not tag or not ts:
        return (
            "request is not authenticated (this bootstrap server requires --disaggregation-secret)"
        )
    try:
        skew = abs(time.time() - float(ts))
    except ValueError:
        return f"bad {TIME_HEADER} header {ts!r}"
    if skew > AUTH_WINDOW_S:
        return (
            f"request timestamp is {skew:.0f}s away from this server's clock (limit "
            f"{AUTH_WINDOW_S:.0f}s)"
        )
    if not hmac.compare_digest(registration_tag(secret, ts, body), tag):
        return "request has a bad HMAC (forged, tampered, or a different secret)"
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
                diff = [
                    f"{k}: {self.instance[k]!r} vs {instance[k]!r}"
                    for k in INSTANCE_FIELDS
                    if self.instance[k] != instance[k]
                ]
                return (
                    "rank disagrees with the instance registered so far (" + "; ".join(diff) + ")"
                )
            self.instance = instance
            key = (info["dp_rank"], info["tp_rank"], info["pp_rank"])
            self.ranks[key] = {
                "rank_ip": info["rank_ip"],
                "rank_port": info["rank_port"],
                "dp_rank": key[0],
                "tp_rank": key[1],
                "pp_rank": key[2],  # + a stage's layers:
                **{
                    k: info[k] for k in ("start_layer", "end_layer") if isinstance(info.get(k), int)
                },
            }
        return None

    def total_ranks(self) -> int:
        """Ranks of all DP groups: the registered sizes tell, ``expected_ranks`` bounds from
        below."""
        with self.lock:
            sizes = self.instance or {"dp_size": 1, "tp_size": 1, "pp_size": 1}
            return max(self.expected_ranks, sizes["dp_size"] * sizes["tp_size"] * sizes["pp_size"])

    def complete(self) -> bool:
        total = self.total_ranks()
        with self.lock:
            return self.instance is not None and len(self.ranks) >= total


class _Reject(Exception):
    """``_Reject(status, message)``: an HTTP error answer raised from inside a route."""


class _Handler(BaseHTTPRequestHandler):
    server: "_HTTPServer"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args) -> None:  # route access logs to logging at DEBUG
        logger.debug("bootstrap %s - " + fmt, self.address_string(), *args)

    def _reply(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode() if not isinstance(body, bytes) else body
        self.send_response(code)
        self.send_header(
            "Content-Type", "application/json" if not isinstance(body, bytes) else "text/plain"
        )
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self, authenticate: bool) -> Any:
        """The request's JSON body; ``authenticate``: a registration, checked against the secret."""
        length = self.headers.get("Content-Length", "0")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            self.close_connection = True  # the body is not read
            raise _Reject(400, f"bad Content-Length {length!r} (at most {MAX_BODY_BYTES} bytes)")
        raw = self.rfile.read(int(length))
        why = (
            check_registration_auth(self.server.secret, self.headers, raw) if authenticate else None
        )
        if why:
            logger.warning(
                "bootstrap: rejected %s from %s: %s", self.path, self.address_string(), why
            )
            raise _Reject(401, why)
        try:
            return json.loads(raw or b"null")
        except ValueError as e:
            raise _Reject(400, f"bad JSON body: {e}") from None

    def _serve(self, routes: dict) -> None:
        """Answer with what the route returns; a ``ValueError`` it raises (a bad body, its
        message naming the field) is a 400."""
        path = urllib.parse.urlparse(self.path).path
        if path not in routes:
            self.close_connection = True  # the body is not read
            return self._reply(404, {"error": f"no route {path}"})
        try:
            self._reply(200, routes[path]())
        except _Reject as e:
            self._reply(e.args[0], {"error": e.args[1]})
        except ValueError as e:
            self._reply(400, {"error": str(e)})

    def do_PUT(self) -> None:
        self._serve({"/route": self._put_route})

    def do_POST(self) -> None:
        self._serve(
            {"/register_dp_rank": self._register_dp_rank, "/query_dp_ranks": self._query_dp_ranks}
        )

    def _put_route(self) -> dict:
        info = self._body(authenticate=True)
        if not isinstance(info, dict):
            raise _Reject(400, "body must be a JSON object")
        err = self.server.table.put(info)
        if err:
            raise _Reject(400, err)
        logger.info(
            "bootstrap: registered prefill rank dp%s tp%s pp%s at %s:%s",
            info["dp_rank"],
            info["tp_rank"],
            info["pp_rank"],
            info["rank_ip"],
            info["rank_port"],
        )
        return {"ok": True}

    def _register_dp_rank(self) -> dict:
        body = self._body(authenticate=True)
        instance = (
            self.server.table.instance
        )  # replaced whole on registration, never changed in place
        room, dp_rank = parse_registration(body, instance["dp_size"] if instance else None)
        self.server.rooms.put(room, dp_rank)
        logger.debug("bootstrap: room %d -> dp rank %d", room, dp_rank)
        return {"ok": True}

    def _query_dp_ranks(self) -> dict:
        rooms = parse_query(self._body(authenticate=True))
        return {str(room): rank for room, rank in self.server.rooms.get_many(rooms).items()}

    def do_GET(self) -> None:
        url = urllib.parse.urlparse(self.path)
        if url.path == "/health":
            return self._reply(200, b"OK")
        if url.path != "/route":
            return self._reply(404, {"error": f"no route {url.path}"})
        if why := check_registration_auth(self.server.secret, self.headers, self.path.encode()):
            logger.warning(
                "bootstrap: rejected GET %s from %s: %s", url.path, self.address_string(), why
            )
            return self._reply(401, {"error": why})
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
                registered = len(
                    table.ranks
                )  # one atomic read; a snapshot is all an error message needs
                return self._reply(
                    503,
                    {"error": f"{registered} of {table.total_ranks()} prefill ranks registered"},
                )
            with table.lock:
                return self._reply(200, dict(table.instance))
        if any(i < 0 for i in idx):
            return self._reply(400, {"error": "indices must be all -1 (instance info) or all >= 0"})
        with table.lock:
            rank = table.ranks.get(tuple(idx))
        if rank is None:
            return self._reply(
                404, {"error": "no prefill rank dp%d tp%d pp%d registered" % tuple(idx)}
            )
        self._reply(200, rank)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    table: _RouteTable
    rooms: DPRoomTable
    secret: Optional[bytes] = None


class BootstrapServer:
    """HTTP registry of one prefill instance's ranks, served from a daemon thread.

    ``expected_ranks``: ranks of all DP groups together (dp_size * tp_size * pp_size); instance
    info is served once that many registered (or more, when the registered sizes say so).
    ``entry_ttl_s``: how long a room's DP rank registration is kept."""

    def __init__(
        self,
        host: str,
        port: int,
        expected_ranks: int = 1,
        secret: Optional[str] = None,
        entry_ttl_s: float = DEFAULT_ENTRY_TTL_S,
    ):
        if expected_ranks < 1:
            raise ValueError(f"expected_ranks: must be >= 1, got {expected_ranks}")
        rooms = DPRoomTable(entry_ttl_s)  # checks entry_ttl_s before the port is taken
        self._httpd = _HTTPServer((host, port), _Handler)
        self._httpd.table, self._httpd.rooms = _RouteTable(expected_ranks), rooms
        self._httpd.secret = secret.encode() if secret else None
        self.host = host
        self.port = self._httpd.server_address[1]  # port 0 picks a free one
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="pd-bootstrap",
            daemon=True,
        )
        self._thread.start()
        logger.info(
            "bootstrap server on %s:%d (expecting %d prefill ranks)",
            host,
            self.port,
            expected_ranks,
        )

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


def _http(
    method: str,
    url: str,
    body: Optional[dict] = None,
    timeout: float = 5.0,
    secret: Optional[str] = None,
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data else {}
    if secret:  # a GET signs its request target in place of a body
        ts, target = f"{time.time():.3f}", url[url.index("/", url.index("//") + 2) :].encode()
        headers.update(
            {TIME_HEADER: ts, AUTH_HEADER: registration_tag(secret.encode(), ts, data or target)}
        )
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with _opener.open(req, timeout=timeout) as resp:
            raw, code = resp.read(), resp.status
    except urllib.error.HTTPError as e:
        raw, code = e.read(), e.code
    try:
        return code, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return code, raw.decode(errors="replace")


def register_rank(
    host: str,
    port: int,
    info: dict[str, Any],
    attempts: int = 30,
    backoff: float = 0.1,
    max_backoff: float = 2.0,
    timeout: float = 5.0,
    secret: Optional[str] = None,
) -> None:
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
            raise BootstrapError(
                f"bootstrap server {host}:{port} rejected rank registration: {body}"
            )
        last = f"HTTP {code}: {body}" if code else body
        if attempt + 1 < attempts:
            time.sleep(delay)
            delay = min(delay * 2, max_backoff)
    raise BootstrapError(
        f"could not register with bootstrap server {host}:{port} after {attempts} attempts: {last}"
    )


def _get_route(
    host: str, port: int, dp: int, tp: int, pp: int, timeout: float, secret: Optional[str]
) -> dict:
    q = urllib.parse.urlencode({"prefill_dp_rank": dp, "target_tp_rank": tp, "target_pp_rank": pp})
    try:
        code, body = _http("GET", _url(host, port, f"/route?{q}"), timeout=timeout, secret=secret)
    except OSError as e:
        raise BootstrapNotReady(f"bootstrap server {host}:{port} unreachable: {e}") from None
    if code == 503:
        raise BootstrapNotReady(f"bootstrap server {host}:{port} not ready: {body}")
    if code != 200:
        raise BootstrapError(f"bootstrap server {host}:{port} answered HTTP {code}: {body}")
    return body


def fetch_prefill_info(
    host: str, port: int, timeout: float = 5.0, secret: Optional[str] = None
) -> dict[str, Any]:
    """Instance info (sizes, layout, compatibility fields), signed when ``secret`` is given. Raises
    ``BootstrapNotReady`` while the server is unreachable or incomplete, ``BootstrapError``
    otherwise."""
    return _get_route(host, port, -1, -1, -1, timeout, secret)


def fetch_rank_info(
    host: str,
    port: int,
    dp_rank: int,
    tp_rank: int,
    pp_rank: int,
    timeout: float = 5.0,
    secret: Optional[str] = None,
) -> dict[str, Any]:
    """``{rank_ip, rank_port, dp_rank, tp_rank, pp_rank}`` of one prefill rank."""
    return _get_route(host, port, dp_rank, tp_rank, pp_rank, timeout, secret)


def register_dp_rank(
    host: str,
    port: int,
    room: int,
    dp_rank: int,
    secret: Optional[str] = None,
    timeout: float = 5.0,
) -> None:
    """Record that DP group ``dp_rank`` of this prefill instance took ``room`` (signed when
    ``secret`` is given). One attempt; raises ``BootstrapError`` saying why it failed."""
    try:
        code, answer = _http(
            "POST",
            _url(host, port, "/register_dp_rank"),
            {"bootstrap_room": room, "dp_rank": dp_rank},
            timeout,
            secret,
        )
    except OSError as e:
        code, answer = None, f"unreachable: {e}"
    if code != 200:
        raise BootstrapError(
            f"bootstrap server {host}:{port} did not register room {room} -> dp rank {dp_rank}: "
            f"{f'HTTP {code}: ' if code else ''}{answer}"
        )


def query_dp_ranks(
    host: str, port: int, rooms: Iterable[int], timeout: float = 5.0, secret: Optional[str] = None
) -> dict[int, int]:
    """The prefill DP rank of each of ``rooms`` that the bootstrap server knows (unknown and expired
    rooms left out). Raises ``BootstrapNotReady`` while it is unreachable, else
    ``BootstrapError``."""
    rooms, found = list(rooms), {}
    for start in range(0, len(rooms), MAX_QUERY_ROOMS):
        batch = rooms[start : start + MAX_QUERY_ROOMS]
        try:
            code, body = _http(
                "POST",
                _url(host, port, "/query_dp_ranks"),
                {"bootstrap_rooms": batch},
                timeout,
                secret,
            )
        except OSError as e:
            raise BootstrapNotReady(f"bootstrap server {host}:{port} unreachable: {e}") from None
        if code != 200 or not isinstance(body, dict):
            raise BootstrapError(
                f"bootstrap server {host}:{port} answered /query_dp_ranks with HTTP {code}: {body}"
            )
        found.update({int(room): rank for room, rank in body.items()})
    return found


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
