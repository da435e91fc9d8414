"""Images through pdserve on Qwen2.5-VL (a tiny checkpoint as its makers publish one: weights,
tokenizer with the image tokens, chat template, image processor).

- The offline engine: HF's greedy tokens and logprobs for a prompt with two images of different
  shapes, whole and in chunks that cut the images; a prefix-cache hit for the same images and a
  miss at the first different one; faults named.
- Servers: the OpenAI chat API with ``image_url`` data URLs, colocated and through PD (a prefill
  that runs the tower, a ``--language-only`` decode whose checkpoint has no tower weights, pdserve's
  router), with the same text as HF's tokens; cached tokens for a repeated image; 400s naming a bad
  image, a fetch, too many images and a placeholder miscount.
"""

from __future__ import annotations

import httpx
import pytest
import transformers

from tests.helpers import cluster as c
from tests.helpers.vision_checkpoints import (
    build_qwen2_5_vl_checkpoint,
    build_qwen3_5_vl_checkpoint,
    data_url,
    hf_vl_generate,
    hf_vl_greedy,
    hf_vl_inputs,
    png,
    without_vision_tower,
)

NEW = 8
IMAGES = [png(40, 32, 1), png(24, 56, 2)]  # 20 and 21 tokens: grids 1x8x10, 1x14x6
OTHER = png(40, 32, 3)


def chat(*parts) -> list[dict]:
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts
    ]
    return [{"role": "user", "content": content}]


TWO = chat("Look:", None, "and", None, "what differs?")


@pytest.fixture(scope="module")
def vl_path():
    return build_qwen2_5_vl_checkpoint()


@pytest.fixture(scope="module")
def reference(vl_path):
    """HF's greedy tokens and logprobs for ``TWO`` with ``IMAGES``, and the prompt's ids."""
    inputs = hf_vl_inputs(vl_path, TWO, IMAGES)
    tokens, logprobs = hf_vl_greedy(vl_path, inputs, NEW)
    return inputs["input_ids"][0].tolist(), tokens, logprobs


def _prompt_ids(path: str, messages) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def engine(vl_path):
    from pdserve.engine.engine import Engine

    return Engine(model_path=vl_path, dtype="float32", page_size=4, chunked_prefill_size=16)


GREEDY = {"temperature": 0, "max_new_tokens": NEW}


def test_engine_matches_hf_with_two_images_in_chunks(engine, vl_path, reference):
    expanded, tokens, logprobs = reference
    ids = _prompt_ids(vl_path, TWO)
    out = engine.generate(
        input_ids=ids, image_data=IMAGES, sampling_params=GREEDY, return_logprob=True
    )
    assert out["output_ids"] == tokens
    ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert ours == pytest.approx(logprobs, abs=2e-5)
    assert out["meta_info"]["prompt_tokens"] == len(expanded)
    # the images decide the tokens: another picture in the first place changes the logprobs
    other = engine.generate(
        input_ids=ids, image_data=[OTHER, IMAGES[1]], sampling_params=GREEDY, return_logprob=True
    )
    theirs = [lp for lp, _, _ in other["meta_info"]["output_token_logprobs"]]
    assert theirs != pytest.approx(ours, abs=1e-3)


@pytest.mark.parametrize(
    "messages, images",
    [
        (chat("Only words here, no picture at all."), []),
        (chat("One bigger picture:", None, "describe it."), [png(64, 48, 7)]),
    ],
    ids=["no-image", "one-image"],
)
def test_engine_matches_hf_with_zero_and_one_image(engine, vl_path, messages, images):
    tokens, logprobs = hf_vl_greedy(vl_path, hf_vl_inputs(vl_path, messages, images), NEW)
    out = engine.generate(
        input_ids=_prompt_ids(vl_path, messages),
        image_data=images or None,
        sampling_params=GREEDY,
        return_logprob=True,
    )
    assert out["output_ids"] == tokens
    ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert ours == pytest.approx(logprobs, abs=2e-5)


