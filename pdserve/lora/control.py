"""A scheduler's side of its LoRA adapters: the adapter a request names (its slot and prefix-cache
namespace key), the control calls that load and unload adapters (on every rank alike; an adapter
a queued or running request uses is not unloaded), and the adapters of the running and waiting
requests (``pdserve:lora_requests_info``). Each raises ValueError naming the problem."""

from __future__ import annotations

NO_LORA = "this server serves no LoRA adapters (--enable-lora)"


def request_adapter(lora, name: str) -> tuple[int, int]:
    """(slot, namespace key) of adapter ``name`` for a request (``lora``: the rank's manager)."""
    if lora is None:
        raise ValueError(f"lora_path: {name!r}: {NO_LORA}")
    try:
        return lora.slot(name), lora.namespace_key(name)
    except KeyError as e:
        raise ValueError(f"lora_path: {e.args[0]}") from None


def _queued_and_running(s) -> list:
    return s.waiting + s.running + (s.pd.all_reqs() if s.pd is not None else [])


def control(s, op: str, args: dict) -> dict:
    """``load_lora`` / ``unload_lora`` / ``list_lora`` on scheduler ``s``."""
    lora = s.runner.lora
    if lora is None:
        raise ValueError(NO_LORA)
    if op == "load_lora":
        try:
            lora.load(args["lora_name"], args["lora_path"])
        except ValueError as e:  # an AdapterError: reported as the ValueError the caller made
            raise ValueError(str(e)) from None
    elif op == "unload_lora":
        name = args["lora_name"]
        request_adapter(lora, name)  # not loaded: named
        users = sum(1 for r in _queued_and_running(s) if r.lora_name == name)
        if users:
            raise ValueError(
                f"LoRA adapter {name!r} has {users} request(s) queued or running; unload it "
                "once they end"
            )
        lora.unload(name)
    return {"adapters": lora.describe()}


def stats(s) -> dict:
    def names(reqs) -> list[str]:
        return sorted({r.lora_name for r in reqs if r.lora_name is not None})

    return {
        "max": s.runner.lora.max_loaded,
        "running": names(s.running),
        "waiting": names(s.waiting + (s.pd.all_reqs() if s.pd is not None else [])),
    }
