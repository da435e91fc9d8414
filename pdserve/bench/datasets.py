"""Benchmark workloads: ``random``, ``sharegpt`` and ``generated-shared-prefix``.

Every sampler is deterministic under its seed (one ``numpy.random.default_rng(seed)`` each).

How prompts are built from token ids (random and generated-shared-prefix):
- with ``--tokenizer``: ids are drawn from the tokenizer's base vocabulary minus its special
  tokens and decoded to text. ``prompt_len`` is the number of ids drawn; re-tokenizing the text
  can differ by a few tokens, so the client reports the server's prompt count when it sends one.
- without a tokenizer, for the ``sglang`` backend: the ids themselves are sent as ``input_ids``
  (exact lengths), drawn from ``[0, --random-vocab-size)`` so they are valid for small models.
- without a tokenizer, for the OpenAI backends (which take text): each id becomes one word of a
  list of common English words, joined by spaces. Such words are one token each in the usual BPE
  vocabularies, so ``prompt_len`` (the word count) is close to the token count, not exact.

ShareGPT lengths are counted in tokens with a tokenizer, else in words.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

logger = logging.getLogger(__name__)

DATASETS = ("random", "sharegpt", "generated-shared-prefix", "multi-turn")

# Common words that are a single token (with their leading space) in GPT-2/Llama-style vocabularies.
COMMON_WORDS = (
    "the of and to in is was for that on as with by he at from his it an were are which this be "
    "or has had not but first one their its new after who they have her she two been other when "
    "there all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made"
).split()

Prompt = Union[str, list[int]]


@dataclass
class BenchRequest:
    """One request to send. Requests of one ``session`` are sent one after another in ``turn``
    order; sessions start independently (at their arrival times)."""

    prompt: Prompt
    prompt_len: int
    output_len: int
    session: int = 0
    turn: int = 0
    # multi-turn chat: the prompt sent is the conversation so far (the previous turn's prompt and
    # the answer it got) followed by ``prompt``, after ``think_time`` seconds
    follows_history: bool = False
    think_time: float = 0.0


class PromptRenderer:
    """Turns token-id segments into what is sent (see the module docstring for the three modes)."""

    def __init__(self, tokenizer: Any = None, as_ids: bool = False, vocab_size: int = 256):
        self.tokenizer = tokenizer
        self.as_ids = as_ids and tokenizer is None
        if tokenizer is not None:
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
            self.token_ids = np.array([i for i in range(tokenizer.vocab_size) if i not in special])
        else:
            if vocab_size < 1:
                raise ValueError(f"random_vocab_size: must be >= 1, got {vocab_size}")
            self.token_ids = np.arange(vocab_size)

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(i) for i in rng.choice(self.token_ids, size=int(n))]

    def render(self, segments: Sequence[list[int]]) -> Prompt:
        """Concatenate segments; the text of a prefix of segments is a prefix of the text."""
        if self.as_ids:
            return [i for seg in segments for i in seg]
        if self.tokenizer is not None:
            return "".join(self.tokenizer.decode(seg) for seg in segments)
        return " ".join(COMMON_WORDS[i % len(COMMON_WORDS)] for seg in segments for i in seg)


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """``n`` integers uniform in ``[max(1, int(range_ratio * length)), length]``."""
    if length < 1:
        raise ValueError(f"length: must be >= 1, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"random_range_ratio: must be in [0, 1], got {range_ratio}")
    low = max(1, int(range_ratio * length))
    return rng.integers(low, length + 1, size=n)


def sample_random(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    renderer: PromptRenderer,
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    return [
        BenchRequest(renderer.render([renderer.draw(rng, n_in)]), int(n_in), int(n_out), session=i)
        for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens))
    ]


def sample_generated_shared_prefix(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    num_turns: int,
    seed: int,
    renderer: PromptRenderer,
) -> list[BenchRequest]:
    """``num_groups`` system prompts, each shared by ``prompts_per_group`` sessions of
    ``num_turns`` turns. Turn t of a session is its turn t-1 prompt plus one more question (the
    model's previous answer is not spliced in, so every prompt and its length is fixed by the
    seed). Sessions are shuffled so that groups interleave; ``--num-prompts`` is not used."""
    for name, v in (
        ("gsp_num_groups", num_groups),
        ("gsp_prompts_per_group", prompts_per_group),
        ("gsp_num_turns", num_turns),
        ("gsp_output_len", output_len),
    ):
        if v < 1:
            raise ValueError(f"{name}: must be >= 1, got {v}")
    rng = np.random.default_rng(seed)
    sessions: list[list[tuple[list[list[int]], int]]] = []
    for _ in range(num_groups):
        system = renderer.draw(rng, system_prompt_len)
        for _ in range(prompts_per_group):
            segments, turns = [system], []
            for _ in range(num_turns):
                segments = segments + [renderer.draw(rng, question_len)]
                turns.append((segments, system_prompt_len + question_len * (len(segments) - 1)))
            sessions.append(turns)
    order = rng.permutation(len(sessions))
    return [
        BenchRequest(renderer.render(segs), n_in, output_len, session=s, turn=t)
        for s, idx in enumerate(order)
        for t, (segs, n_in) in enumerate(sessions[idx])
    ]


def sample_multi_turn(
    num_sessions: int,
    num_turns: int,
    system_len: int,
    user_len: int,
    output_len: int,
    think_time: float,
    range_ratio: float,
    seed: int,
    renderer: PromptRenderer,
) -> list[BenchRequest]:
    """Chat sessions of ``num_turns`` turns: turn 0 sends a system prompt of ``system_len`` tokens
    and a user message; every later turn sends the whole conversation so far (earlier prompts and
    the server's real answers) plus a new user message, ``think_time`` seconds after the previous
    answer. User message lengths are uniform in [range_ratio * user_len, user_len]."""
    for name, v in (
        ("mt_num_sessions", num_sessions),
        ("mt_num_turns", num_turns),
        ("mt_user_len", user_len),
        ("mt_output_len", output_len),
    ):
        if v < 1:
            raise ValueError(f"{name}: must be >= 1, got {v}")
    if system_len < 0 or think_time < 0:
        raise ValueError("mt_system_len and mt_think_time: must be >= 0")
    rng = np.random.default_rng(seed)
    out = []
    for s in range(num_sessions):
        lens = sample_lengths(rng, num_turns, user_len, range_ratio)
        system = renderer.draw(rng, system_len) if system_len else []
        for t, n in enumerate(lens):
            segs = [system, renderer.draw(rng, n)] if t == 0 else [renderer.draw(rng, n)]
            out.append(
                BenchRequest(
                    renderer.render(segs),
                    int(n) + (system_len if t == 0 else 0),
                    output_len,
                    session=s,
                    turn=t,
                    follows_history=t > 0,
                    think_time=think_time,
                )
            )
    return out


def sample_sharegpt(
    path: str,
    num_prompts: int,
    seed: int,
    tokenizer: Any = None,
    fixed_output_len: Optional[int] = None,
    context_len: int = 2048,
) -> list[BenchRequest]:
    """First human turn as the prompt, the reply after it gives the output length.

    Like bench_serving, conversations are shuffled, then a pair is dropped when the prompt or the
    reply is under 4 tokens (the reply check is skipped with a fixed output length), the prompt
    is over 1024 tokens, or prompt + output exceeds ``context_len``."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        for i in range(len(turns) - 1):
            if turns[i].get("from") == "human" and turns[i + 1].get("from") == "gpt":
                pairs.append((turns[i]["value"], turns[i + 1]["value"]))
                break

    def count(text: str) -> int:
        return len(tokenizer.encode(text)) if tokenizer is not None else len(text.split())

    rng = np.random.default_rng(seed)
    out: list[BenchRequest] = []
    for idx in rng.permutation(len(pairs)):
        if len(out) == num_prompts:
            break
        prompt, reply = pairs[idx]
        prompt_len = count(prompt)
        output_len = fixed_output_len if fixed_output_len is not None else count(reply)
        if prompt_len < 4 or (fixed_output_len is None and output_len < 4):
            continue
        if prompt_len > 1024 or prompt_len + output_len > context_len:
            continue
        out.append(BenchRequest(prompt, prompt_len, output_len, session=len(out)))
    if len(out) < num_prompts:
        logger.warning(
            "sharegpt: only %d of %d requested prompts pass the length filters",
            len(out),
            num_prompts,
        )
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer name or path; without it prompts are ids or common words",
    )
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=1024)
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [ratio * len, len]",
    )
    g.add_argument(
        "--random-vocab-size",
        type=int,
        default=256,
        help="token ids are drawn from [0, N) when no tokenizer is given",
    )
    g.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="fixed output length instead of the reply's length",
    )
    g.add_argument("--sharegpt-context-len", type=int, default=2048)
    g.add_argument("--gsp-num-groups", type=int, default=64)
    g.add_argument("--gsp-prompts-per-group", type=int, default=16)
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    g.add_argument("--gsp-question-len", type=int, default=128)
    g.add_argument("--gsp-output-len", type=int, default=256)
    g.add_argument("--gsp-num-turns", type=int, default=1)
    g.add_argument("--mt-num-sessions", type=int, default=32, help="multi-turn: conversations")
    g.add_argument("--mt-num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    g.add_argument(
        "--mt-system-len", type=int, default=256, help="multi-turn: system prompt tokens"
    )
    g.add_argument(
        "--mt-user-len", type=int, default=128, help="multi-turn: tokens per user message"
    )
    g.add_argument("--mt-output-len", type=int, default=128, help="multi-turn: tokens per answer")
    g.add_argument(
        "--mt-think-time",
        type=float,
        default=0.0,
        help="multi-turn: seconds between an answer and the next user message",
    )


def load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def get_dataset(args: argparse.Namespace, tokenizer: Any = None) -> list[BenchRequest]:
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {args.num_prompts}")
    renderer = PromptRenderer(
        tokenizer, as_ids=args.backend == "sglang", vocab_size=args.random_vocab_size
    )
    if args.dataset_name == "random":
        return sample_random(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
            renderer,
        )
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("dataset_path: required for --dataset-name sharegpt")
        return sample_sharegpt(
            args.dataset_path,
            args.num_prompts,
            args.seed,
            tokenizer,
            args.sharegpt_output_len,
            args.sharegpt_context_len,
        )
    if args.dataset_name == "multi-turn":
        return sample_multi_turn(
            args.mt_num_sessions,
            args.mt_num_turns,
            args.mt_system_len,
            args.mt_user_len,
            args.mt_output_len,
            args.mt_think_time,
            args.random_range_ratio,
            args.seed,
            renderer,
        )
    return sample_generated_shared_prefix(
        args.gsp_num_groups,
        args.gsp_prompts_per_group,
        args.gsp_system_prompt_len,
        args.gsp_question_len,
        args.gsp_output_len,
        args.gsp_num_turns,
        args.seed,
        renderer,
    )
