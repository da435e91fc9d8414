"""DeepSeek-V3's multi-token-prediction layer as the draft (``--speculative-algorithm MTP``) on
the tiny DeepSeek-V3 with such a layer added to its checkpoint as V3 ships it
(``model.layers.N.*``, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``): the first draft
equals a reference computed with transformers' own DeepSeek-V3 layer; greedy tokens and logprobs
identical to plain decoding with drafts accepted on some prompts; a checkpoint without the layer
refused. (PD: tests/unit/test_pd_queues.py.)"""

from __future__ import annotations

import copy
import random

import pytest
import torch

import pdserve
from tests.e2e.test_speculative import greedy
from tests.e2e.test_speculative_eagle import first_drafts
from tests.helpers.checkpoints import build_mtp_checkpoint, build_tiny_checkpoint

torch.set_num_threads(1)

SCALE = 0.5  # the MTP layer is the last layer's weights times this (the helper's recipe)


def mtp_prompts() -> list[list[int]]:
    """Prompts the tiny model answers by repeating itself (the tiny layer accepts there)."""
    rng = random.Random(1)
    return [
        [500] * 40,
        [rng.randrange(100, 40000)] * 3 + [7] * 30,
        [1234, 99] * 20,
        [rng.randrange(100, 40000) for _ in range(5)] * 8,
    ]


def engine(**kw) -> pdserve.Engine:
    return pdserve.Engine(
        model_path=build_mtp_checkpoint(scale=SCALE),
        torch_num_threads=1,
        page_size=4,
        max_total_tokens=8192,
        chunked_prefill_size=16,
        dtype="float32",
        **kw,
    )


def reference_first_draft(ids: list[int], first_token: int) -> int:
    """transformers' DeepSeek-V3 computes the model's final hidden states; the MTP layer is its
    last layer (copied, weights times ``SCALE`` as the checkpoint holds them) after ``eh_proj`` of
    [enorm(embedding of the next token), hnorm(hidden state)], then ``shared_head.norm`` and the
    model's head."""
    import transformers
    from safetensors import safe_open
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    path = build_mtp_checkpoint(scale=SCALE)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = model.config
    n = cfg.num_hidden_layers
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        w = {k: f.get_tensor(k) for k in f.keys() if k.startswith(f"model.layers.{n}.")}
    pre = f"model.layers.{n}."

    def norm(name):
        m = DeepseekV3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        m.weight.data = w[pre + name]
        return m

    layer = copy.deepcopy(model.model.layers[n - 1])
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if not (name.endswith("norm.weight") or "e_score_correction_bias" in name):
                p.mul_(SCALE)
        out = model(torch.tensor([ids]), output_hidden_states=True)
        tokens = torch.tensor([ids[1:] + [first_token]])
        x = torch.cat(
            [
                norm("enorm.weight")(model.model.embed_tokens(tokens)),
                norm("hnorm.weight")(out.hidden_states[-1]),
            ],
            dim=-1,
        )
        x = x @ w[pre + "eh_proj.weight"].T
        positions = torch.arange(len(ids))[None]
        rope = model.model.rotary_emb(x, positions)
        y = layer(x, position_embeddings=rope, position_ids=positions, attention_mask=None)
        y = y[0] if isinstance(y, tuple) else y
        return int(model.lm_head(norm("shared_head.norm.weight")(y))[0, -1].argmax())


def test_the_first_draft_is_the_reference(request):
    spec = engine(speculative_algorithm="MTP")
    request.node._engine = spec
    for i, (ids, first, draft) in enumerate(first_drafts(spec, mtp_prompts()[:3])):
        assert draft == reference_first_draft(ids, first), i


def test_greedy_tokens_and_logprobs_equal_plain_decoding(request):
    plain, spec = engine(), engine(speculative_algorithm="MTP")
    request.node._engine = spec
    ps = mtp_prompts()
    ref = plain.generate(input_ids=ps, sampling_params=greedy(40), return_logprob=True)
    out = spec.generate(input_ids=ps, sampling_params=greedy(40), return_logprob=True)
    for k, (r, o) in enumerate(zip(ref, out)):
        assert o["output_ids"] == r["output_ids"], f"prompt {k}"
        a = [v for v, _, _ in o["meta_info"]["output_token_logprobs"]]
        b = [v for v, _, _ in r["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, f"prompt {k}"
    lengths = [o["meta_info"]["spec_accept_length"] for o in out]
    assert max(lengths) > 1.3 and min(lengths) < max(lengths), lengths
    # the target holds the names and shapes of the MTP layer, not its weights
    assert all(isinstance(v, tuple) for v in spec.scheduler.runner.model.mtp_weights.values())
    info = spec.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0


def test_a_checkpoint_without_the_layer_is_refused():
    with pytest.raises(ValueError, match="'MTP' needs the checkpoint's next-token-prediction"):
        pdserve.Engine(
            model_path=build_tiny_checkpoint("deepseek_v3"),
            torch_num_threads=1,
            max_total_tokens=4096,
            speculative_algorithm="MTP",
        )
