"""``--enable-return-routed-experts`` and a request's ``return_routed_experts``: the check the
HTTP front end makes before a request reaches the scheduler (it imports no torch; the store itself
is ``engine/routed_experts.py``)."""

from __future__ import annotations

FLAG = "--enable-return-routed-experts"


def refusal(args, spec, start_len: int, prompt_len: int) -> str:
    """Why a request asking for routed experts cannot have them ("" when it can): the server
    flag, the model, ``routed_experts_start_len``. ``spec``: the server's store (None without
    one)."""
    if not args.enable_return_routed_experts:
        return f"return_routed_experts: this server was started without {FLAG}"
    if spec is None:
        return (
            "return_routed_experts: the model has no MoE layers, "
            "so there are no routed experts to return"
        )
    if (
        isinstance(start_len, bool)
        or not isinstance(start_len, int)
        or not 0 <= start_len <= prompt_len
    ):
        return (
            f"routed_experts_start_len: must be an integer in [0, {prompt_len}] (the prompt "
            f"length), got {start_len!r}"
        )
    return ""
