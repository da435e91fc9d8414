"""Request state of the front end: tokenize and validate, send to the scheduler, gather outputs.

One ``ReqState`` per generation (a request with ``n`` samples or a batch has several). Outputs
arrive from the scheduler's receive loop into ``ReqState.pending``; the HTTP handler that owns
the state drains them in ``updates()``, which detokenizes and keeps the cumulative result. A
handler that stops iterating before the finish (client gone, task cancelled) aborts the
request in the scheduler.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

from pdserve import tracing
from pdserve.chat_template import ChatTemplateError, chat_input_ids, load_template
from pdserve.engine.request import PDFields, SamplingParams
from pdserve.grammar import GrammarSpec, backend_class
from pdserve.lora_args import parse_lora_paths
from pdserve.multimodal.args import image_limits
from pdserve.multimodal.images import load_images
from pdserve.multimodal.inputs import ImageInput
from pdserve.routed_experts_args import refusal as routed_experts_refusal
from pdserve.server.constraints import grammar_of_sampling
from pdserve.server.detokenizer import IncrementalDetokenizer
from pdserve.server.errors import bad_request
from pdserve.server.messages import AbortReq, GenerateReq, TokenOut, encode
from pdserve.server.metrics import ServerMetrics
from pdserve.server.reasoning_parser import reasoning_parser, think_end_text
from pdserve.server.scheduler_client import SchedulerClient
from pdserve.server.timeline import spans, stages
from pdserve.server.tool_parser import tool_parser
from pdserve.tracing import Tracing

logger = logging.getLogger(__name__)

MAX_N = 64


@dataclass
class ReqSpec:
    """One generation, validated, before it is sent: the front end's form of ``RequestSpec``
    (a request with ``n`` samples is one spec whose rooms and ranks may be lists, one per sample,
    until ``submit_all`` splits it)."""

    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    stream: bool = False
    rid: Optional[str] = None
    group_rid: Optional[str] = None  # the user's rid of a request with n > 1 samples
    no_stop_trim: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Union[int, list[int], None] = None  # an int, or one room per sample
    routed_dp_rank: Union[int, list[int], None] = (
        None  # the attention-DP group to run in (or one per sample)
    )
    disagg_prefill_dp_rank: Union[int, list[int], None] = (
        None  # decode: prefill's DP group holding the KV
    )
    grammar: Optional[GrammarSpec] = (
        None  # what the output must match (checked by the grammar engine)
    )
    grammar_start_after: Optional[list[int]] = (
        None  # the end-of-reasoning token ids it starts after
    )
    resume_output_ids: Optional[list[int]] = None  # moved here mid-generation (POST /migrate)
    priority: Optional[int] = None  # the waiting queue's order (--enable-priority-scheduling)
    lora_name: Optional[str] = None  # the LoRA adapter it runs under (None: the base model)
    images: Optional[list[ImageInput]] = None  # what the prompt's image placeholders show

    def message(self, dp_group: Optional[int]) -> GenerateReq:
        """The scheduler's message for this generation (one sample: its room and ranks)."""
        return GenerateReq(
            rid=self.rid,
            input_ids=self.input_ids,
            sampling_params=self.sampling.to_dict(),
            return_logprob=self.return_logprob,
            top_logprobs_num=self.top_logprobs_num,
            logprob_start_len=self.logprob_start_len,
            stream=self.stream,
            return_routed_experts=self.return_routed_experts,
            routed_experts_start_len=self.routed_experts_start_len,
            grammar=self.grammar,
            grammar_start_after=self.grammar_start_after,
            resume_output_ids=self.resume_output_ids,
            priority=self.priority,
            lora_name=self.lora_name,
            images=self.images,
            pd=PDFields(
                bootstrap_host=self.bootstrap_host,
                bootstrap_port=self.bootstrap_port,
                bootstrap_room=_first(self.bootstrap_room),
                routed_dp_rank=dp_group,
                disagg_prefill_dp_rank=_first(self.disagg_prefill_dp_rank),
            ),
        )


