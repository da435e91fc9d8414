"""The official ``openai`` client against a live server; tokens compared with the offline engine."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.e2e.conftest import SERVED_MODEL_NAME

PROMPT = "In the beginning the universe was"
MESSAGES = [{"role": "user", "content": "Tell me a story about a robot."}]
MAX_TOKENS = 12


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
def async_client(live):
    return openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def offline(engine, *, prompt=None, input_ids=None, max_tokens=MAX_TOKENS, **params) -> dict:
    return engine.generate(
        prompt=prompt,
        input_ids=input_ids,
        sampling_params={"max_new_tokens": max_tokens, "temperature": 0, **params},
    )


def chat_ids(engine, messages) -> list[int]:
    text = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return engine.tokenizer.encode(text, add_special_tokens=False)


def token_texts(engine, ids: list[int]) -> list[str]:
    return [engine.tokenizer.decode([t]) for t in ids]


def test_completion_matches_offline(client, offline_engine):
    ref = offline(offline_engine, prompt=PROMPT)
    r = client.completions.create(
        model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0
    )
    choice = r.choices[0]
    assert choice.text == ref["text"]
    assert choice.logprobs.tokens == token_texts(offline_engine, ref["output_ids"])
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert r.usage.completion_tokens == MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + MAX_TOKENS
    assert r.model == SERVED_MODEL_NAME and r.object == "text_completion"


def test_completion_prompt_forms(client, offline_engine):
    ids = offline_engine.tokenizer.encode(PROMPT)
    other = "A second prompt"
    ref = [offline(offline_engine, prompt=p)["text"] for p in (PROMPT, other)]
    for prompt in ([PROMPT, other], [ids, offline_engine.tokenizer.encode(other)]):
        r = client.completions.create(
            model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert [c.index for c in r.choices] == [0, 1]
        assert [c.text for c in r.choices] == ref
    r = client.completions.create(
        model=SERVED_MODEL_NAME, prompt=ids, max_tokens=MAX_TOKENS, temperature=0
    )
    assert r.choices[0].text == ref[0]


def test_chat_matches_offline(client, offline_engine):
    ref = offline(offline_engine, input_ids=chat_ids(offline_engine, MESSAGES))
    r = client.chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref["text"]
    assert [e.token for e in choice.logprobs.content] == token_texts(
        offline_engine, ref["output_ids"]
    )
    assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert r.usage.completion_tokens == len(ref["output_ids"])


def test_chat_max_completion_tokens_and_router_extras(live, offline_engine):
    """The chat body as sglang-router forwards it: max_tokens renamed, many extra fields."""
    ref = offline(offline_engine, input_ids=chat_ids(offline_engine, MESSAGES), max_tokens=4)
    body = {
        "messages": MESSAGES,
        "model": SERVED_MODEL_NAME,
        "logprobs": False,
        "max_completion_tokens": 4,
        "temperature": 0,
        "stream": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "continue_final_message": False,
        "skip_special_tokens": True,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
    }
    r = live.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ref["text"]
    assert r.json()["usage"]["completion_tokens"] == len(ref["output_ids"])


def test_streams_sync_and_async_match_offline(client, async_client, offline_engine):
    ref_cmpl = offline(offline_engine, prompt=PROMPT)["text"]
    ref_chat = offline(offline_engine, input_ids=chat_ids(offline_engine, MESSAGES))["text"]

    chunks = list(
        client.completions.create(
            model=SERVED_MODEL_NAME,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == ref_cmpl
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    chunks = list(
        client.chat.completions.create(
            model=SERVED_MODEL_NAME,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref_chat
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0

    async def run_async():
        async with async_client:
            stream = await async_client.chat.completions.create(
                model=SERVED_MODEL_NAME,
                messages=MESSAGES,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
            )
            chat = "".join([c.choices[0].delta.content or "" async for c in stream])
            r = await async_client.completions.create(
                model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
            )
            return chat, r.choices[0].text

    assert asyncio.run(run_async()) == (ref_chat, ref_cmpl)


def test_64_concurrent_streams_match_offline(live, offline_engine):
    prompts = [f"Request number {i}: the weather today is" for i in range(64)]
    refs = offline_engine.generate(
        prompt=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    )

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str]:
        stream = await client.completions.create(
            model=SERVED_MODEL_NAME,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run_all())
    assert [t for t, _ in results] == [r["text"] for r in refs]
    assert all(f == "length" for _, f in results)


def test_n_samples_with_seed(client):
    r = client.completions.create(
        model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    again = client.completions.create(
        model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    assert r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == again.usage.prompt_tokens  # counted once per prompt


def test_stop_and_echo(client, offline_engine):
    full = offline(offline_engine, prompt=PROMPT, ignore_eos=True)
    stop = full["text"][6:9]
    ref = offline(offline_engine, prompt=PROMPT, ignore_eos=True, stop=[stop])
    r = client.completions.create(
        model=SERVED_MODEL_NAME,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stop=stop,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == PROMPT + ref["text"]
    assert r.choices[0].finish_reason == "stop"
