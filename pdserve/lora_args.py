"""The LoRA server arguments (fields of ``ServerArgs``): ``--lora-paths`` parsed, and what LoRA
cannot run beside yet refused at start-up, naming the flag."""

from __future__ import annotations

import os
from typing import Callable, Optional


def parse_lora_paths(values: Optional[list[str]]) -> dict[str, str]:
    """``NAME=PATH`` or ``PATH`` (named by its folder) items as {name: path}; ValueError naming a
    bad or repeated item."""
    out: dict[str, str] = {}
    for item in values or []:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(item)), item
        if not name or not path:
            raise ValueError(f"{item!r} is not NAME=PATH")
        if name in out:
            raise ValueError(f"adapter name {name!r} is given twice")
        out[name] = path
    return out


def check_lora_args(args, bad: Callable[[str, str], None]) -> None:
    try:
        paths = parse_lora_paths(args.lora_paths)
    except ValueError as e:
        bad("lora_paths", str(e))
    if paths:
        args.enable_lora = True
    if not 1 <= args.max_lora_rank <= 256:
        bad("max_lora_rank", f"must be in [1, 256], got {args.max_lora_rank}")
    if args.max_loaded_loras < 1:
        bad("max_loaded_loras", f"must be >= 1, got {args.max_loaded_loras}")
    if len(paths) > args.max_loaded_loras:
        bad(
            "lora_paths",
            f"{len(paths)} adapters, more than --max-loaded-loras {args.max_loaded_loras}",
        )
    if not args.enable_lora:
        return
    for flag, on in (
        ("speculative_algorithm", args.speculative_algorithm is not None),
        ("pp_size", args.pp_size > 1),
        ("enable_dp_attention", args.enable_dp_attention),
    ):
        if on:
            bad(
                "enable_lora",
                f"LoRA adapters do not run with --{flag.replace('_', '-')} yet",
            )
