"""``pdserve`` command line: one subcommand per entry point, each imported lazily."""

from __future__ import annotations

import importlib
import logging
import os
import sys

COMMANDS = {
    "serve": ("pdserve.server.launch", "main", "run a server (colocated, prefill or decode)"),
    "router": ("pdserve.router.app", "main", "run the PD router"),
    "launch": (
        "pdserve.server.cluster",
        "main",
        "run a local PD cluster (prefill + decode + router)",
    ),
    "bench": (
        "pdserve.bench.serving",
        "main",
        "serving benchmark against an HTTP endpoint (and `bench plot`)",
    ),
    "plan": ("pdserve.plan.cli", "main", "prefill/decode split of a server budget for a workload"),
    "bench-transfer": ("pdserve.bench.transfer", "main", "KV transfer bandwidth benchmark"),
    "prepare-model": ("pdserve.models.demo", "main", "build the demo model as an HF directory"),
    "expert-placement": (
        "pdserve.layers.moe.placement_file",
        "main",
        "MoE expert placement (--init-expert-location) from a recorded distribution",
    ),
}


def usage() -> str:
    lines = ["usage: pdserve COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<17} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"pdserve: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    from pdserve import envs, lifetime
    from pdserve.kernels import cap_library_isas

    cap_library_isas(envs.cpu_isa())  # before torch runs anything, here and in the servers started
    parent = envs.take_parent_pid()
    if parent is not None:  # started by `pdserve launch`: ends when the launcher does
        lifetime.end_with_parent(parent)
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


# long-running commands: once their own shutdown is done (children stopped, sockets closed, logs
# written), the process ends without the interpreter's teardown, which collects the whole heap
# of torch, transformers and tokenizer objects and took seconds on every server stop
QUICK_EXIT = ("serve", "router", "launch")


def run() -> None:
    code = main()
    if len(sys.argv) > 1 and sys.argv[1] in QUICK_EXIT:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
