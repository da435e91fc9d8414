"""Images through servers on Qwen2.5-VL: the OpenAI chat API with ``image_url`` data URLs,
colocated and through PD (a prefill that runs the tower, one of two TP ranks each with the whole
tower, a ``--language-only`` decode whose checkpoint has no tower weights, pdserve's router), with
HF's tokens, streamed and not; Responses, Messages and ``/generate`` with images; cached tokens
for a repeated image; 400s naming a bad image, a fetch, too many or too large images and a
placeholder miscount; every pool idle afterwards."""

from __future__ import annotations

import pytest
import transformers

from tests.e2e.test_vision_language import (
    COMMON,
    IMAGES,
    NEW,
    OTHER,
    TWO,
    _chat_body,
    _two_images_body,
)
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.vision_checkpoints import (
    build_qwen2_5_vl_checkpoint,
    data_url,
    hf_vl_greedy,
    hf_vl_inputs,
    png,
    without_vision_tower,
)


@pytest.fixture(scope="module")
def vl_path():
    return build_qwen2_5_vl_checkpoint()


@pytest.fixture(scope="module")
def reference(vl_path):
    """HF's greedy tokens and logprobs for ``TWO`` with ``IMAGES``, and the prompt's ids."""
    inputs = hf_vl_inputs(vl_path, TWO, IMAGES)
    tokens, logprobs = hf_vl_greedy(vl_path, inputs, NEW)
    return inputs["input_ids"][0].tolist(), tokens, logprobs


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
    first = localhttp.post(url, json=body, timeout=60).json()
    again = localhttp.post(url, json=body, timeout=60).json()
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    prompt = again["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt - 4
    other = localhttp.post(
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
    r = localhttp.post(
        vl_cluster["S"].url + "/v1/chat/completions",
        json=_chat_body(["see", url]),
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert "messages[0].content[1]" in r.text and words in r.text


def test_too_many_and_huge_images_are_400s(vl_cluster):
    body = _chat_body(["a"] + [data_url(IMAGES[0])] * 4)
    r = localhttp.post(vl_cluster["S"].url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "at most 3" in r.text, r.text
    body = _chat_body(["a", data_url(png(200, 120, 9))])  # 24,000 pixels, over 20,000
    r = localhttp.post(vl_cluster["R"].url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "200x120 pixels" in r.text, r.text


def test_generate_responses_and_messages_take_images(vl_cluster, vl_path, reference):
    import base64

    _, tokens, _ = reference
    tok = transformers.AutoTokenizer.from_pretrained(vl_path)
    want = tok.decode(tokens, skip_special_tokens=True)
    text = tok.apply_chat_template(TWO, tokenize=False, add_generation_prompt=True)
    bare = base64.b64encode(IMAGES[1]).decode()  # SGLang also takes bare base64
    for name in ("S", "R"):  # /generate through the router goes to prefill and decode
        out = localhttp.post(
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
    r = localhttp.post(
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
    m = localhttp.post(
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
    r = localhttp.post(
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
