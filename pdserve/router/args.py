"""Router arguments: one validated dataclass and its argparse wiring.

Flag names follow the sglang router where the concept is the same (``--prefill URL [PORT]``,
``--decode URL``, ``--policy``, ``--request-timeout-secs`` as an alias, ...), so a command line
written for it mostly works here.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

from pdserve import envs

DEFAULT_BOOTSTRAP_PORT = 8998
POLICIES = ("random", "round_robin", "least_load", "cache_aware")
PD_POLICIES = ("always", "conditional")


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018  (raises ValueError for a port that is no number or out of range)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or " " in url:
        raise ValueError(f"invalid worker URL {url!r}: expected http(s)://HOST:PORT")
    return url


def tenant_weights(items: list[str]) -> dict[str, float]:
    """``--tenant-weights A=3 B=1`` as {"A": 3.0, "B": 1.0}; ValueError naming a bad item."""
    out = {}
    for item in items:
        tenant, sep, weight = item.rpartition("=")
        try:
            out[tenant] = float(weight)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--tenant-weights: expected TENANT=WEIGHT, got {item!r}")
    return out


def dns_server_address(text: str) -> tuple[str, int]:
    """(host, port) of ``--dns-server HOST[:PORT]`` (an IPv6 address in brackets when it has a
    port)."""
    host, port = text, "53"
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else (rest or "53")
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dns_server: expected HOST[:PORT], got {text!r}")
    return host, int(port)


@dataclass
class RouterArgs:
    prefill: list[tuple[str, int | None]] = field(default_factory=list)  # (url, bootstrap port)
    decode: list[str] = field(default_factory=list)
    worker: list[str] = field(default_factory=list)  # colocated workers (no PD)
    # EPD: encoder servers (tcp://host:port, their --disaggregation-bootstrap-port) that compute
    # the image embeddings of requests sent to prefill (or colocated) servers
    encoder: list[str] = field(default_factory=list)
    pd_disaggregation: bool = (
        False  # PD mode even with no --prefill/--decode (workers join at run time)
    )
    # discovery through DNS (router/discovery.py): (name, port, bootstrap port) and (name, port)
    prefill_dns: list[tuple[str, int, int | None]] = field(default_factory=list)
    decode_dns: list[tuple[str, int]] = field(default_factory=list)
    dns_interval: float = 5.0
    dns_server: str | None = None  # HOST[:PORT]; None: the system resolver
    add_worker_timeout: float = (
        10.0  # how long a new worker may take to answer /health and /server_info
    )
    drain_timeout: float = 300.0  # a removed worker's running requests get this long to finish
    drain_migrate: bool = False  # a drained decode moves its running requests to other decodes
    # switching servers between prefill and decode when the queues show the split is off
    # (router/autoscale.py)
    autoscale: bool = False
    autoscale_interval: float = 2.0  # seconds between queue samples
    autoscale_window: float = 30.0  # a backlog must last this long
    autoscale_cooldown: float = 60.0  # after a switch, before the next may start
    autoscale_queue: float = 2.0  # requests waiting per server that count as a backlog
    autoscale_min_prefill: int = 1
    autoscale_min_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = (
        1  # router processes on one port (SO_REUSEPORT), sharing nothing (router/processes.py)
    )
    policy: str = "round_robin"
    prefill_policy: str | None = None
    decode_policy: str | None = None
    dp_aware: bool = False  # choose each worker's data-parallel group (routed_dp_rank) here
    cache_aware_balance: float = (
        1.0  # cache_aware: weight of a worker's load against its cached prefix
    )
    # cache_aware: what a prompt token held in a tier below a worker's pool (KV events medium
    # CPU / STORAGE) spares it, against 1 for one in the pool and 0 for one it must compute
    cache_aware_host_weight: float = 0.8
    cache_aware_storage_weight: float = 0.5
    tokenizer_path: str | None = (
        None  # for matching text prompts (default: the workers' model path)
    )
    pd_policy: str = "always"  # where PD requests prefill (router/pd_policy.py)
    pd_local_max_tokens: int = 512
    pd_itl_weight: float = (
        1.0  # 1: a second of stall on each running stream weighs as much as a second of TTFT
    )
    pd_kv_bandwidth: float = 1e9  # bytes/s, until a prefill reports its measured rate
    pd_overhead_s: float = 0.005
    pd_prefill_fixed_s: float | None = None  # override the servers' calibration
    pd_prefill_s_per_token: float | None = None
    health_check_interval: float = 5.0
    health_check_timeout: float = 5.0
    health_failure_threshold: int = 2
    load_poll_interval: float = 1.0
    request_timeout: float = 1800.0
    max_retries: int = 1
    # the wait before retry n (n = 1, 2, ...): initial * multiplier**(n-1), at most max_backoff,
    # times a random factor in [1 - jitter, 1 + jitter]
    retry_initial_backoff_ms: float = 50.0
    retry_max_backoff_ms: float = 30000.0
    retry_backoff_multiplier: float = 1.5
    retry_jitter_factor: float = 0.2
    cb_failure_threshold: int = 5
    cb_cooldown: float = 30.0
    # admission (router/admission.py, sglang-router's flags): tokens of the bucket (<= 0: off),
    # their refill rate (None: the capacity per second), the queue behind it and its longest wait
    max_concurrent_requests: int = -1
    rate_limit_tokens_per_second: float | None = None
    queue_size: int = 100
    queue_timeout_secs: float = 60.0
    # responses of /v1/responses kept for previous_response_id (router/responses.py; 0: none)
    responses_store_size: int = 10_000
    # OpenTelemetry: a span per request to this OTLP/HTTP collector (pdserve/tracing.py)
    otlp_traces_endpoint: str | None = None
    # tenants share the admission queue by weight: the header naming a request's tenant, weights
    tenant_header: str = "x-gateway-inference-fairness-id"
    tenant_weights: dict[str, float] = field(default_factory=dict)
    # refuse (429) a request whose estimated time to first token exceeds this (a request's
    # ``x-slo-ttft-ms`` header sets its own); None: no estimate
    ttft_slo_ms: float | None = None
    # the queue's order by a request's ``priority``: smaller first (larger by default)
    schedule_low_priority_values_first: bool = False
    max_body_bytes: int = 32 * 1024 * 1024
    log_level: str = "info"
    api_key: str | None = None  # clients of the router present it (see pdserve/api_key.py)
    worker_api_key: str | None = None  # the router presents it to the workers (default: api_key)

    def __post_init__(self):
        self.prefill = [(normalize_url(u), p) for u, p in self.prefill]
        self.decode = [normalize_url(u) for u in self.decode]
        self.worker = [normalize_url(u) for u in self.worker]
        for addr in self.encoder:
            host, _, port = addr.removeprefix("tcp://").rpartition(":")
            if not addr.startswith("tcp://") or not host or not port.isdigit():
                raise ValueError(f"encoder: {addr!r} is not tcp://HOST:PORT")
        pd = self.pd_mode
        elastic = self.pd_disaggregation or bool(self.prefill_dns or self.decode_dns)
        if pd and self.worker:
            raise ValueError("worker: --worker (colocated) cannot be mixed with --prefill/--decode")
        if pd and not elastic and not (self.prefill and self.decode):
            raise ValueError(
                "prefill/decode: PD mode needs at least one --prefill and one --decode (or "
                "--pd-disaggregation, to add workers at run time)"
            )
        if not pd and not self.worker:
            raise ValueError(
                "prefill/decode: give --prefill URL [BOOTSTRAP_PORT] and --decode URL, or --worker "
                "URL (or --pd-disaggregation, to add workers at run time)"
            )
        for name, port, *bootstrap in self.prefill_dns + self.decode_dns:
            if not name or any(p is not None and not 0 < p < 65536 for p in (port, *bootstrap)):
                raise ValueError(
                    f"prefill_dns/decode_dns: bad entry {name!r}:{port}: expected NAME:PORT with a "
                    "port in 1-65535"
                )
        urls = [u for u, _ in self.prefill] + self.decode + self.worker
        if len(set(urls)) != len(urls):
            raise ValueError("worker URLs: each worker may be given only once")
        for _, port in self.prefill:
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"prefill: bootstrap port {port} out of range")
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = getattr(self, name)
            if value is not None and value not in POLICIES:
                raise ValueError(
                    f"{name}: unknown policy {value!r}, choose from {', '.join(POLICIES)}"
                )
        if self.pd_policy not in PD_POLICIES:
            raise ValueError(
                f"pd_policy: unknown {self.pd_policy!r}, choose from {', '.join(PD_POLICIES)}"
            )
        if self.pd_policy == "conditional" and not pd:
            raise ValueError("pd_policy: conditional needs PD mode (--prefill and --decode)")
        for name in (
            "health_check_interval",
            "health_check_timeout",
            "load_poll_interval",
            "request_timeout",
            "max_body_bytes",
            "pd_kv_bandwidth",
            "dns_interval",
            "add_worker_timeout",
            "drain_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
        for tenant, weight in self.tenant_weights.items():
            if not weight > 0:
                raise ValueError(f"tenant_weights: {tenant!r} must weigh > 0, got {weight}")
        if self.ttft_slo_ms is not None and not self.ttft_slo_ms > 0:
            raise ValueError(f"ttft_slo_ms: must be positive, got {self.ttft_slo_ms}")
        if self.otlp_traces_endpoint:
            from pdserve.tracing import check_installed

            check_installed()
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size: must be >= 0, got {self.responses_store_size}")
        if self.queue_size < 0:
            raise ValueError(f"queue_size: must be >= 0, got {self.queue_size}")
        if self.queue_timeout_secs <= 0:
            raise ValueError(f"queue_timeout_secs: must be positive, got {self.queue_timeout_secs}")
        if self.rate_limit_tokens_per_second is not None and self.rate_limit_tokens_per_second < 0:
            raise ValueError(
                "rate_limit_tokens_per_second: must be >= 0, got "
                f"{self.rate_limit_tokens_per_second}"
            )
        if not 0 <= self.retry_jitter_factor <= 1:
            raise ValueError(
                f"retry_jitter_factor: must be in [0, 1], got {self.retry_jitter_factor}"
            )
        if self.retry_backoff_multiplier < 1:
            raise ValueError(
                f"retry_backoff_multiplier: must be >= 1, got {self.retry_backoff_multiplier}"
            )
        for name in (
            "max_retries",
            "retry_initial_backoff_ms",
            "retry_max_backoff_ms",
            "cb_failure_threshold",
            "health_failure_threshold",
            "cb_cooldown",
            "cache_aware_balance",
            "pd_local_max_tokens",
            "pd_itl_weight",
            "pd_overhead_s",
            "pd_prefill_fixed_s",
            "pd_prefill_s_per_token",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name}: must not be negative")

        for name in ("cache_aware_host_weight", "cache_aware_storage_weight"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}: must be in [0, 1], got {getattr(self, name)}")
        if self.workers < 1:
            raise ValueError("workers: must be at least 1")
        for name in ("autoscale_interval", "autoscale_window", "autoscale_queue"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
        if self.autoscale_cooldown < 0:
            raise ValueError("autoscale_cooldown: must not be negative")
        for name in ("autoscale_min_prefill", "autoscale_min_decode"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1 (a PD cluster needs both roles)")
        if self.autoscale:
            if not pd:
                raise ValueError(
                    "autoscale: switches servers between prefill and decode, so it needs PD mode "
                    "(--prefill/--decode or --pd-disaggregation)"
                )
            if self.workers > 1:
                raise ValueError(
                    "autoscale: router processes share nothing, so each would switch servers on "
                    "its own; run the autoscaling router with --workers 1"
                )
            if self.prefill_dns or self.decode_dns:
                raise ValueError(
                    "autoscale: with --prefill-dns/--decode-dns the DNS name decides each server's "
                    "role; scale those through the orchestrator (kubectl scale)"
                )
        if self.dns_server is not None:
            dns_server_address(self.dns_server)
        for name in ("api_key", "worker_api_key"):
            if getattr(self, name) == "":
                raise ValueError(f"{name}: must not be empty (leave it unset for no key)")
        if self.worker_api_key is None:
            self.worker_api_key = self.api_key

    @property
    def pd_mode(self) -> bool:
        return bool(
            self.prefill
            or self.decode
            or self.prefill_dns
            or self.decode_dns
            or self.pd_disaggregation
        )

    @property
    def policies(self) -> set[str]:
        return {p for p in (self.policy, self.prefill_policy, self.decode_policy) if p}

    @property
    def follows_kv_events(self) -> bool:
        """The router keeps the workers' KV indices (router/kv_index.py)."""
        return "cache_aware" in self.policies or self.pd_policy == "conditional"

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("api_key", "worker_api_key"):
            if out[name]:
                out[name] = "***"
        return out