def test_bf16_matches_hf_bf16_up_to_ties(vl_path):
    import torch

    from pdserve.engine.engine import Engine
    from tests.e2e.test_engine_bf16 import compare

    eng = Engine(model_path=vl_path, dtype="bfloat16", page_size=4, chunked_prefill_size=16)
    compared = 0
    for messages, images in ((TWO, IMAGES), (chat("A", None, "?"), [png(64, 48, 7)])):
        inputs = hf_vl_inputs(vl_path, messages, images)
        ref = hf_vl_generate(vl_path, inputs, 12, torch.bfloat16)
        out = eng.generate(
            input_ids=_prompt_ids(vl_path, messages),
            image_data=images,
            sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
            return_logprob=True,
        )
        compared += compare(out, *ref)
    assert compared >= 12, f"only {compared} of 24 positions compared"
    assert eng.check_integrity()["in_use_pages"] == 0


def test_qwen3_5_with_images_matches_hf_colocated_and_through_pd(tmp_path_factory):
    """Qwen3.5 (Gated DeltaNet and gated attention layers, interleaved M-RoPE, the learned
    position table of its tower): HF's tokens and logprobs in chunks that cut the images, and
    the same tokens from a prefill to a decode without the tower (the layers' states and the
    attention pages moved as for text)."""
    from pdserve.engine.engine import Engine

    path = build_qwen3_5_vl_checkpoint()
    tokens, logprobs = hf_vl_greedy(path, hf_vl_inputs(path, TWO, IMAGES), NEW)
    eng = Engine(model_path=path, dtype="float32", page_size=4, chunked_prefill_size=16)
    ids = _prompt_ids(path, TWO)
    out = eng.generate(
        input_ids=ids, image_data=IMAGES, sampling_params=GREEDY, return_logprob=True
    )
    assert out["output_ids"] == tokens
    ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert ours == pytest.approx(logprobs, abs=2e-5)
    # a next turn with the same images resumes from the state snapshot past them
    turn = ids + tokens + ids[-3:]
    again = eng.generate(input_ids=turn, image_data=IMAGES, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] >= out["meta_info"]["prompt_tokens"]
    eng.shutdown()
    logs = tmp_path_factory.mktemp("vl-qwen3_5")
    p = c.prefill("P", path, logs, *COMMON)[0]
    d = c.decode("D", without_vision_tower(path), logs, *COMMON, "--language-only")
    for procs in c.running({"P": p, "D": d}):
        body = {
            "input_ids": ids,
            "image_data": [data_url(im) for im in IMAGES],
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": 5,
        }
        fp, fd = c.post_pd(procs["P"], procs["D"], body)
        assert fp.status_code == 200, fp.text
        assert fd.json()["output_ids"] == tokens
        procs["P"].wait_idle()
        procs["D"].wait_idle()


def test_prefix_cache_keys_on_the_pixels(engine, vl_path):
    ids = _prompt_ids(vl_path, TWO)
    first = engine.generate(input_ids=ids, image_data=IMAGES, sampling_params=GREEDY)
    again = engine.generate(input_ids=ids, image_data=IMAGES, sampling_params=GREEDY)
    assert again["output_ids"] == first["output_ids"]
    image_at = ids.index(engine.scheduler.runner.model.image_token_id)
    prompt = again["meta_info"]["prompt_tokens"]
    assert again["meta_info"]["cached_tokens"] >= prompt - 4  # all but the last page
    # images of the same sizes as IMAGES (the same placeholder tokens), never sent before
    first_new, second_new = png(40, 32, 4), png(24, 56, 5)
    swapped = engine.generate(
        input_ids=ids, image_data=[first_new, IMAGES[1]], sampling_params=GREEDY
    )
    assert swapped["meta_info"]["cached_tokens"] <= image_at  # no hit past the first image
    second = engine.generate(
        input_ids=ids, image_data=[IMAGES[0], second_new], sampling_params=GREEDY
    )
    assert image_at + 20 <= second["meta_info"]["cached_tokens"] < prompt - 21


def test_engine_names_a_placeholder_miscount(engine, vl_path):
    ids = _prompt_ids(vl_path, TWO)
    with pytest.raises(ValueError, match="2 image placeholder"):
        engine.generate(input_ids=ids, image_data=IMAGES[:1], sampling_params=GREEDY)


