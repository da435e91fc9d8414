"""The plain request object (``Req``) and its sampling parameters.

The engine sees ``Req`` objects and batches of them, never HTTP objects. A request is described
once, by ``RequestSpec`` (with its PD routing in ``PDFields``): the front end builds it, the
scheduler message is one (``server/messages.GenerateReq``), and ``Req.from_spec`` makes the
engine's request of it.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec

from pdserve.grammar import GrammarSpec
from pdserve.multimodal.inputs import ImageInput

MAX_TOP_LOGPROBS = 20
# a temperature below this samples greedily, as in SGLang (``SamplingParams.is_greedy``)
SAMPLING_EPS = 1e-6
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# the largest temperature: the sampler divides float32 logits by it, and a larger one is an
# infinity there (a grammar's masked -inf / inf is NaN, and no token can be drawn)
MAX_TEMPERATURE = 3.4028234663852886e38


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: Optional[int] = None
    n: int = 1

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]) -> "SamplingParams":
        """Build from a user dict; unknown keys are ignored, bad values raise ``ValueError``."""
        d = dict(d or {})
        if not isinstance(d, dict):
            raise ValueError("sampling_params: must be an object")
        kwargs = {k: d[k] for k in cls.__dataclass_fields__ if k in d and d[k] is not None}
        # SGLang's name of the per-request seed
        if d.get("sampling_seed") is not None:
            if kwargs.get("seed") not in (None, d["sampling_seed"]):
                raise ValueError(
                    f"sampling_seed: {d['sampling_seed']!r} and seed: {kwargs['seed']!r} disagree"
                )
            kwargs["seed"] = d["sampling_seed"]
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = [kwargs["stop"]]
        p = cls(**kwargs)
        p.validate()
        return p

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}")

        def int64(name: str, v: int) -> None:  # what msgpack and torch carry across processes
            if not INT64_MIN <= v <= INT64_MAX:
                bad(name, f"must be in [-2^63, 2^63), got {v}")

        def number(name: str, integer: bool = False) -> None:
            v = getattr(self, name)
            ok = isinstance(v, int) if integer else isinstance(v, (int, float))
            if isinstance(v, bool) or not ok:
                bad(name, f"must be {'an integer' if integer else 'a number'}, got {v!r}")
            # a number crosses the process boundary as a float (an int of any size would not)
            if not integer:
                try:
                    f = float(v)
                except OverflowError:
                    f = math.inf
                if not math.isfinite(f):
                    bad(name, f"must be finite, got {v}")
                setattr(self, name, f)

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            number(name, integer=True)
            int64(name, getattr(self, name))
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            number(name)
        if self.max_new_tokens < 0:
            bad("max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            bad("min_new_tokens", f"must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            bad(
                "min_new_tokens",
                f"must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}",
            )
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            bad(
                "temperature",
                f"must be in [0, {MAX_TEMPERATURE:.7g}] (a float32), got {self.temperature}",
            )
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            bad("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 1e-6 <= self.repetition_penalty <= 1e6:
            # near 0 (or huge), it divides (multiplies) a seen token's logit into an infinity
            bad("repetition_penalty", f"must be in [1e-06, 1e+06], got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
                bad("stop", f"must be a string or a list of strings, got {self.stop!r}")
            if any(s == "" for s in self.stop):
                bad("stop", "must not contain empty strings")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids
            ):
                bad("stop_token_ids", f"must be a list of integers, got {self.stop_token_ids!r}")
            for t in self.stop_token_ids:
                int64("stop_token_ids", t)
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.seed is not None:
            int64("seed", self.seed)
        if self.n < 1:
            bad("n", f"must be >= 1, got {self.n}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be a boolean, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        # below SAMPLING_EPS the logits divided by the temperature overflow (float32): greedy
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class FinishKind(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    # the request moved to another decode server (pdserve/disagg/migration.py); the front end
    # relays that server's stream, so no client ever sees this kind
    MIGRATED = "migrated"


@dataclass
class FinishReason:
    kind: FinishKind
    matched: Any = None  # the stop token id or stop string that ended it
    message: Optional[str] = None  # for aborts: why
    status_code: Optional[int] = None  # for aborts: the HTTP status that reflects the cause

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.kind.value}
        if self.kind == FinishKind.LENGTH:
            d["length"] = self.matched
        elif self.matched is not None:
            d["matched"] = self.matched
        if self.message is not None:
            d["message"] = self.message
        if self.status_code is not None:
            d["status_code"] = self.status_code
        return d


class PDFields(msgspec.Struct):
    """Where a disaggregated request's KV comes from or goes, from the router's fields."""

    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None
    routed_dp_rank: Optional[int] = None  # the attention-DP group that serves it
    disagg_prefill_dp_rank: Optional[int] = None  # decode: the prefill DP group holding its KV


class Generation(msgspec.Struct, kw_only=True):
    """What a request asks to generate: the fields every record of a request carries (the
    scheduler's ``RequestSpec``, a moved request's ``MigrateIn``; ``Req.generation`` gives them
    back)."""

    input_ids: list[int]
    sampling_params: dict[str, Any]  # SamplingParams.to_dict()
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    # routed experts of every token from routed_experts_start_len
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    grammar: Optional[GrammarSpec] = None  # what the output must match (pdserve/grammar)
    grammar_start_after: Optional[list[int]] = None  # the end-of-reasoning tokens it starts after
    # its place in the waiting queue under --enable-priority-scheduling (None: 0)
    priority: Optional[int] = None
    # the LoRA adapter it runs under (its name; None: the base model)
    lora_name: Optional[str] = None
    # images whose placeholder tokens the prompt holds, in prompt order (a vision-language model)
    images: Optional[list[ImageInput]] = None


class RequestSpec(Generation, kw_only=True):
    """One generation request as validated: what the scheduler is asked to run."""

    rid: str
    stream: bool = False
    pd: PDFields = msgspec.field(default_factory=PDFields)
    # a request moved here from another decode (``POST /migrate``): the output it had produced
    # before its last token (that one arrives with the KV, in the metadata row)
    resume_output_ids: Optional[list[int]] = None


class PDState:
    """What the PD queues keep for a request while it is theirs (``disagg/prefill.py``'s and
    ``disagg/decode.py``'s subclasses: its KV sender or receiver, metadata slot, ...)."""


@dataclass
class KVSlots:
    """Where a request's KV lives, per cache group (``engine/kv_cache.py`` owns every change).

    ``pages[g]`` lists a paged group's page of each logical page of ``all_ids[:kv_len]`` (and of
    the tokens being computed), in order; 0 where the group no longer keeps that page (it slid
    out of a window). A per-request group (a recurrent state) holds ``[slot]``, or
    ``[slot, snapshot]`` with the prefix cache on. The first ``cached`` logical pages belong to
    the radix cache (locked through ``node``) in every paged group the tree keys; the rest are
    owned by the request until it finishes or is retracted. ``live_from[g]``: pages before it
    have been dropped from group g. ``anchor``: the paged group that counts the logical pages
    (``engine/cache_policy.py``).
    """

    pages: list[list[int]]
    cached: int = 0
    node: Any = None
    live_from: list[int] = field(default_factory=list)
    anchor: int = 0
    # where this server began computing the sequence (a hit's end, decode's prompt length): a
    # state snapshot taken past it is the sequence's own
    computed_from: int = 0
    # the prefix-cache namespace the KV was computed in (``CausalLM.prefix_namespace``)
    namespace: int = 0
    # positions whose KV a speculative draft model also holds in these pages (its layers share
    # the page ids); None: no draft model. The prefix cache takes pages only up to it.
    draft_len: Optional[int] = None

    @property
    def num_pages(self) -> int:
        return len(self.pages[self.anchor]) if self.pages else 0


@dataclass(eq=False)
class Req:
    """One generation request as the scheduler sees it.

    KV ownership: ``kv`` (a ``KVSlots``, None while it holds nothing) says which pages of each
    cache group hold ``all_ids[:kv_len]``; only the KV cache manager changes it.
    """

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    stream: bool = False
    # routed experts of every token run from this position on (engine/routed_experts.py)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # disaggregation (set by the front end from the router's fields)
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None
    prefill_dp_rank: Optional[int] = (
        None  # decode: the prefill DP group holding its KV (None: ask bootstrap)
    )
    arrival_time: float = 0.0
    # constrained decoding: what the output must match (a pdserve.grammar.GrammarSpec) and the
    # end-of-reasoning token ids after which it starts (None: from the first token)
    grammar_spec: Any = None
    grammar_start_after: Optional[list[int]] = None
    priority: int = 0  # the waiting queue's order under --enable-priority-scheduling
    # LoRA (pdserve/lora/): the adapter's name, its slot in the forward (-1: the base model) and
    # its prefix-cache namespace key (0: the base model's), set by the scheduler on arrival
    lora_name: Optional[str] = None
    lora_slot: int = -1
    lora_key: int = 0
    # images (engine/images.py): what the prompt's placeholders show, the prompt's multimodal
    # RoPE positions [3, prompt_len] (None: a token's slot on every axis) and the shift of every
    # position past the prompt, and each image's embeddings while its tokens are computed
    images: Optional[list[ImageInput]] = None
    rope_positions: Any = None
    rope_delta: int = 0
    image_embeds: dict = field(default_factory=dict)

    output_ids: list[int] = field(default_factory=list)
    resumed: bool = False  # moved here mid-generation: ``output_ids`` came with it
    finish_reason: Optional[FinishReason] = None
    # KV state
    kv: Optional[KVSlots] = None
    kv_len: int = 0  # tokens of all_ids whose KV is in the pool
    cached_tokens: int = 0  # prefix tokens reported as cache hits (first admission)
    num_retractions: int = 0
    # logprobs
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_logprobs: list[tuple[Optional[float], int]] = field(default_factory=list)
    input_top_logprobs: list[Optional[list[tuple[float, int]]]] = field(default_factory=list)
    routed_experts: Optional[bytes] = None  # set when it finishes (return_routed_experts)
    # sampling state
    generator: Any = None
    grammar: Any = None  # pdserve.grammar.request_grammar.RequestGrammar, made by the scheduler
    input_logprobs_done: bool = False
    # speculative decoding (engine/speculative/): this step's drafts, the request's drafting state
    # (``SpecState``), verify steps run and drafts accepted; ``draft_parents``: a tree's shape,
    # each draft's parent in the row (0: the row's token, j: draft j - 1); None: a chain
    drafts: list[int] = field(default_factory=list)
    draft_parents: Optional[list[int]] = None
    spec: Any = None
    spec_verify_ct: int = 0
    spec_accepted: int = 0
    # what the front end has been sent so far
    sent_output_len: int = 0
    sent_input_logprobs: bool = False
    # disaggregation state (sender/receiver, metadata slot), owned by the PD queues
    disagg: Optional["PDState"] = None
    # event -> wall-clock time it first happened here (server/timeline.py names the events)
    timeline: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec: RequestSpec) -> "Req":
        """The engine's request for ``spec`` (ValueError naming a bad sampling parameter)."""
        return cls(
            rid=spec.rid,
            input_ids=spec.input_ids,
            sampling=SamplingParams.from_dict(spec.sampling_params),
            return_logprob=spec.return_logprob,
            top_logprobs_num=spec.top_logprobs_num,
            logprob_start_len=spec.logprob_start_len,
            stream=spec.stream,
            return_routed_experts=spec.return_routed_experts,
            routed_experts_start_len=spec.routed_experts_start_len,
            bootstrap_host=spec.pd.bootstrap_host,
            bootstrap_port=spec.pd.bootstrap_port,
            bootstrap_room=spec.pd.bootstrap_room,
            prefill_dp_rank=spec.pd.disagg_prefill_dp_rank,
            grammar_spec=spec.grammar,
            grammar_start_after=spec.grammar_start_after,
            priority=spec.priority or 0,
            lora_name=spec.lora_name,
            images=spec.images,
            output_ids=list(spec.resume_output_ids or []),
            resumed=spec.resume_output_ids is not None,
        )

    def generation(self) -> Generation:
        """What this request asks to generate, as ``from_spec`` took it."""
        return Generation(
            input_ids=self.input_ids,
            sampling_params=self.sampling.to_dict(),
            return_logprob=self.return_logprob,
            top_logprobs_num=self.top_logprobs_num,
            logprob_start_len=self.logprob_start_len,
            return_routed_experts=self.return_routed_experts,
            routed_experts_start_len=self.routed_experts_start_len,
            grammar=self.grammar_spec,
            grammar_start_after=self.grammar_start_after,
            priority=self.priority,
            lora_name=self.lora_name,
            images=self.images,
        )

    def mark(self, event: str) -> None:
        self.timeline.setdefault(event, time.time())

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def cache_ids(self) -> list[int]:
        """``all_ids`` as the prefix cache keys them: an image's placeholder tokens stand for
        that image (``ImageInput.cache_key``), so only the same image at the same place hits."""
        if not self.images:
            return self.all_ids
        ids = self.all_ids
        for image in self.images:
            ids[image.offset : image.end] = [image.cache_key] * image.tokens
        return ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def extend_len(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.seq_len - self.kv_len

    @property
    def effective_logprob_start(self) -> int:
        if not self.return_logprob:
            return self.prompt_len
        if self.logprob_start_len < 0:
            return self.prompt_len - 1 if self.prompt_len > 0 else 0
        return min(self.logprob_start_len, self.prompt_len - 1)
