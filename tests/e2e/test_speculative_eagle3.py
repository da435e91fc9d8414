"""EAGLE-3 heads (``--speculative-algorithm EAGLE3``) on the tiny Llama, with a head in the
layout EAGLE-3's authors publish (``fc`` over three target layer outputs, ``midlayer.*`` whose
attention reads [embedding; hidden state], ``norm``, an ``lm_head`` over a draft vocabulary
mapped by ``d2t``): the first draft equals a reference computed by hand from transformers'
Llama (its layer outputs, its RoPE); greedy tokens and logprobs identical to plain decoding with
drafts accepted on some prompts; TP 2 over HTTP; a head reading layers the target lacks refused.
(PD: tests/unit/test_pd_queues.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

import pdserve
from tests.e2e.test_speculative import greedy, prompts
from tests.e2e.test_speculative_eagle import first_drafts
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_eagle3_head, build_tiny_checkpoint

torch.set_num_threads(1)


def target() -> str:
    return build_tiny_checkpoint("llama")


def engine(head=None, **kw) -> pdserve.Engine:
    if head is not None:
        kw.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=head)
    return pdserve.Engine(
        model_path=target(),
        torch_num_threads=1,
        page_size=4,
        max_total_tokens=16384,
        chunked_prefill_size=32,
        **kw,
    )


def reference_first_draft(head: str, ids: list[int], first_token: int) -> int:
    import transformers
    from safetensors.torch import load_file
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = transformers.AutoModelForCausalLM.from_pretrained(target(), dtype=torch.float32)
    cfg = json.load(open(f"{head}/config.json"))
    w = load_file(f"{head}/model.safetensors")
    eps = cfg["rms_norm_eps"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    outs = {}
    hooks = [
        layer.register_forward_hook(
            lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o)
        )
        for i, layer in enumerate(model.model.layers)
    ]

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    with torch.no_grad():
        model(torch.tensor([ids]))
        for h in hooks:
            h.remove()
        layers = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        hid = torch.cat([outs[i][0] for i in layers], dim=-1) @ w["fc.weight"].T
        emb = model.model.embed_tokens(torch.tensor(ids[1:] + [first_token]))
        m = "midlayer."
        x = torch.cat(
            [rms(emb, w[m + "input_layernorm.weight"]), rms(hid, w[m + "hidden_norm.weight"])], -1
        )
        t = len(ids)
        q = (x @ w[m + "self_attn.q_proj.weight"].T).view(1, t, heads, -1).transpose(1, 2)
        k = (x @ w[m + "self_attn.k_proj.weight"].T).view(1, t, kv, -1).transpose(1, 2)
        v = (x @ w[m + "self_attn.v_proj.weight"].T).view(1, t, kv, -1).transpose(1, 2)
        cos, sin = model.model.rotary_emb(x[None], torch.arange(t)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(heads // kv, dim=1)
        v = v.repeat_interleave(heads // kv, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(t, -1) @ w[m + "self_attn.o_proj.weight"].T
        stream = a + hid
        y = rms(stream, w[m + "post_attention_layernorm.weight"])
        y = (F.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T)) @ w[
            m + "mlp.down_proj.weight"
        ].T
        out = rms(y + stream, w["norm.weight"])
        d = int((out[-1] @ w["lm_head.weight"].T).argmax())
        return d + int(w["d2t"][d])


def test_the_heads_first_draft_is_the_reference(request):
    head = build_eagle3_head(target())
    spec = engine(head)
    request.node._engine = spec
    for i, (ids, first, draft) in enumerate(first_drafts(spec, prompts(0)[:3])):
        assert draft == reference_first_draft(head, ids, first), i


def test_greedy_tokens_and_logprobs_equal_plain_decoding(request):
    plain, spec = engine(), engine(build_eagle3_head(target()))
    request.node._engine = spec
    ps = prompts(0)
    ref = plain.generate(input_ids=ps, sampling_params=greedy(40), return_logprob=True)
    out = spec.generate(input_ids=ps, sampling_params=greedy(40), return_logprob=True)
    for k, (r, o) in enumerate(zip(ref, out)):
        assert o["output_ids"] == r["output_ids"], f"prompt {k}"
        a = [v for v, _, _ in o["meta_info"]["output_token_logprobs"]]
        b = [v for v, _, _ in r["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, f"prompt {k}"
    lengths = [o["meta_info"]["spec_accept_length"] for o in out]
    assert max(lengths) > 1.5 and min(lengths) < max(lengths), lengths
    info = spec.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0


def test_a_head_reading_missing_layers_is_refused(tmp_path):
    bad = tmp_path / "head"
    shutil.copytree(build_eagle3_head(target()), bad)
    config = json.loads((bad / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 7]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids: layers \[7\]"):
        engine(str(bad))


def test_served_with_tp2(tmp_path):

    from tests.helpers import cluster as c

    plain = engine()
    args = ["--speculative-algorithm", "EAGLE3"]
    args += ["--speculative-draft-model-path", build_eagle3_head(target())]
    args += ["--page-size", "4", "--max-total-tokens", "8192", "--tp-size", "2"]
    server = c.server("Seagle3", target(), tmp_path, *args)
    try:
        c.start_all([server])
        for ids in prompts(0)[:2]:
            body = {"input_ids": ids, "sampling_params": greedy(32)}
            r = localhttp.post(server.url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            want = plain.generate(input_ids=ids, sampling_params=greedy(32))["output_ids"]
            assert r.json()["output_ids"] == want
            assert r.json()["meta_info"]["spec_verify_ct"] > 0
        assert r.json()["meta_info"]["spec_accept_length"] > 1
        from tests.e2e.test_tp import all_ranks_idle

        all_ranks_idle(server)
    finally:
        server.stop()
