"""``pdserve launch``: a local PD cluster (N prefill + K decode servers + the router) on one host.

Servers use the ``local`` transfer backend (decode's KV pool in shared memory) when they listen on
loopback, else a network backend (``--transfer-backend``'s help has the rule). With
``--tp-size`` (or ``--prefill-tp-size`` / ``--decode-tp-size``) each server runs that many ranks;
each rank's torch thread count defaults to an equal share of the host's cores over all ranks
(``default_threads``; on 2 cores 1P1D that is one thread each, which measured best there).
Any other flag of ``pdserve serve`` applies to every server, or to one role's servers when
prefixed with the role: ``--decode-ep-size 2 --decode-moe-a2a-backend torch`` (MoE decode with
expert parallelism), ``--prefill-chunked-prefill-size 4096``. The servers share a random
``--disaggregation-secret`` unless one is given (flag or environment).

Stopping: SIGINT or SIGTERM (handled even when the launcher inherited SIGINT ignored, as a
script's background job does) stops the router, then the decode servers, then the prefill
servers, each with SIGTERM (SIGKILL after ``STOP_TIMEOUT_S``, or at a second signal). However
the launcher ends, SIGKILL included, its children end with it: each gets SIGTERM from the kernel
when the launcher exits (``lifetime.end_with_parent``), and so do their scheduler processes when
a server exits.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import httpx

from pdserve import lifetime
from pdserve.log import setup_logging
from pdserve.router.args import PD_POLICIES, POLICIES

logger = logging.getLogger(__name__)

# per group of the stop order: a server's graceful shutdown (5 s) then its scheduler's (up to 10 s)
STOP_TIMEOUT_S = 20.0


def free_port(start: int) -> int:
    """The first port >= start that is free on 127.0.0.1."""
    port = start
    while True:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                port += 1


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, name: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} not ready at {url} after {timeout:.0f} s")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="pdserve launch", description=__doc__)
    p.add_argument(
        "--model-path",
        default=None,
        help="HF model directory (default: the demo model, served as smollm2-135m-instruct)",
    )
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="router port")
    p.add_argument("--policy", default="round_robin", choices=POLICIES, help="the router's policy")
    p.add_argument(
        "--prefill-policy",
        default=None,
        choices=POLICIES,
        help="the router's policy for prefill (e.g. cache_aware with several prefills)",
    )
    p.add_argument(
        "--pd-policy",
        default="always",
        choices=PD_POLICIES,
        help="conditional: the router may have decode prefill short prompts itself",
    )
    p.add_argument(
        "--pd-local-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="conditional: the router never has decode prefill more than N tokens it does not hold "
        "(the router's default unless given)",
    )
    p.add_argument(
        "--pd-itl-weight",
        type=float,
        default=None,
        metavar="W",
        help="conditional: weight of the stall a local prefill inflicts on decode's running "
        "streams (the router's default unless given)",
    )
    p.add_argument(
        "--decode-radix-cache",
        action="store_true",
        help="decode keeps finished requests' KV; a next turn gets only its new pages from prefill",
    )
    p.add_argument(
        "--transfer-backend",
        default=None,
        help="KV transfer backend of every server. Default: local when --host is a loopback "
        "address (every server on this host, reached only from it), else mooncake (nixl when "
        "Mooncake is not installed), since servers reachable from other hosts may be paired with a "
        "peer there, which the local backend refuses",
    )
    p.add_argument(
        "--torch-num-threads",
        type=int,
        default=None,
        help="per rank (default: the cores divided among all ranks, at least 1)",
    )
    p.add_argument("--tp-size", type=int, default=1, help="ranks of every server")
    p.add_argument(
        "--prefill-tp-size",
        type=int,
        default=None,
        help="ranks of each prefill server (default --tp-size)",
    )
    p.add_argument(
        "--decode-tp-size",
        type=int,
        default=None,
        help="ranks of each decode server (default --tp-size)",
    )
    p.add_argument(
        "--prefill-pp-size", type=int, default=1, help="pipeline stages of each prefill server"
    )
    p.add_argument(
        "--prefill-dp-size",
        type=int,
        default=1,
        help="attention-DP groups of each prefill server (--enable-dp-attention; "
        "divides its TP size)",
    )
    p.add_argument(
        "--decode-dp-size",
        type=int,
        default=1,
        help="attention-DP groups of each decode server (--enable-dp-attention; "
        "divides its TP size)",
    )
    p.add_argument("--dp-aware", action="store_true", help="the router picks both legs' DP groups")
    p.add_argument(
        "--api-key",
        default=None,
        help="clients must send 'Authorization: Bearer KEY' to the router; "
        "its servers get the same key",
    )
    p.add_argument(
        "--kv-store",
        default=None,
        choices=("mooncake",),
        help="start a cluster-wide prefix store (a mooncake_master on --host) that every prefill "
        "server, and decode with --decode-radix-cache, reads and writes (hierarchical cache with "
        "--hicache-storage-backend mooncake); stopped with the cluster",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=600,
        help="seconds each server, then the router, may take to answer /health",
    )
    p.add_argument("--log-level", default="info")
    args, extra = p.parse_known_args(argv)
    if args.num_prefill < 1 or args.num_decode < 1:
        p.error("--num-prefill and --num-decode must be >= 1")
    args.prefill_tp_size = args.prefill_tp_size or args.tp_size
    args.decode_tp_size = args.decode_tp_size or args.tp_size
    if args.prefill_tp_size < 1 or args.decode_tp_size < 1:
        p.error("TP sizes must be >= 1")
    if args.prefill_pp_size < 1:
        p.error("--prefill-pp-size must be >= 1")
    for role in ("prefill", "decode"):
        dp, tp = getattr(args, f"{role}_dp_size"), getattr(args, f"{role}_tp_size")
        if dp < 1 or tp % dp:
            p.error(f"--{role}-dp-size must divide the {role} TP size ({tp}), got {dp}")
    return args, extra


def transfer_backend_for(host: str, requested: str | None) -> str:
    """``--transfer-backend``, or the default rule of its help text."""
    if requested:
        return requested
    if host == "localhost" or _is_loopback(host):
        return "local"
    from pdserve.disagg.transfer import get_backend

    for name in ("mooncake", "nixl"):
        try:
            get_backend(name)
            return name
        except ValueError as e:
            logger.info("transfer backend %s not usable: %s", name, e)
    logger.warning(
        "--host %s is not loopback but neither mooncake nor nixl is installed: using the local "
        "backend, so only servers on this host can be paired",
        host,
    )
    return "local"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def shared_dtype_flags(model: str, extra: list[str]) -> list[str]:
    """``--dtype`` for every server, decided once here. ``--dtype auto`` measures bf16 against
    float32 on each server at start-up; servers starting together on a busy host can measure
    differently, and a prefill and a decode that keep their KV in different dtypes cannot be
    paired. Nothing when the user chose ``--dtype`` or ``--kv-cache-dtype`` (or quantization)."""
    if any(
        a.split("=")[0] in ("--dtype", "--kv-cache-dtype", "--quantization", "--device")
        for a in extra
    ):
        return []
    from pdserve import kernels
    from pdserve.engine.precision import choose_compute_dtype
    from pdserve.models.loader import load_config

    dtype, why = choose_compute_dtype("auto", "cpu", load_config(model), kernels.load())
    name = str(dtype).replace("torch.", "")
    logger.info("every server computes in %s: %s", name, why)
    return ["--dtype", name]


ROLES = ("prefill", "decode")


def split_role_flags(extra: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Server flags for one role only: ``--prefill-X`` / ``--decode-X`` where ``--X`` is a flag of
    ``pdserve serve`` (e.g. ``--decode-ep-size 2``, ``--prefill-moe-a2a-backend torch``) go to that
    role's servers as ``--X``. Returns (flags for every server, {role: its own flags})."""
    import dataclasses

    from pdserve.config import ServerArgs

    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    common: list[str] = []
    per_role: dict[str, list[str]] = {role: [] for role in ROLES}
    i = 0
    while i < len(extra):
        token = extra[i]
        flag, eq, value = token.partition("=")
        role = next((r for r in ROLES if flag.startswith(f"--{r}-")), None)
        name = flag[len(f"--{role}-") :].replace("-", "_") if role else ""
        if role is None or name not in fields:
            common.append(token)
            i += 1
            continue
        out = f"--{name.replace('_', '-')}"
        if eq or isinstance(fields[name].default, bool):
            per_role[role].append(f"{out}={value}" if eq else out)
            i += 1
        else:
            if i + 1 >= len(extra):
                raise ValueError(f"{flag}: expected a value")
            per_role[role] += [out, extra[i + 1]]
            i += 2
    return common, per_role


