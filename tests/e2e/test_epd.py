"""EPD on Qwen2.5-VL: two encoder servers (``--encoder-only``: the tower alone) write image
embeddings into a prefill's pages with the transfer backend; the prefill and the decode run
without the tower (``--language-only``, a checkpoint without its weights). HF's tokens through
routers with one encoder (1E1P1D) and two (2E1P1D, a request's images spread over both, streamed);
a repeated image asks no encoder (the prefill keeps embeddings by digest); a killed encoder's
image goes to the other."""

from __future__ import annotations

import pytest
import transformers

from tests.e2e.test_vision_language import COMMON, IMAGES, NEW, TWO, _chat_body, _two_images_body
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


def _hf_text(path: str, images: list[bytes], messages) -> str:
    tokens, _ = hf_vl_greedy(path, hf_vl_inputs(path, messages, images), NEW)
    return transformers.AutoTokenizer.from_pretrained(path).decode(tokens, skip_special_tokens=True)


FRESH = [png(40, 32, 11), png(24, 56, 12)]  # never sent before: no digest hit
THREE = [[png(40, 32, 21), png(24, 56, 22)], [png(40, 32, 23), png(24, 56, 24)]]


@pytest.fixture(scope="module")
def vl_path():
    return build_qwen2_5_vl_checkpoint()


@pytest.fixture(scope="module")
def epd_cluster(vl_path, tmp_path_factory):
    """Two encoder servers, a prefill and a decode without the tower; routers with one encoder
    (1E1P1D) and with both (2E1P1D)."""
    from tests.helpers.ports import free_port

    logs = tmp_path_factory.mktemp("epd")
    language = without_vision_tower(vl_path)
    secret = ["--disaggregation-secret", "epd-test-secret"]  # EPD's messages signed too
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
            *secret,
        )
        for i, port in enumerate(ports)
    }
    p = c.prefill(
        "PL", language, logs, *COMMON, "--language-only", "--encoder-timeout", "5", *secret
    )[0]
    d = c.decode("D", language, logs, *COMMON, "--language-only", *secret)
    addrs = [f"tcp://127.0.0.1:{port}" for port in ports]
    for procs in c.running({**encoders, "PL": p, "D": d}):
        one = c.router("R1", [p], [d], logs, "--encoder", addrs[0])
        two = c.router("R2", [p], [d], logs, "--encoder", addrs[0], "--encoder", addrs[1])
        try:
            c.start_all([one, two])
            yield {**procs, "R1": one, "R2": two}
        finally:
            one.stop()
            two.stop()


def _encoded(proc) -> int:
    return proc.http.get("/server_info").json()["images_encoded"]


def _embedding_pages(prefill) -> dict:
    prefill.wait_idle()
    info = prefill.http.get("/debug/integrity").json()["integrity"]
    assert info["encoder_held_requests"] == 0 and info["encoder_pages_in_flight"] == 0, info
    return info


def test_epd_gives_hf_tokens_with_one_and_two_encoders(epd_cluster, vl_path):
    from openai import OpenAI

    want = _hf_text(vl_path, IMAGES, TWO)
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
    fresh = _chat_body(["Look:", data_url(FRESH[0]), "and", data_url(FRESH[1]), "what differs?"])
    client2 = OpenAI(base_url=epd_cluster["R2"].url + "/v1", api_key="none")
    stream = client2.chat.completions.create(
        model="vl", messages=fresh["messages"], max_tokens=NEW, temperature=0, stream=True
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == _hf_text(vl_path, FRESH, TWO)
    assert [_encoded(epd_cluster[e]) for e in ("E1", "E2")] == [after_one[0] + 1, after_one[1] + 1]
    pages = _embedding_pages(epd_cluster["PL"])
    assert pages["encoder_pages_free"] == pages["encoder_pages_total"], pages


def test_an_encoder_death_fails_over_to_the_other(epd_cluster, vl_path):
    """E2 killed: the image sent to it goes to E1 after --encoder-timeout (5 s), and the next
    request's images go to E1 straight away; the tokens are HF's."""
    epd_cluster["E2"].stop()
    e1 = _encoded(epd_cluster["E1"])
    for pair in THREE:
        body = _chat_body(["Look:", data_url(pair[0]), "and", data_url(pair[1]), "what differs?"])
        got = localhttp.post(epd_cluster["R2"].url + "/v1/chat/completions", json=body, timeout=60)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["message"]["content"] == _hf_text(vl_path, pair, TWO)
    assert _encoded(epd_cluster["E1"]) == e1 + 4
    pages = _embedding_pages(epd_cluster["PL"])  # the timed-out image's page stays out of use
    assert pages["encoder_pages_quarantined"] == 1, pages