class ReqState:
    def __init__(self, spec: ReqSpec, detok: IncrementalDetokenizer):
        self.spec = spec
        self.rid: str = spec.rid
        self.detok = detok
        self.output_ids: list[int] = []
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.input_token_logprobs: list[tuple[Optional[float], int]] = []
        self.input_top_logprobs: list[Optional[list[tuple[float, int]]]] = []
        self.finish_reason: Optional[dict[str, Any]] = None
        self.routed_experts: Optional[bytes] = None  # with the finish, when the spec asked
        self.prompt_tokens = len(spec.input_ids)
        self.cached_tokens = 0
        self.spec_verify_ct = 0  # speculative decoding: verify steps and accepted drafts
        self.spec_accepted = 0
        self.pending: list[TokenOut] = []
        self.event = asyncio.Event()
        self.created = time.monotonic()
        self.last_output: Optional[float] = None
        self.dp_rank: Optional[int] = None  # the attention-DP group serving it
        self.timeline: dict[str, float] = {"received": time.time()}  # see server/timeline.py
        self.relay = None  # while it moves to another decode (server/migration_relay.py)
        self.traceparent: Optional[str] = None  # the caller's, for its spans (pdserve/tracing.py)

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def e2e_latency(self) -> float:
        return (self.last_output or time.monotonic()) - self.created


SPAN_NAMES = {"prefill": "prefill", "decode": "decode", "null": "generate"}