def default_threads(cores: int, n_ranks: int) -> int:
    """Torch threads per rank without ``--torch-num-threads``: the host's cores divided among all
    ranks, at least one. Also on a small host: on 2 cores, 1P1D, 1,024-token prompts, giving both
    servers both cores (2 threads each, 4 on 2 cores) ran at 0.33-0.67x the output rate of one
    thread each, and one colocated server with 2 threads at 0.72-0.76x (docs/benchmarks.md, "PD on
    two cores"): oversubscribed OpenMP threads wait for each other."""
    return max(1, cores // n_ranks)


def router_pd_flags(args: argparse.Namespace) -> list[str]:
    """The conditional policy's flags given to the launcher, for the router."""
    flags = []
    for name in ("pd_local_max_tokens", "pd_itl_weight"):
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def _parallel_flags(tp: int, dp: int, pp: int = 1) -> list[str]:
    flags = ["--tp-size", str(tp)]
    if dp > 1:
        flags += ["--dp-size", str(dp), "--enable-dp-attention"]
    if pp > 1:
        flags += ["--pp-size", str(pp)]
    return flags


def migration_peer_flags(host: str, ports: list[int], mine: int, given: list[str]) -> list[str]:
    """``--migration-peers`` naming the other decodes of the cluster (their requests may move
    between them: ``router --drain-migrate``, ``POST /migrate``), unless the flags give one."""
    name = f"[{host}]" if ":" in host else host
    others = [f"{name}:{p}" for i, p in enumerate(ports) if i != mine]
    if not others or "--migration-peers" in given:
        return []
    return ["--migration-peers", ",".join(others)]


def stop_in_order(procs: list[tuple[str, str, subprocess.Popen]]) -> None:
    """The router first (no new requests), then the decode servers (nothing pulls KV any more),
    then the prefill servers, then the store's master (``--kv-store``): each group gets SIGTERM, and
    SIGKILL after ``STOP_TIMEOUT_S`` or at once after a second SIGINT/SIGTERM."""
    hurry: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        if not hurry:
            logger.warning("%s while stopping: killing what is left", signal.Signals(signum).name)
        hurry.append(signum)

    lifetime.handle_stop_signals(on_signal)
    for role in ("router", "decode", "prefill", "store"):
        group = [
            proc
            for name, _, proc in procs
            if name.partition("-")[0] == role and proc.poll() is None
        ]
        for proc in group:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (
            any(proc.poll() is None for proc in group) and time.monotonic() < deadline and not hurry
        ):
            time.sleep(0.05)
        for proc in group:
            if proc.poll() is None:
                logger.warning("pid %d did not stop after SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(list(argv or []))
    setup_logging("launch", args.log_level)
    # Ctrl-C and SIGTERM stop the cluster in order, also when this process inherited SIGINT
    # ignored (a script's background job); however this process ends, its children end with it
    # (PDSERVE_PARENT_PID, read by pdserve.cli).
    lifetime.handle_stop_signals(lifetime.raise_interrupt)
    os.environ["PDSERVE_PARENT_PID"] = str(os.getpid())
    procs: list[tuple[str, str, subprocess.Popen]] = []
    try:
        return _run(args, extra, procs)
    except KeyboardInterrupt:
        logger.info("stopping the cluster")
        return 0
    except (RuntimeError, TimeoutError) as e:
        logger.error("%s", e)
        return 1
    finally:
        stop_in_order(procs)


def _run(
    args: argparse.Namespace, extra: list[str], procs: list[tuple[str, str, subprocess.Popen]]
) -> int:
    model = args.model_path
    if model is None:
        from pdserve.models.demo import DEMO_MODELS, ensure_demo_model

        model = ensure_demo_model()
        if not any(a.split("=")[0] == "--served-model-name" for a in extra):
            extra = ["--served-model-name", DEMO_MODELS[0], *extra]  # what clients send as "model"
    n_ranks = (
        args.num_prefill * args.prefill_tp_size * args.prefill_pp_size
        + args.num_decode * args.decode_tp_size
    )
    threads = args.torch_num_threads or default_threads(os.cpu_count() or 1, n_ranks)
    logger.info(
        "%d torch thread(s) per rank (%d rank(s) on %d core(s))",
        threads,
        n_ranks,
        os.cpu_count() or 1,
    )
    py = [sys.executable, "-m", "pdserve.cli"]
    backend = transfer_backend_for(args.host, args.transfer_backend)
    try:
        extra, role_flags = split_role_flags(extra)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    extra = [*shared_dtype_flags(model, extra), *extra]
    if args.kv_store:
        from pdserve.server.store_master import StoreMaster, server_store_flags

        master = StoreMaster(args.host)
        procs.append(("store-master", master.address, master.proc))
        try:
            store_flags = server_store_flags(master.wait_ready(), extra)
        except ValueError as e:
            logger.error("%s", e)
            return 2
        role_flags["prefill"] += store_flags
        if args.decode_radix_cache:  # a decode server's tiers extend its prefix cache
            role_flags["decode"] += store_flags
    common = [
        "--model-path",
        model,
        "--host",
        args.host,
        "--torch-num-threads",
        str(threads),
        "--disaggregation-transfer-backend",
        backend,
        "--log-level",
        args.log_level,
        *extra,
    ]
    # Passed through the environment, which (unlike a command line) other users cannot list.
    if args.api_key:
        os.environ["PDSERVE_API_KEY"] = (
            args.api_key
        )  # the servers and the router (its --worker-api-key too)
    if not any(a.split("=")[0] == "--disaggregation-secret" for a in extra):
        # the control plane is authenticated even when nobody asked for it
        os.environ.setdefault("PDSERVE_DISAGGREGATION_SECRET", secrets.token_hex(32))

    events_port = 5557
    follows_events = (
        "cache_aware" in (args.policy, args.prefill_policy) or args.pd_policy == "conditional"
    )

    def kv_events() -> list[str]:
        """KV event endpoints for one server when the router follows the caches (one port per DP
        group)."""
        nonlocal events_port
        if not follows_events:
            return []
        pub = free_port(events_port)
        replay = free_port(pub + 1000)
        events_port = pub + 1 + 8  # room for DP groups' ports (endpoint port + group)
        return [
            "--kv-events-endpoint",
            f"tcp://{args.host}:{pub}",
            "--kv-events-replay-endpoint",
            f"tcp://{args.host}:{replay}",
        ]

    port = 30000
    prefill_specs, decode_urls = [], []
    bport = 8998
    for i in range(args.num_prefill):
        port, bport = free_port(port), free_port(bport)
        cmd = py + [
            "serve",
            *common,
            "--port",
            str(port),
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bport),
            *kv_events(),
            *_parallel_flags(args.prefill_tp_size, args.prefill_dp_size, args.prefill_pp_size),
            *role_flags["prefill"],
        ]
        url = f"http://{args.host}:{port}"
        procs.append((f"prefill-{i}", url, subprocess.Popen(cmd)))
        prefill_specs += ["--prefill", url, str(bport)]
        port, bport = port + 1, bport + 1
    decode_ports = []
    for _ in range(args.num_decode):
        decode_ports.append(free_port(decode_ports[-1] + 1 if decode_ports else port))
    for j, port in enumerate(decode_ports):
        cmd = py + [
            "serve",
            *common,
            "--port",
            str(port),
            "--disaggregation-mode",
            "decode",
            *kv_events(),
            *(["--disaggregation-decode-enable-radix-cache"] if args.decode_radix_cache else []),
            *_parallel_flags(args.decode_tp_size, args.decode_dp_size),
            *migration_peer_flags(args.host, decode_ports, j, [*common, *role_flags["decode"]]),
            *role_flags["decode"],
        ]
        url = f"http://{args.host}:{port}"
        procs.append((f"decode-{j}", url, subprocess.Popen(cmd)))
        decode_urls += ["--decode", url]
    for name, url, proc in procs:
        if name == "store-master":  # ready already (no HTTP /health)
            continue
        wait_ready(url, proc, args.ready_timeout, name)
        logger.info("%s ready at %s", name, url)
    router_url = f"http://{args.host}:{args.port}"
    router = subprocess.Popen(
        py
        + [
            "router",
            *prefill_specs,
            *decode_urls,
            "--host",
            args.host,
            "--port",
            str(args.port),
            "--policy",
            args.policy,
            *(["--prefill-policy", args.prefill_policy] if args.prefill_policy else []),
            "--pd-policy",
            args.pd_policy,
            *router_pd_flags(args),
            *(["--dp-aware"] if args.dp_aware else []),
        ]
    )
    procs.append(("router", router_url, router))
    # a loaded host can take a minute to start the router and see every worker healthy
    wait_ready(router_url, router, args.ready_timeout, "router")
    print(
        f"pdserve cluster ready: {router_url}  "
        f"({args.num_prefill} prefill + {args.num_decode} decode, model {model})",
        flush=True,
    )
    # the servers serve on without the store (recomputing what it held): its end is not theirs
    serving = [(name, proc) for name, _, proc in procs if name != "store-master"]
    while all(proc.poll() is None for _, proc in serving):
        time.sleep(1)
    dead = [name for name, proc in serving if proc.poll() is not None]
    logger.error("%s exited; stopping the cluster", ", ".join(dead))
    return 1
