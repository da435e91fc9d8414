"""The MoE server arguments (SGLang's flags, fields of ``ServerArgs``): their check against the rank
layout at start-up, and the ``MoEOptions`` the model layers take (``layers/moe/context.py``).
What needs the model (its expert count, a placement file's contents) is checked when it loads."""

from __future__ import annotations

import os
from typing import Callable

MOE_A2A_BACKENDS = ("none", "torch")
MOE_RUNNER_BACKENDS = ("auto", "fused", "grouped_mm", "loop")
EXPERT_RECORDER_MODES = ("stat",)


def check_moe_args(args, bad: Callable[[str, str], None]) -> None:
    """The MoE flags against the rank layout (what needs the model, e.g. the expert count, is
    checked when it loads)."""
    if args.ep_size < 1 or args.tp_size % args.ep_size:
        bad("ep_size", f"must divide --tp-size ({args.tp_size}), got {args.ep_size}")
    if args.moe_a2a_backend not in MOE_A2A_BACKENDS:
        bad("moe_a2a_backend", f"must be one of {MOE_A2A_BACKENDS}, got {args.moe_a2a_backend!r}")
    if args.moe_a2a_backend == "torch" and args.ep_size == 1:
        bad(
            "moe_a2a_backend",
            "'torch' dispatches tokens to the ranks that hold their experts and needs "
            f"expert parallelism (--ep-size > 1), got --ep-size {args.ep_size}",
        )
    if args.moe_a2a_backend == "torch" and args.ep_size != args.tp_size:
        bad(
            "moe_a2a_backend",
            f"'torch' needs --ep-size equal to --tp-size ({args.tp_size}), got --ep-size "
            f"{args.ep_size}; TP inside expert groups runs with --moe-a2a-backend none",
        )
    if args.enable_return_routed_experts and args.pp_size > 1:
        bad(
            "enable_return_routed_experts",
            f"--enable-return-routed-experts needs every layer on one rank; "
            f"with --pp-size {args.pp_size} each pipeline stage sees only its "
            "own layers' routing",
        )
    if args.moe_dense_tp_size not in (None, 1):
        bad(
            "moe_dense_tp_size",
            f"must be 1 (replicated dense layers) or unset, got {args.moe_dense_tp_size}",
        )
    if args.moe_runner_backend not in MOE_RUNNER_BACKENDS:
        bad(
            "moe_runner_backend",
            f"must be one of {MOE_RUNNER_BACKENDS}, got {args.moe_runner_backend!r}",
        )
    if args.ep_num_redundant_experts < 0:
        bad("ep_num_redundant_experts", f"must be >= 0, got {args.ep_num_redundant_experts}")
    if args.expert_distribution_recorder_mode not in (None,) + EXPERT_RECORDER_MODES:
        bad(
            "expert_distribution_recorder_mode",
            f"must be one of {EXPERT_RECORDER_MODES} (or unset), got "
            f"{args.expert_distribution_recorder_mode!r}",
        )
    if args.init_expert_location != "trivial" and not os.path.isfile(args.init_expert_location):
        bad(
            "init_expert_location",
            f"must be 'trivial' or a JSON file, got {args.init_expert_location!r} (no such file)",
        )


def moe_options(args):
    """The MoE part, as the model layers take it (``layers/moe/context.py``)."""
    from pdserve.layers.moe.context import MoEOptions

    return MoEOptions(
        ep_size=args.ep_size,
        a2a_backend=args.moe_a2a_backend,
        dense_tp_size=args.moe_dense_tp_size,
        runner=args.moe_runner_backend,
        init_expert_location=args.init_expert_location,
        num_redundant_experts=args.ep_num_redundant_experts,
        record_experts=args.expert_distribution_recorder_mode == "stat",
        capture_routed_experts=args.enable_return_routed_experts,
    )
