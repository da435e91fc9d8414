"""``pdserve serve``: start the scheduler process, then the HTTP front end in this process.

Start-up: bind the scheduler's output socket, spawn the scheduler, load the tokenizer while it
loads the model, wait for its ready message (which carries the model facts), start HTTP, run
one warm-up generation (unless ``--skip-warmup``); ``/health`` turns 200 after that.

With ``--nnodes N --node-rank R`` (R > 0) it starts this node's ranks only, logs when they are
ready (which they are only once every node's are) and blocks without any HTTP server; it exits
1 when one of its ranks exits (a lost peer or a crash takes the whole server down).

Shutdown: SIGINT/SIGTERM stop uvicorn gracefully (also when SIGINT was inherited ignored), then
the scheduler is terminated (killed if it does not exit). If the front end dies without cleaning
up, its scheduler processes get SIGTERM from the kernel (``lifetime.end_with_parent``). Exit code 0
after a signal, 1 when the scheduler failed or died, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing.connection as mp_connection
import signal
import sys
from typing import Optional

from pdserve.config import ServerArgs
from pdserve.keepalive import SERVER_IDLE_S
from pdserve.log import role_tag, setup_logging
from pdserve.server.scheduler_client import SchedulerClient

logger = logging.getLogger(__name__)

SCHEDULER_READY_TIMEOUT_S = 3600.0


# what `pip install pdserve` leaves out, and what each missing package costs
OPTIONAL_PACKAGES = """\
optional packages (every default works without them):
  xgrammar                           --grammar-backend xgrammar (the default); without it structured
                                     outputs use llguidance, a dependency, and the log says so
  mooncake-transfer-engine[-non-cuda]  --disaggregation-transfer-backend mooncake, and the
                                     Mooncake store of --hicache-storage-backend mooncake
  nixl, nixl-cu12                    --disaggregation-transfer-backend nixl
  a C++ compiler (g++)               pdserve's CPU kernels; without one, its PyTorch paths
"""


class _Shutdown(Exception):
    """Raised in the main thread by SIGTERM so that cleanup runs."""


def _on_sigterm(signum, frame) -> None:
    raise _Shutdown()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve serve",
        description="Run a pdserve server.",
        epilog=OPTIONAL_PACKAGES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ServerArgs.add_cli_args(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        server_args = ServerArgs.from_cli_args(ns)
    except ValueError as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    node = server_args.node_rank  # a node other than 0 runs ranks only: its tag names the node
    setup_logging(
        role_tag(server_args.role) if node == 0 else f"{server_args.role}-node{node}",
        server_args.log_level,
    )
    for note in server_args.start_notes():
        logger.warning("%s", note)
    for warning in server_args.exposure_warnings():
        logger.warning("SECURITY WARNING: %s", warning)
    if server_args.torch_num_threads and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(server_args.torch_num_threads)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    signal.signal(signal.SIGTERM, _on_sigterm)
    if server_args.encoder_only:  # EPD: the vision tower alone, no scheduler
        from pdserve.multimodal.encoder_server import run_encoder

        return run_encoder(server_args)
    client = SchedulerClient(server_args)
    try:
        client.start_process()
        if server_args.node_rank > 0:
            return _run_ranks_only(client)
        tokenizer = _load_tokenizer(server_args.tokenizer_path)
        info = client.wait_ready(SCHEDULER_READY_TIMEOUT_S)
        logger.info("scheduler ready: %s", info)
        return _serve_http(server_args, tokenizer, client)
    except (_Shutdown, KeyboardInterrupt):
        logger.info("shutting down")
        return 0
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    finally:
        client.stop()
        logger.info("scheduler stopped")


def _run_ranks_only(client: SchedulerClient) -> int:
    """A node other than 0: run this node's ranks, no HTTP server, until one of them exits (a
    lost peer, a crash: the server is down) or a signal stops them."""
    layout = client.layout
    client.wait_ready(SCHEDULER_READY_TIMEOUT_S)
    logger.info(
        "%s ready: serving through node 0's front end (torch.distributed at %s, outputs to %s)",
        layout.describe(),
        layout.init_address,
        client.out_addr,
    )
    mp_connection.wait(client.sentinels())
    for p in client.procs:
        p.join(1.0)
    logger.error("%s stops: %s", layout.describe(), client.exit_codes() or "a rank exited")
    return 1


def _load_tokenizer(path: str):
    from pdserve.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path)
    except Exception as e:  # any loader failure is a start-up error with its reason
        raise RuntimeError(f"cannot load the tokenizer from {path!r}: {e}") from None


def _serve_http(server_args: ServerArgs, tokenizer, client: SchedulerClient) -> int:
    import uvicorn

    from pdserve.server.app import create_app
    from pdserve.server.metrics import ServerMetrics
    from pdserve.server.tokenizer_manager import TokenizerManager

    tm = TokenizerManager(
        server_args, tokenizer, client, ServerMetrics(server_args.served_model_name)
    )
    exit_code = 0
    server: Optional[uvicorn.Server] = None

    def on_fatal(reason: str) -> None:
        nonlocal exit_code
        logger.error("stopping the server: %s", reason)
        exit_code = 1
        server.should_exit = True

    app = create_app(tm, warmup=not server_args.skip_warmup, on_fatal=on_fatal)
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        log_config=None,
        log_level=server_args.log_level,
        access_log=server_args.enable_access_log,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=SERVER_IDLE_S,  # pooling clients close theirs first
    )
    server = uvicorn.Server(config)
    asyncio.run(server.serve())
    return exit_code