# ---- servers ----------------------------------------------------------------------------------
COMMON = [
    "--dtype",
    "float32",
    "--page-size",
    "4",
    "--chunked-prefill-size",
    "16",
    "--max-total-tokens",
    "2048",
    "--max-images-per-request",
    "3",
    "--max-image-pixels",
    "20000",
    "--served-model-name",
    "vl",
]


@pytest.fixture(scope="module")
def vl_cluster(vl_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vl")
    p = c.prefill("P", vl_path, logs, *COMMON)[0]
    d = c.decode("D", without_vision_tower(vl_path), logs, *COMMON, "--language-only")
    procs = {
        "S": c.server("S", vl_path, logs, *COMMON),
        "P": p,
        # a prefill of two TP ranks, each with the whole tower
        "P2": c.prefill("P2", vl_path, logs, *COMMON, "--tp-size", "2")[0],
        "D": d,
    }
    for _ in c.running(procs):
        r = c.router("R", [p], [d], logs)
        try:
            c.start_all([r])
            yield {**procs, "R": r}
        finally:
            r.stop()


def _chat_body(parts_urls, max_tokens: int = NEW) -> dict:
    content = [
        {"type": "text", "text": p}
        if not p.startswith("data:") and not p.startswith(("http", "file"))
        else {"type": "image_url", "image_url": {"url": p}}
        for p in parts_urls
    ]
    return {
        "model": "vl",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def _two_images_body() -> dict:
    return _chat_body(["Look:", data_url(IMAGES[0]), "and", data_url(IMAGES[1]), "what differs?"])


def test_chat_with_images_colocated_and_through_pd_gives_hf_tokens(vl_cluster, vl_path, reference):
    from openai import OpenAI

    _, tokens, _ = reference
    tok = transformers.AutoTokenizer.from_pretrained(vl_path)
    want = tok.decode(tokens, skip_special_tokens=True)
    body = _two_images_body()
    for name in ("S", "R"):
        client = OpenAI(base_url=vl_cluster[name].url + "/v1", api_key="none")
        out = client.chat.completions.create(
            model=body["model"], messages=body["messages"], max_tokens=NEW, temperature=0
        )
        assert out.choices[0].message.content == want, name
        assert out.usage.completion_tokens == NEW


def test_streamed_and_from_a_two_rank_prefill(vl_cluster, vl_path, reference):
    from openai import OpenAI

    _, tokens, _ = reference
    tok = transformers.AutoTokenizer.from_pretrained(vl_path)
    body = _two_images_body()
    client = OpenAI(base_url=vl_cluster["R"].url + "/v1", api_key="none")
    stream = client.chat.completions.create(
        model="vl", messages=body["messages"], max_tokens=NEW, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == tok.decode(tokens, skip_special_tokens=True)
    # P tp2 -> D tp1 by /generate, as a router sends it
    prompt = tok.apply_chat_template(TWO, tokenize=False, add_generation_prompt=True)
    gen = {
        "text": prompt,
        "image_data": [data_url(im) for im in IMAGES],
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": vl_cluster["P2"].bootstrap_port,
        "bootstrap_room": 77,
    }
    fp, fd = c.post_pd(vl_cluster["P2"], vl_cluster["D"], gen)
    assert fp.status_code == 200, fp.text
    assert fd.json()["output_ids"] == tokens


def test_a_repeated_image_hits_the_prefix_cache_on_prefill(vl_cluster):
    body = _chat_body(["Compare", data_url(IMAGES[1]), "with nothing."])
    url = vl_cluster["R"].url + "/v1/chat/completions"
    first = httpx.post(url, json=body, timeout=60).json()
    again = httpx.post(url, json=body, timeout=60).json()
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    prompt = again["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt - 4
    other = httpx.post(
        url, json=_chat_body(["Compare", data_url(OTHER), "with nothing."]), timeout=60
    ).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < 12


@pytest.mark.parametrize(
    "url, words",
    [
        ("data:image/png;base64,!!!", "base64"),
        ("data:text/plain;base64,aGVsbG8=", "not an image"),
        ("data:image/png;base64,aGVsbG8=", "not a readable image"),
        ("https://example.com/cat.png", "fetches no http"),
        ("file:///etc/passwd", "allowed-local-media-path"),
    ],
)
def test_bad_images_are_400s_naming_the_part(vl_cluster, url, words):
    r = httpx.post(
        vl_cluster["S"].url + "/v1/chat/completions",
        json=_chat_body(["see", url]),
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert "messages[0].content[1]" in r.text and words in r.text


def test_too_many_and_huge_images_are_400s(vl_cluster):
    body = _chat_body(["a"] + [data_url(IMAGES[0])] * 4)
    r = httpx.post(vl_cluster["S"].url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "at most 3" in r.text, r.text
    body = _chat_body(["a", data_url(png(200, 120, 9))])  # 24,000 pixels, over 20,000
    r = httpx.post(vl_cluster["R"].url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "200x120 pixels" in r.text, r.text


def test_generate_responses_and_messages_take_images(vl_cluster, vl_path, reference):
    import base64

    _, tokens, _ = reference
    tok = transformers.AutoTokenizer.from_pretrained(vl_path)
    want = tok.decode(tokens, skip_special_tokens=True)
    text = tok.apply_chat_template(TWO, tokenize=False, add_generation_prompt=True)
    bare = base64.b64encode(IMAGES[1]).decode()  # SGLang also takes bare base64
    for name in ("S", "R"):  # /generate through the router goes to prefill and decode
        out = httpx.post(
            vl_cluster[name].url + "/generate",
            json={
                "text": text,
                "image_data": [data_url(IMAGES[0]), bare],
                "sampling_params": {"temperature": 0, "max_new_tokens": NEW},
            },
            timeout=60,
        ).json()
        assert out["output_ids"] == tokens, (name, out)
    url = vl_cluster["S"].url
    parts = [
        {"type": "input_text", "text": "Look:"},
        {"type": "input_image", "image_url": data_url(IMAGES[0])},
        {"type": "input_text", "text": "and"},
        {"type": "input_image", "image_url": data_url(IMAGES[1])},
        {"type": "input_text", "text": "what differs?"},
    ]
    r = httpx.post(
        url + "/v1/responses",
        json={
            "model": "vl",
            "input": [{"role": "user", "content": parts}],
            "max_output_tokens": NEW,
            "temperature": 0,
        },
        timeout=60,
    ).json()
    assert r["output"][-1]["content"][0]["text"] == want, r

    def block(image: bytes) -> dict:
        data = base64.b64encode(image).decode()
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": data},
        }

    blocks = [
        {"type": "text", "text": "Look:"},
        block(IMAGES[0]),
        {"type": "text", "text": "and"},
        block(IMAGES[1]),
        {"type": "text", "text": "what differs?"},
    ]
    m = httpx.post(
        url + "/v1/messages",
        json={
            "model": "vl",
            "messages": [{"role": "user", "content": blocks}],
            "max_tokens": NEW,
            "temperature": 0,
        },
        timeout=60,
    ).json()
    assert m["content"][0]["text"] == want, m


def test_generate_names_a_placeholder_miscount(vl_cluster):
    r = httpx.post(
        vl_cluster["S"].url + "/generate",
        json={"text": "no placeholder here", "image_data": [data_url(IMAGES[0])]},
        timeout=30,
    )
    assert r.status_code == 400 and "0 image placeholder(s) for 1 image(s)" in r.text, r.text


def test_pools_are_clean_after_everything(vl_cluster):
    from tests.e2e.test_tp import all_ranks_idle

    for name in ("S", "P", "D"):
        vl_cluster[name].wait_idle()
    all_ranks_idle(vl_cluster["P2"])


# ---- EPD: encoder servers -------------------------------------------------------------------
@pytest.fixture(scope="module")
def epd_cluster(vl_cluster, vl_path, tmp_path_factory):
    """Two encoder servers (the tower alone), a prefill without the tower and the decode of
    ``vl_cluster``; routers with one encoder (1E1P1D) and with both (2E1P1D)."""
    from tests.helpers.ports import free_port

    logs = tmp_path_factory.mktemp("epd")
    language = without_vision_tower(vl_path)
    ports = [free_port(), free_port()]
    encoders = {
        f"E{i + 1}": c.server(
            f"E{i + 1}",
            vl_path,
            logs,
            "--encoder-only",
            "--dtype",
            "float32",
            "--disaggregation-bootstrap-port",
            str(port),
        )
        for i, port in enumerate(ports)
    }
    p = c.prefill("PL", language, logs, *COMMON, "--language-only", "--encoder-timeout", "5")[0]
    addrs = [f"tcp://127.0.0.1:{port}" for port in ports]
    for procs in c.running({**encoders, "PL": p}):
        d = vl_cluster["D"]
        one = c.router("R1", [p], [d], logs, "--encoder", addrs[0])
        two = c.router("R2", [p], [d], logs, "--encoder", addrs[0], "--encoder", addrs[1])
        try:
            c.start_all([one, two])
            yield {**procs, "R1": one, "R2": two, "S": vl_cluster["S"]}
        finally:
            one.stop()
            two.stop()


def _encoded(proc) -> int:
    return proc.http.get("/server_info").json()["images_encoded"]


def test_epd_gives_hf_tokens_with_one_and_two_encoders(epd_cluster, vl_path, reference):
    from openai import OpenAI

    _, tokens, _ = reference
    want = transformers.AutoTokenizer.from_pretrained(vl_path).decode(
        tokens, skip_special_tokens=True
    )
    body = _two_images_body()
    before = [_encoded(epd_cluster[e]) for e in ("E1", "E2")]
    client = OpenAI(base_url=epd_cluster["R1"].url + "/v1", api_key="none")
    out = client.chat.completions.create(
        model="vl", messages=body["messages"], max_tokens=NEW, temperature=0
    )
    assert out.choices[0].message.content == want
    after_one = [_encoded(epd_cluster[e]) for e in ("E1", "E2")]
    assert after_one == [before[0] + 2, before[1]]  # both images on E1
    # the same images again: the prefill keeps their embeddings by digest, no encoder is asked
    again = client.chat.completions.create(
        model="vl", messages=body["messages"], max_tokens=NEW, temperature=0
    )
    assert again.choices[0].message.content == want
    assert [_encoded(epd_cluster[e]) for e in ("E1", "E2")] == after_one
    # two new images through two encoders, streamed: one each
    fresh = _chat_body(["Look:", data_url(png(40, 32, 11)), "and", data_url(png(24, 56, 12)), "?"])
    colocated = httpx.post(
        epd_cluster["S"].url + "/v1/chat/completions", json=fresh, timeout=60
    ).json()["choices"][0]["message"]["content"]
    client2 = OpenAI(base_url=epd_cluster["R2"].url + "/v1", api_key="none")
    stream = client2.chat.completions.create(
        model="vl", messages=fresh["messages"], max_tokens=NEW, temperature=0, stream=True
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == colocated
    assert [_encoded(epd_cluster[e]) for e in ("E1", "E2")] == [after_one[0] + 1, after_one[1] + 1]
    epd_cluster["PL"].wait_idle()


def test_an_encoder_death_fails_over_to_the_other(epd_cluster):
    """E2 killed: the image sent to it goes to E1 after --encoder-timeout (5 s), and the next
    request's images go to E1 straight away; the tokens are colocated serving's."""
    epd_cluster["E2"].stop()
    e1 = _encoded(epd_cluster["E1"])
    for seed in (21, 23):
        fresh = _chat_body(["Two:", data_url(png(40, 32, seed)), data_url(png(24, 56, seed + 1))])
        want = httpx.post(epd_cluster["S"].url + "/v1/chat/completions", json=fresh, timeout=60)
        got = httpx.post(epd_cluster["R2"].url + "/v1/chat/completions", json=fresh, timeout=60)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
    assert _encoded(epd_cluster["E1"]) == e1 + 4
    epd_cluster["PL"].wait_idle()