class TokenizerManager:
    def __init__(self, server_args, tokenizer, client: SchedulerClient, metrics: ServerMetrics):
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.client = client
        self.metrics = metrics
        info = client.info
        self.context_length: int = int(
            info.get("context_length") or server_args.context_length or 1 << 30
        )
        self.vocab_size: int = int(info.get("vocab_size") or len(tokenizer))
        # a vision-language model: its image processor, and the limits on a request's images
        self.takes_images: bool = bool(info.get("takes_images"))
        self.image_processor = self._image_processor() if self.takes_images else None
        self.image_limits = image_limits(server_args)
        self.states: dict[str, ReqState] = {}
        self.dp_size: int = int(info.get("dp_size") or 1)  # attention-DP groups of the scheduler
        self._next_group = 0
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)
        self.chat_template = load_template(server_args.chat_template)
        # the LoRA adapters served (name -> path): those of --lora-paths, then as loaded and
        # unloaded at run time (server/lora_api.py)
        self.adapters: dict[str, str] = parse_lora_paths(server_args.lora_paths)
        # unknown parser names fail the start-up, naming the choices
        if server_args.tool_call_parser:
            tool_parser(server_args.tool_call_parser, [])
        if server_args.reasoning_parser:
            reasoning_parser(server_args.reasoning_parser)
        client.on_output = self._on_output
        self.tracing = (
            Tracing(server_args.otlp_traces_endpoint, f"pdserve-{self.role}")
            if server_args.otlp_traces_endpoint
            else None
        )

    @property
    def role(self) -> str:
        """The span name of this server's part of a request (pdserve/tracing.py)."""
        return SPAN_NAMES[self.server_args.disaggregation_mode]

    # ---- input -------------------------------------------------------------------------
    def _image_processor(self):
        from pdserve.models.hf_config import load_hf_config
        from pdserve.models.multimodal import text_model_config
        from pdserve.multimodal.processor import ImageProcessor

        path = self.server_args.model_path
        return ImageProcessor(path, text_model_config(load_hf_config(path)))

    def image_inputs(
        self, input_ids: list[int], urls: list, encoders: Any = None
    ) -> tuple[list[int], list]:
        """The prompt with its image placeholders expanded for the images at ``urls`` ((url,
        field) pairs), and the images as a request carries them (their patches only where this
        server computes prompts; with ``encoders``, the encoder servers that compute their
        embeddings, in turn); 400 naming a bad image."""
        if not urls and self.image_processor is None:
            return input_ids, []
        computes = self.server_args.disaggregation_mode != "decode"
        if encoders is not None and computes:
            if not isinstance(encoders, list) or not all(
                isinstance(a, str) and a.startswith("tcp://") for a in encoders
            ):
                raise bad_request("encoder_addrs: must be a list of tcp://host:port addresses")
        try:
            pics = load_images(urls, self.image_limits)
            ids, images = self.image_processor.expand(input_ids, pics, keep_pixels=computes)
        except ValueError as e:
            raise bad_request(str(e)) from None
        if encoders and computes:
            for i, image in enumerate(images):
                k = i % len(encoders)
                image.encoder, image.fallbacks = encoders[k], encoders[k + 1 :] + encoders[:k]
        return ids, images

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def chat_input_ids(
        self,
        messages: list[dict],
        continue_final_message: bool = False,
        tools: Optional[list[dict]] = None,
        template_kwargs: Optional[dict] = None,
    ) -> list[int]:
        try:
            return chat_input_ids(
                self.tokenizer,
                messages,
                continue_final_message,
                tools,
                template_kwargs,
                self.chat_template,
            )
        except ChatTemplateError as e:
            raise bad_request(str(e)) from None

    # ---- reasoning (server/reasoning_parser.py) ------------------------------------------
    def opens_reasoning(self, parser: str, input_ids: list[int]) -> bool:
        """Whether the prompt ends inside the reasoning (the template opened it, as DeepSeek-R1's
        does), so the output starts as reasoning."""
        p = reasoning_parser(parser)
        tail = self.tokenizer.decode(input_ids[-16:], skip_special_tokens=False)
        return p.always_forced or bool(p.start) and tail.rstrip().endswith(p.start)

    @functools.lru_cache(maxsize=16)  # noqa: B019 (one manager per process)
    def reasoning_end_ids(self, parser: str) -> Optional[list[int]]:
        """The tokens that end the reasoning: a grammar starts after them."""
        text = think_end_text(parser)
        return self.tokenizer.encode(text, add_special_tokens=False) if text else None

    def check_adapter(self, name: str) -> None:
        """400 naming ``name`` unless it is a LoRA adapter this server serves."""
        if not self.server_args.enable_lora:
            raise bad_request(
                f"lora_path: {name!r}: this server serves no LoRA adapters (--enable-lora)"
            )
        if name not in self.adapters:
            have = ", ".join(sorted(self.adapters)) or "none"
            raise bad_request(f"lora_path: LoRA adapter {name!r} is not loaded (loaded: {have})")

    def check_grammar(self, spec: GrammarSpec) -> GrammarSpec:
        """``spec`` if the grammar engine takes it, else a 400 naming the problem (cached)."""
        why = self._grammar_error(spec)
        if why:
            raise bad_request(why)
        return spec

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one manager per process)
    def _grammar_error(self, spec: GrammarSpec) -> str:
        name = self.server_args.grammar_backend
        if name == "none":
            return (
                "this server has no grammar engine (--grammar-backend none): "
                "structured outputs are not available"
            )
        try:
            backend_class(name).validate(spec)
        except ValueError as e:
            return str(e)
        return ""

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def make_spec(
        self,
        prompt: str | list[int],
        sampling: dict[str, Any],
        *,
        default_max_new_tokens: Optional[int],
        **fields: Any,
    ) -> ReqSpec:
        """Tokenize ``prompt`` and validate everything; raises ``APIError`` (400) naming the
        problem.

        ``default_max_new_tokens`` applies when ``sampling`` has no ``max_new_tokens``; None
        means "the rest of the context". (The scheduler caps any value at the rest of the
        context, as the offline engine does.)
        """
        input_ids = self.tokenize(prompt) if isinstance(prompt, str) else prompt
        if not input_ids:
            raise bad_request("prompt is empty")
        bad = next((t for t in input_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"input_ids: token id {bad} is out of range [0, {self.vocab_size})")
        room = self.context_length - len(input_ids)
        if room <= 0:
            raise bad_request(
                f"prompt is too long: {len(input_ids)} tokens, "
                f"the context length is {self.context_length}"
            )
        sampling = dict(sampling)
        grammar = grammar_of_sampling(sampling, fields.get("grammar"))
        if grammar is not None:
            fields["grammar"] = self.check_grammar(grammar)
        if sampling.get("max_new_tokens") is None:
            default = room if default_max_new_tokens is None else default_max_new_tokens
            sampling["max_new_tokens"] = min(default, room)
        try:
            params = SamplingParams.from_dict(sampling)
        except (ValueError, TypeError) as e:
            raise bad_request(f"sampling_params: {e}") from None
        if params.n > MAX_N:
            raise bad_request(f"n: must be <= {MAX_N}, got {params.n}")
        if (
            fields.get("priority") is not None
            and self.server_args.abort_on_priority_when_disabled
            and not self.server_args.enable_priority_scheduling
        ):
            raise bad_request(
                "priority: this server does not schedule by priority "
                "(--enable-priority-scheduling is off)"
            )
        if fields.get("lora_name") is not None and self.server_args.disaggregation_mode == "null":
            # (a prefill or decode leaves the check to its scheduler, whose refusal also ends
            # the request's room on the peer, which would wait for it otherwise)
            self.check_adapter(fields["lora_name"])
        if fields.get("return_routed_experts"):
            why = routed_experts_refusal(
                self.server_args,
                self.client.info.get("routed_experts"),
                fields.get("routed_experts_start_len", 0),
                len(input_ids),
            )
            if why:
                raise bad_request(why)
        return ReqSpec(input_ids=list(input_ids), sampling=params, **fields)

    # ---- requests ----------------------------------------------------------------------
    def submit(self, spec: ReqSpec) -> ReqState:
        """Register and send one generation (``spec.sampling.n`` must be 1 here)."""
        spec.rid = spec.rid or uuid.uuid4().hex
        if spec.rid in self.states:
            raise bad_request(f"rid: {spec.rid!r} is already in use by a running request")
        p = spec.sampling
        group = self._dp_group(spec)
        state = ReqState(
            spec,
            IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=p.skip_special_tokens,
                stop=p.stop,
                trim_stop=not spec.no_stop_trim,
            ),
        )
        state.dp_rank = group
        state.traceparent = tracing.incoming()
        try:  # validation should have caught whatever cannot cross; this names what slipped through
            data = encode(spec.message(group))
        except (OverflowError, UnicodeEncodeError, TypeError) as e:
            raise bad_request(f"request cannot be passed to the scheduler: {e}") from None
        self.states[spec.rid] = state  # registered only once nothing can fail before it is sent
        self.client.send(data)
        logger.debug(
            "rid=%s submitted: prompt_tokens=%d max_new_tokens=%d",
            spec.rid,
            len(spec.input_ids),
            p.max_new_tokens,
        )
        return state

    def _dp_group(self, spec: ReqSpec) -> Optional[int]:
        """The attention-DP group of a request: the one it names, else the one with the fewest
        requests in flight (ties in turn). None without DP attention."""
        named = _first(spec.routed_dp_rank)
        if self.dp_size == 1:
            if named not in (None, 0):
                raise bad_request(
                    f"routed_dp_rank: this server has one data-parallel group (0), got {named}"
                )
            return None
        if named is not None:
            if not 0 <= named < self.dp_size:
                raise bad_request(f"routed_dp_rank: must be in [0, {self.dp_size}), got {named}")
            return named
        load = [0] * self.dp_size
        for st in self.states.values():
            if st.dp_rank is not None and not st.finished:
                load[st.dp_rank] += 1
        least = min(load)
        order = [(self._next_group + k) % self.dp_size for k in range(self.dp_size)]
        group = next(g for g in order if load[g] == least)
        self._next_group = (group + 1) % self.dp_size
        return group

    def submit_all(self, specs: list[ReqSpec]) -> list[ReqState]:
        """Submit each spec ``n`` times (sample i gets seed + i); all or nothing."""
        states: list[ReqState] = []
        try:
            for spec in specs:
                n = spec.sampling.n
                for i in range(n):
                    one = spec if n == 1 else _sample_spec(spec, i)
                    states.append(self.submit(one))
        except Exception:  # all or nothing: the samples already sent are aborted
            self.release(states, "batch rejected")
            raise
        return states

    def _on_output(self, out: TokenOut) -> None:
        state = self.states.get(out.rid)
        if state is None:
            return  # already given up by its handler
        if state.relay is not None and not state.relay.source_output(out):
            return  # the relay takes it from here
        state.pending.append(out)
        state.event.set()

    async def updates(self, state: ReqState) -> AsyncIterator[ReqState]:
        """Yield ``state`` after each batch of outputs, the last time finished."""
        try:
            while not state.finished:
                await state.event.wait()
                state.event.clear()
                outs, state.pending = state.pending, []
                for out in outs:
                    self._apply(state, out)
                yield state
        finally:
            self.release([state])

    async def wait(self, state: ReqState) -> ReqState:
        async for _ in self.updates(state):
            pass
        return state

    def _apply(self, state: ReqState, out: TokenOut) -> None:
        if state.finished:
            return
        now = time.monotonic()
        if out.new_ids:
            state.timeline.setdefault("first_token", time.time())
            first = state.last_output is None
            self.metrics.on_tokens(
                len(out.new_ids), now - (state.created if first else state.last_output), first
            )
            state.output_ids.extend(out.new_ids)
            state.detok.push(out.new_ids)
        state.last_output = now
        state.prompt_tokens = out.prompt_tokens or state.prompt_tokens
        state.cached_tokens = max(state.cached_tokens, out.cached_tokens)
        state.spec_verify_ct = max(state.spec_verify_ct, out.spec_verify_ct)
        state.spec_accepted = max(state.spec_accepted, out.spec_accepted)
        if state.spec.return_logprob:
            state.output_token_logprobs.extend(out.output_token_logprobs)
            state.output_top_logprobs.extend(out.output_top_logprobs)
            if out.input_token_logprobs is not None:
                state.input_token_logprobs = list(out.input_token_logprobs)
                state.input_top_logprobs = list(out.input_top_logprobs or [])
        if out.finish_reason is not None:
            state.finish_reason = dict(out.finish_reason)
            state.routed_experts = out.routed_experts
            state.detok.finish(state.finish_reason.get("matched"))
            state.timeline.update(out.timeline or {})
            state.timeline["finished"] = time.time()
            self.metrics.on_stages(stages(self.server_args.disaggregation_mode, state.timeline))
            if self.tracing is not None:
                self._trace(state)
            shed = state.finish_reason.get("status_code") == 429  # engine/admission.py
            self.metrics.on_finish(
                "shed" if shed else state.finish_reason.get("type", "unknown"),
                state.prompt_tokens,
                state.cached_tokens,
                state.e2e_latency,
            )
            if state.spec_verify_ct:
                self.metrics.on_speculation(state.spec_verify_ct, state.spec_accepted)
            logger.debug(
                "rid=%s finished: %s prompt_tokens=%d completion_tokens=%d e2e=%.3fs",
                state.rid,
                state.finish_reason,
                state.prompt_tokens,
                len(state.output_ids),
                state.e2e_latency,
            )

    # ---- aborts ------------------------------------------------------------------------
    def _trace(self, state: ReqState) -> None:
        spec, events = state.spec, state.timeline
        fr, room = state.finish_reason or {}, spec.bootstrap_room
        self.tracing.record(
            self.role,
            state.traceparent,
            events["received"],
            events["finished"],
            {
                "pdserve.rid": spec.rid,
                "pdserve.bootstrap_room": room if isinstance(room, int) else None,
                "pdserve.finish_reason": fr.get("type"),
                "gen_ai.request.model": self.server_args.served_model_name,
                "gen_ai.usage.input_tokens": state.prompt_tokens,
                "gen_ai.usage.output_tokens": len(state.output_ids),
                "pdserve.cached_tokens": state.cached_tokens,
            },
            spans(self.server_args.disaggregation_mode, events),
        )

    def release(self, states: list[ReqState], message: str = "client disconnected") -> None:
        """Forget ``states``; those not finished are aborted in the scheduler. Idempotent."""
        for state in states:
            if self.states.get(state.rid) is not state:
                continue
            del self.states[state.rid]
            if state.relay is not None:
                state.relay.cancel()
            if not state.finished:
                logger.debug("rid=%s aborted: %s", state.rid, message)
                self.client.send(AbortReq(rid=state.rid, message=message))

    def abort(self, rid: str) -> int:
        """Abort ``rid`` (and its samples ``rid-i``); "" aborts everything. Returns how many.

        The handlers of the aborted requests receive the scheduler's abort finish."""
        targets = [r for r, s in self.states.items() if not rid or rid in (r, s.spec.group_rid)]
        for r in targets:
            self.client.send(AbortReq(rid=r, message="aborted by /abort_request"))
        return len(targets)

    def fail_all(self, message: str, status_code: int = 503) -> None:
        """Finish every request with an error (the scheduler is gone)."""
        for state in list(self.states.values()):
            self._on_output(
                TokenOut(
                    rid=state.rid,
                    new_ids=[],
                    finish_reason={"type": "abort", "message": message, "status_code": status_code},
                )
            )


def _sample_spec(spec: ReqSpec, i: int) -> ReqSpec:
    seed = spec.sampling.seed
    seed = None if seed is None else (seed + i + 2**63) % 2**64 - 2**63  # stays an int64
    p = dataclasses.replace(spec.sampling, n=1, seed=seed)
    rid = f"{spec.rid}-{i}" if spec.rid else None
    room = spec.bootstrap_room
    room = room[i] if isinstance(room, list) else None if room is None else (room + i) % 2**63
    routed, prefill_dp = (
        v[i] if isinstance(v, list) else v
        for v in (spec.routed_dp_rank, spec.disagg_prefill_dp_rank)
    )
    return dataclasses.replace(
        spec,
        sampling=p,
        rid=rid,
        group_rid=spec.rid,
        bootstrap_room=room,
        routed_dp_rank=routed,
        disagg_prefill_dp_rank=prefill_dp,
    )


def _first(value: Union[int, list[int], None]) -> Optional[int]:
    """A per-request field that may come as one value per sample: the value of this sample."""
    return value[0] if isinstance(value, list) else value
