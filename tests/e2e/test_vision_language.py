"""Images through the offline engine: Qwen2.5-VL and Qwen3.5 (tiny checkpoints as their makers
publish them: weights, tokenizer with the image tokens, chat template, image processor).

HF's greedy tokens and logprobs for prompts with two images of different shapes, one bigger
image and none, computed in chunks that cut the images; bf16 against HF's bf16 up to ties; a
prefix-cache hit for the same images and a miss at the first different one; a placeholder
miscount named; Qwen3.5 (a Gated DeltaNet hybrid) also through PD to a decode without the tower.
The servers' side is ``test_vision_servers.py``, encoder servers ``test_epd.py``; both take this
module's request helpers.
"""

from __future__ import annotations

import pytest
import transformers

from tests.helpers import cluster as c
from tests.helpers.vision_checkpoints import (
    build_qwen2_5_vl_checkpoint,
    build_qwen3_5_vl_checkpoint,
    build_qwen3_vl_checkpoint,
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


def test_qwen3_vl_with_deepstack_matches_hf():
    """Qwen3-VL: the tower's DeepStack features (two blocks' outputs through mergers of their own)
    added to the image tokens after the decoder's first two layers, interleaved M-RoPE, q/k norms:
    HF's tokens and logprobs in chunks that cut the images."""
    from pdserve.engine.engine import Engine

    path = build_qwen3_vl_checkpoint()
    tokens, logprobs = hf_vl_greedy(path, hf_vl_inputs(path, TWO, IMAGES), NEW)
    eng = Engine(model_path=path, dtype="float32", page_size=4, chunked_prefill_size=16)
    assert eng.scheduler.runner.model.image_width == 3 * 64  # the embeddings and two features
    out = eng.generate(
        input_ids=_prompt_ids(path, TWO),
        image_data=IMAGES,
        sampling_params=GREEDY,
        return_logprob=True,
    )
    assert out["output_ids"] == tokens
    ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert ours == pytest.approx(logprobs, abs=2e-5)
    eng.shutdown()


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