def _bootstrap_port(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"prefill: bootstrap port must be an integer or 'none', got {text!r}"
        ) from None


def _dns_target(text: str, with_bootstrap: bool) -> tuple:
    """``NAME:PORT`` (decode) or ``NAME:PORT[:BOOTSTRAP_PORT]`` (prefill; default bootstrap port:
    what each server's /server_info reports)."""
    name, form = (
        ("prefill_dns", "NAME:PORT[:BOOTSTRAP_PORT]")
        if with_bootstrap
        else ("decode_dns", "NAME:PORT")
    )
    parts = text.split(":")
    if len(parts) not in ((2, 3) if with_bootstrap else (2,)) or not parts[0]:
        raise ValueError(f"{name}: expected {form}, got {text!r}")
    try:
        ports = [int(p) for p in parts[1:]]
    except ValueError:
        raise ValueError(f"{name}: ports must be integers, got {text!r}") from None
    return (
        (parts[0], ports[0], ports[1] if len(ports) > 1 else None)
        if with_bootstrap
        else (parts[0], ports[0])
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve router",
        description="PD router: sends each request to a "
        "prefill and a decode server and returns decode's answer.",
    )
    p.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        default=[],
        metavar=("URL", "BOOTSTRAP_PORT"),
        help=f"prefill server URL and optional bootstrap port (default {DEFAULT_BOOTSTRAP_PORT}, "
        "'none' sends null); repeatable",
    )
    p.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="decode server URL; repeatable"
    )
    p.add_argument(
        "--encoder",
        action="append",
        default=[],
        metavar="ADDR",
        help="encoder server tcp://HOST:PORT (its --disaggregation-bootstrap-port); repeatable: "
        "a request's images go to them in turn (EPD)",
    )
    p.add_argument(
        "--worker",
        "--worker-urls",
        action="append",
        default=[],
        metavar="URL",
        help="colocated server URL (plain proxying, no PD fields); repeatable",
    )
    p.add_argument(
        "--pd-disaggregation",
        action="store_true",
        help="PD mode (also implied by --prefill/--decode); alone, the router starts with no "
        "worker and they join through POST /workers or DNS",
    )
    p.add_argument(
        "--prefill-dns",
        action="append",
        default=[],
        metavar="NAME:PORT[:BOOTSTRAP_PORT]",
        help="prefill servers are the addresses NAME resolves to (e.g. a Kubernetes headless "
        "Service), on PORT; re-resolved every --dns-interval: new addresses are added, gone ones "
        "drained. Bootstrap port default: what each server reports. Repeatable",
    )
    p.add_argument(
        "--decode-dns",
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="decode servers by DNS name, like --prefill-dns; repeatable",
    )
    p.add_argument(
        "--dns-interval",
        type=float,
        default=RouterArgs.dns_interval,
        metavar="S",
        help="how often --prefill-dns/--decode-dns names are resolved again",
    )
    p.add_argument(
        "--dns-server",
        default=None,
        metavar="HOST[:PORT]",
        help="ask this DNS server (port default 53) instead of the system resolver",
    )
    p.add_argument(
        "--add-worker-timeout",
        type=float,
        default=RouterArgs.add_worker_timeout,
        metavar="S",
        help="a worker being added (POST /workers, DNS) must answer GET /health with 200 and GET "
        "/server_info within S seconds, else it is refused",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=RouterArgs.drain_timeout,
        metavar="S",
        help="a worker being removed takes no new request; what it runs gets S seconds to finish, "
        "then ends with an error naming the removal",
    )
    p.add_argument(
        "--drain-migrate",
        action="store_true",
        help="a decode being removed (or switched by --autoscale) moves its running requests to "
        "the other decodes (POST /migrate, KV and all) instead of letting them finish there",
    )
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="switch a server between prefill and decode (POST /switch_role, no weight reload) "
        "when one role's queues hold a backlog and moving a server from the other shortens the "
        "longer queue (router/autoscale.py; GET /autoscale shows its state)",
    )
    p.add_argument(
        "--autoscale-interval",
        type=float,
        default=RouterArgs.autoscale_interval,
        metavar="S",
        help="how often the servers' queues are sampled (GET /get_load)",
    )
    p.add_argument(
        "--autoscale-window",
        type=float,
        default=RouterArgs.autoscale_window,
        metavar="S",
        help="a backlog must be in every sample of the last S seconds before a server is switched",
    )
    p.add_argument(
        "--autoscale-cooldown",
        type=float,
        default=RouterArgs.autoscale_cooldown,
        metavar="S",
        help="after a switch, the queues settle this long before the next is considered",
    )
    p.add_argument(
        "--autoscale-queue",
        type=float,
        default=RouterArgs.autoscale_queue,
        metavar="N",
        help="requests waiting per server of a role (prefill: not prefilled yet; decode: waiting "
        "for KV pages or a batch slot) that make a backlog",
    )
    p.add_argument(
        "--autoscale-min-prefill",
        type=int,
        default=RouterArgs.autoscale_min_prefill,
        metavar="N",
        help="never switch away the last N prefill servers",
    )
    p.add_argument(
        "--autoscale-min-decode",
        type=int,
        default=RouterArgs.autoscale_min_decode,
        metavar="N",
        help="never switch away the last N decode servers",
    )
    d = RouterArgs.__dataclass_fields__
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--port", type=int, default=d["port"].default)
    p.add_argument(
        "--workers",
        type=int,
        default=d["workers"].default,
        metavar="N",
        help="router processes serving --port (SO_REUSEPORT), each with its own state; the worker "
        "API then refuses changes: use --prefill-dns/--decode-dns (docs/architecture.md)",
    )
    p.add_argument("--policy", choices=POLICIES, default=d["policy"].default)
    p.add_argument(
        "--prefill-policy", choices=POLICIES, default=None, help="overrides --policy for prefill"
    )
    p.add_argument(
        "--decode-policy", choices=POLICIES, default=None, help="overrides --policy for decode"
    )
    p.add_argument(
        "--dp-aware",
        action="store_true",
        help="pick each worker's data-parallel group too (its dp_size from /server_info, the least "
        "loaded group by /get_load, else in turn) and send it as routed_dp_rank; decode also "
        "gets disagg_prefill_dp_rank, prefill's group. Without it the servers choose",
    )
    p.add_argument(
        "--cache-aware-balance",
        type=float,
        default=d["cache_aware_balance"].default,
        metavar="W",
        help="cache_aware: weight of a worker's load (tokens in hand) against the prompt tokens "
        "its cache spares it; 0 follows the cache alone",
    )
    for medium, name in (("host memory (CPU)", "host"), ("storage (disk, a store)", "storage")):
        p.add_argument(
            f"--cache-aware-{name}-weight",
            type=float,
            default=d[f"cache_aware_{name}_weight"].default,
            metavar="W",
            help=f"cache_aware: a prompt token a worker holds in {medium} below its pool counts "
            "as W of one in its pool (1) and of one it computes (0)",
        )
    p.add_argument(
        "--tokenizer-path",
        default=None,
        help="tokenizer for matching text prompts against the workers' caches (default: the model "
        "path the workers report, when it exists here)",
    )
    p.add_argument(
        "--pd-policy",
        choices=PD_POLICIES,
        default=d["pd_policy"].default,
        help="always: every request prefills on a prefill server; conditional: the router may have "
        "the decode server prefill it itself when that is estimated faster (pdserve decode "
        "servers only; see docs)",
    )
    p.add_argument(
        "--pd-local-max-tokens",
        type=int,
        default=d["pd_local_max_tokens"].default,
        metavar="N",
        help="conditional: never prefill on decode more than N tokens it does not hold",
    )
    p.add_argument(
        "--pd-itl-weight",
        type=float,
        default=d["pd_itl_weight"].default,
        metavar="W",
        help="conditional: weight of the stall a local prefill inflicts on each running stream, "
        "against the TTFT it saves (1: minimise the total latency added; "
        "lower favours TTFT over ITL)",
    )
    p.add_argument(
        "--pd-kv-bandwidth",
        type=float,
        default=d["pd_kv_bandwidth"].default,
        metavar="BYTES_PER_S",
        help="conditional: KV transfer rate assumed until a prefill reports its measured one",
    )
    p.add_argument(
        "--pd-overhead-s",
        type=float,
        default=d["pd_overhead_s"].default,
        metavar="S",
        help="conditional: fixed cost of the PD path (second leg, bootstrap, handshake)",
    )
    p.add_argument(
        "--pd-prefill-fixed-s",
        type=float,
        default=None,
        metavar="S",
        help="conditional: prefill fixed time, instead of the servers' start-up calibration",
    )
    p.add_argument(
        "--pd-prefill-s-per-token",
        type=float,
        default=None,
        metavar="S",
        help="conditional: prefill time per token, instead of the servers' start-up calibration",
    )
    p.add_argument(
        "--health-check-interval",
        "--health-check-interval-secs",
        type=float,
        default=d["health_check_interval"].default,
        metavar="S",
    )
    p.add_argument(
        "--health-check-timeout",
        "--health-check-timeout-secs",
        type=float,
        default=d["health_check_timeout"].default,
        metavar="S",
    )
    p.add_argument(
        "--health-failure-threshold",
        type=int,
        default=d["health_failure_threshold"].default,
        help="consecutive failed health checks before a worker is taken out",
    )
    p.add_argument(
        "--load-poll-interval",
        type=float,
        default=d["load_poll_interval"].default,
        metavar="S",
        help="how often least_load and --dp-aware poll GET /get_load",
    )
    p.add_argument(
        "--request-timeout",
        "--request-timeout-secs",
        type=float,
        default=d["request_timeout"].default,
        metavar="S",
    )
    p.add_argument(
        "--max-retries",
        "--retry-max-retries",
        type=int,
        default=d["max_retries"].default,
        help="retries after a failure before output: on a pair without the worker at fault, or "
        "on the same workers when no other is available",
    )
    p.add_argument(
        "--disable-retries",
        action="store_true",
        help="no retries (--max-retries 0)",
    )
    p.add_argument(
        "--retry-initial-backoff-ms",
        type=float,
        default=d["retry_initial_backoff_ms"].default,
        metavar="MS",
        help="wait before the first retry",
    )
    p.add_argument(
        "--retry-max-backoff-ms",
        type=float,
        default=d["retry_max_backoff_ms"].default,
        metavar="MS",
        help="the longest wait between retries",
    )
    p.add_argument(
        "--retry-backoff-multiplier",
        type=float,
        default=d["retry_backoff_multiplier"].default,
        help="each retry waits this many times longer than the one before",
    )
    p.add_argument(
        "--retry-jitter-factor",
        type=float,
        default=d["retry_jitter_factor"].default,
        help="waits vary by up to this fraction, at random (0 to 1)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=d["max_concurrent_requests"].default,
        help="tokens of the admission bucket: requests that run at once, each holding one to its "
        "end (<= 0: no admission control)",
    )
    p.add_argument(
        "--rate-limit-tokens-per-second",
        type=float,
        default=d["rate_limit_tokens_per_second"].default,
        help="the bucket's refill rate (default: --max-concurrent-requests per second)",
    )
    p.add_argument(
        "--queue-size",
        type=int,
        default=d["queue_size"].default,
        help="requests that may wait for a token (0: none; one more is answered 429)",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        default=d["responses_store_size"].default,
        help="responses of /v1/responses kept for previous_response_id and GET (0: none)",
    )
    p.add_argument(
        "--queue-timeout-secs",
        type=float,
        default=d["queue_timeout_secs"].default,
        metavar="S",
        help="the longest wait for a token (then 408)",
    )
    p.add_argument(
        "--ttft-slo-ms",
        type=float,
        default=d["ttft_slo_ms"].default,
        metavar="MS",
        help="answer 429 at once to a request whose estimated time to first token (the chosen "
        "workers' queues and calibrated prefill, the KV's way) exceeds this; a request's "
        "x-slo-ttft-ms header sets its own",
    )
    p.add_argument(
        "--schedule-low-priority-values-first",
        action="store_true",
        help="the admission queue takes smaller `priority` values first (larger by default)",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="send a span per request (and the legs' traceparent) to this OTLP/HTTP collector",
    )
    p.add_argument(
        "--tenant-header",
        default=d["tenant_header"].default,
        help="the request header naming its tenant, for the admission queue's fair shares",
    )
    p.add_argument(
        "--tenant-weights",
        nargs="*",
        default=[],
        metavar="TENANT=WEIGHT",
        help="tenants' shares of the admission queue under contention (others: 1)",
    )
    p.add_argument(
        "--cb-failure-threshold",
        type=int,
        default=d["cb_failure_threshold"].default,
        help="consecutive request failures that open a worker's circuit breaker (0: off)",
    )
    p.add_argument(
        "--cb-cooldown",
        "--cb-timeout-duration-secs",
        type=float,
        default=d["cb_cooldown"].default,
        metavar="S",
        help="seconds an open breaker waits before letting one trial request through",
    )
    p.add_argument(
        "--max-body-bytes", "--max-payload-size", type=int, default=d["max_body_bytes"].default
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="clients must send 'Authorization: Bearer KEY' (all routes but /health and /metrics); "
        "default: $PDSERVE_API_KEY",
    )
    p.add_argument(
        "--worker-api-key",
        default=None,
        help="the key the router presents to its workers (default: --api-key)",
    )
    p.add_argument(
        "--log-level",
        default=d["log_level"].default,
        choices=["debug", "info", "warning", "warn", "error", "critical"],
    )
    return p


