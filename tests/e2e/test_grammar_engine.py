"""Constrained decoding in the engine: greedy tokens under a grammar equal a reference masked
decoding (HF transformers' logits, masks from the grammar engine driven directly), for both
engines; constrained and free requests share steps and each gets its tokens alone; bad grammars
are refused and leak nothing."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.grammar import GrammarSpec, make_backend
from tests.e2e.test_engine import hf_model, make_engine
from tests.helpers.checkpoints import build_tiny_checkpoint

torch.set_num_threads(1)

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "rank", "tags", "inner"],
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "rank": {"enum": ["low", "mid", "high"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "inner": {
            "type": "object",
            "additionalProperties": False,
            "required": ["ok"],
            "properties": {"ok": {"type": "boolean"}},
        },
    },
}
PROMPTS = ["The capital of France is", "Give me JSON:", "A robot walks into a bar and"]
MAX_NEW = 80


@pytest.fixture(scope="module")
def path() -> str:
    return build_tiny_checkpoint("llama")


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def engine(request, path):
    eng = make_engine(path, grammar_backend=request.param, chunked_prefill_size=8, page_size=4)
    yield eng
    eng.check_integrity()


def reference_masked_greedy(
    path: str, backend_name: str, spec: GrammarSpec, ids: list[int]
) -> list[int]:
    """Greedy decoding with HF's full forward at every step and the engine's mask: disallowed
    tokens -inf, argmax, advance, until the grammar ends, EOS, or MAX_NEW tokens."""
    from transformers import AutoTokenizer

    model = hf_model(path)
    tok = AutoTokenizer.from_pretrained(path)
    vocab = model.config.vocab_size
    eos = {tok.eos_token_id}
    backend = make_backend(
        backend_name, tok, vocab, eos
    )  # a fresh engine: no state shared with the server's
    matcher = backend.matcher(spec)
    out: list[int] = []
    bitmask = torch.empty(1, (vocab + 31) // 32, dtype=torch.int32)
    with torch.no_grad():
        while len(out) < MAX_NEW:
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
            matcher.fill(bitmask, 0)
            allowed = ((bitmask[0].unsqueeze(-1) >> torch.arange(32)) & 1).view(-1)[:vocab].bool()
            t = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            out.append(t)
            assert matcher.accept(t)
            if t in eos or matcher.terminated:
                break
    return out


GRAMMARS = {
    "json_schema": GrammarSpec("json_schema", json.dumps(SCHEMA)),
    "json_object": GrammarSpec("json_object"),
    "regex": GrammarSpec("regex", r"(yes|no|maybe), [0-9]{1,3} (apples|pears)"),
    "ebnf": GrammarSpec(
        "ebnf",
        'root ::= "answer: " item (", " item)? (", " item)?\nitem ::= [a-z] [a-z]? [a-z]? | [0-9] '
        "[0-9]?",
    ),
}


def _params(spec: GrammarSpec) -> dict:
    key = {"json_object": "json_schema"}.get(spec.kind, spec.kind)
    value = '{"type": "object"}' if spec.kind == "json_object" else spec.value
    return {"max_new_tokens": MAX_NEW, "temperature": 0, key: value}


@pytest.mark.parametrize("kind", ["json_schema", "regex", "ebnf"])
def test_constrained_greedy_matches_reference_masked_decoding(engine, path, kind):
    spec = GRAMMARS[kind]
    name = engine.server_args.grammar_backend
    for prompt in PROMPTS[:2]:
        ids = engine.tokenizer.encode(prompt)
        out = engine.generate(input_ids=ids, sampling_params=_params(spec))
        assert out["output_ids"] == reference_masked_greedy(path, name, spec, ids), (kind, prompt)
        if kind == "json_schema":
            import jsonschema

            jsonschema.validate(json.loads(out["text"]), SCHEMA)
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_mixed_batch_gives_each_request_its_tokens_alone(engine):
    params = [
        _params(GRAMMARS["json_schema"]),
        {"max_new_tokens": 24, "temperature": 0},
        _params(GRAMMARS["regex"]),
        _params(GRAMMARS["json_object"]),
        {"max_new_tokens": 24, "temperature": 0.8, "seed": 7},
        _params(GRAMMARS["ebnf"]),
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    together = engine.generate(prompt=prompts, sampling_params=params)
    for prompt, p, out in zip(prompts, params, together):
        alone = engine.generate(prompt=prompt, sampling_params=p)
        assert out["output_ids"] == alone["output_ids"], p
    json.loads(together[0]["text"])
    assert isinstance(json.loads(together[3]["text"]), dict)


def test_sampled_rows_stay_in_the_grammar(engine):
    outs = engine.generate(
        prompt=PROMPTS,
        sampling_params={**_params(GRAMMARS["regex"]), "temperature": 1.0, "seed": 3},
    )
    import re

    for out in outs:
        assert re.fullmatch(GRAMMARS["regex"].value, out["text"]), out["text"]


def test_min_new_tokens_yield_to_a_complete_grammar(engine):
    """The ban on EOS until min_new_tokens cannot leave a finished grammar without a token."""
    out = engine.generate(
        prompt=PROMPTS[0], sampling_params={**_params(GRAMMARS["regex"]), "min_new_tokens": 40}
    )
    import re

    assert re.fullmatch(GRAMMARS["regex"].value, out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize(
    "params,needle",
    [
        ({"json_schema": '{"type": "objekt"}'}, "objekt"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"regex": "a(b"}, "regex"),
        ({"ebnf": "root ::= missing"}, "missing"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one"),
    ],
)
def test_bad_grammars_are_refused_naming_the_problem(engine, params, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate(prompt=PROMPTS[0], sampling_params={"max_new_tokens": 4, **params})
    engine.check_integrity()
    info = engine.scheduler.grammars.cache_info()
    assert info.get("size", 0) <= info.get("capacity", 1)


def test_a_schema_is_compiled_once(engine):
    before = engine.scheduler.grammars.cache_info().get("misses", 0)
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"k": {"type": "integer"}},
            "required": ["k"],
            "additionalProperties": False,
        }
    )
    for _ in range(3):
        engine.generate(
            prompt=PROMPTS[1],
            sampling_params={"max_new_tokens": 16, "temperature": 0, "json_schema": schema},
        )
    assert engine.scheduler.grammars.cache_info()["misses"] == before + 1


def test_the_grammar_starts_after_the_reasoning_ends(engine):
    """With ``grammar_start_after`` (a reasoning model's end-of-thinking tokens) the output is
    free until those tokens, then follows the grammar. The free run's first two tokens stand in
    for the marker, so the random model does produce it."""
    import re

    from pdserve.engine.request import Req, SamplingParams

    ids = engine.tokenizer.encode(PROMPTS[0])
    free = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2, "temperature": 0})[
        "output_ids"
    ]
    req = Req(
        rid="gated",
        input_ids=ids,
        sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=0),
        grammar_spec=GRAMMARS["regex"],
        grammar_start_after=free,
    )
    engine.scheduler.add_request(req)
    while not req.finished:
        engine.scheduler.step()
    assert req.output_ids[:2] == free
    answer = engine.tokenizer.decode(req.output_ids[2:], skip_special_tokens=True)
    assert re.fullmatch(GRAMMARS["regex"].value, answer), answer
    assert req.finish_reason.kind.value == "stop"