def parse_args(argv: list[str]) -> RouterArgs:
    """Parse a command line into ``RouterArgs``; raises ``ValueError`` naming the bad flag."""
    ns = build_parser().parse_args(argv)
    prefill = []
    for values in ns.prefill:
        if len(values) > 2:
            raise ValueError(f"prefill: expected URL [BOOTSTRAP_PORT], got {' '.join(values)!r}")
        port = _bootstrap_port(values[1]) if len(values) == 2 else DEFAULT_BOOTSTRAP_PORT
        prefill.append((values[0], port))
    level = "warning" if ns.log_level == "warn" else ns.log_level
    return RouterArgs(
        prefill=prefill,
        decode=ns.decode,
        encoder=ns.encoder,
        worker=ns.worker,
        pd_disaggregation=ns.pd_disaggregation,
        prefill_dns=[_dns_target(t, True) for t in ns.prefill_dns],
        decode_dns=[_dns_target(t, False) for t in ns.decode_dns],
        dns_interval=ns.dns_interval,
        dns_server=ns.dns_server,
        add_worker_timeout=ns.add_worker_timeout,
        drain_timeout=ns.drain_timeout,
        drain_migrate=ns.drain_migrate,
        autoscale=ns.autoscale,
        autoscale_interval=ns.autoscale_interval,
        autoscale_window=ns.autoscale_window,
        autoscale_cooldown=ns.autoscale_cooldown,
        autoscale_queue=ns.autoscale_queue,
        autoscale_min_prefill=ns.autoscale_min_prefill,
        autoscale_min_decode=ns.autoscale_min_decode,
        host=ns.host,
        port=ns.port,
        workers=ns.workers,
        policy=ns.policy,
        prefill_policy=ns.prefill_policy,
        decode_policy=ns.decode_policy,
        dp_aware=ns.dp_aware,
        cache_aware_balance=ns.cache_aware_balance,
        cache_aware_host_weight=ns.cache_aware_host_weight,
        cache_aware_storage_weight=ns.cache_aware_storage_weight,
        tokenizer_path=ns.tokenizer_path,
        pd_policy=ns.pd_policy,
        pd_local_max_tokens=ns.pd_local_max_tokens,
        pd_itl_weight=ns.pd_itl_weight,
        pd_kv_bandwidth=ns.pd_kv_bandwidth,
        pd_overhead_s=ns.pd_overhead_s,
        pd_prefill_fixed_s=ns.pd_prefill_fixed_s,
        pd_prefill_s_per_token=ns.pd_prefill_s_per_token,
        health_check_interval=ns.health_check_interval,
        health_check_timeout=ns.health_check_timeout,
        health_failure_threshold=ns.health_failure_threshold,
        load_poll_interval=ns.load_poll_interval,
        request_timeout=ns.request_timeout,
        max_retries=0 if ns.disable_retries else ns.max_retries,
        retry_initial_backoff_ms=ns.retry_initial_backoff_ms,
        retry_max_backoff_ms=ns.retry_max_backoff_ms,
        retry_backoff_multiplier=ns.retry_backoff_multiplier,
        retry_jitter_factor=ns.retry_jitter_factor,
        cb_failure_threshold=ns.cb_failure_threshold,
        cb_cooldown=ns.cb_cooldown,
        max_concurrent_requests=ns.max_concurrent_requests,
        rate_limit_tokens_per_second=ns.rate_limit_tokens_per_second,
        queue_size=ns.queue_size,
        queue_timeout_secs=ns.queue_timeout_secs,
        responses_store_size=ns.responses_store_size,
        otlp_traces_endpoint=ns.otlp_traces_endpoint,
        tenant_header=ns.tenant_header.lower(),
        schedule_low_priority_values_first=ns.schedule_low_priority_values_first,
        ttft_slo_ms=ns.ttft_slo_ms,
        tenant_weights=tenant_weights(ns.tenant_weights),
        max_body_bytes=ns.max_body_bytes,
        log_level=level,
        api_key=ns.api_key or envs.api_key(),
        worker_api_key=ns.worker_api_key,
    )
