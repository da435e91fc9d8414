"""EAGLE heads (``--speculative-algorithm EAGLE``) on the tiny Llama, with heads in the layout
EAGLE's authors publish (``pytorch_model.bin``: ``fc``, ``layers.0.*`` without an input norm):
the head's first draft equals a reference built from transformers' Llama layer; greedy tokens and
logprobs identical to plain decoding, alone and in batches of different acceptance with chunked
prefill and a penalized request beside them; prefix-cache hits; seeded sampling; the target
distribution (chi-square); retractions; TP 2 over HTTP (trees of drafts); bad heads and settings
refused."""

from __future__ import annotations

import pytest
import torch

import pdserve
from pdserve.config import ServerArgs
from tests.e2e.test_speculative import chi_square_at_speculative_rows, greedy, prompts
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_eagle_head, build_tiny_checkpoint

torch.set_num_threads(1)

NEW = 40


def target() -> str:
    return build_tiny_checkpoint("llama")


def engine(head=None, **kw) -> pdserve.Engine:
    kw.setdefault("page_size", 4)
    kw.setdefault("max_total_tokens", 16384)
    if head is not None:
        kw.update(speculative_algorithm="EAGLE", speculative_draft_model_path=head)
    return pdserve.Engine(
        model_path=kw.pop("model_path", target()),
        torch_num_threads=1,
        chunked_prefill_size=32,
        **kw,
    )


@pytest.fixture(scope="module")
def plain():
    return engine()


@pytest.fixture(scope="module")
def head():
    return build_eagle_head(target(), scale=0.5)


def reference_first_draft(head_dir: str, ids: list[int], first_token: int) -> int:
    """The head's proposal after a prompt and its first token, computed with transformers: the
    target's final hidden states (after its norm), the head's ``fc`` over [embedding of the next
    token, hidden state], a Llama decoder layer without its input norm, the target's head."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target(), dtype=torch.float32)
    config = transformers.AutoConfig.from_pretrained(head_dir)
    weights = torch.load(f"{head_dir}/pytorch_model.bin", weights_only=True)
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0)
    layer.load_state_dict(
        {k[len("layers.0.") :]: v for k, v in weights.items() if k.startswith("layers.0.")},
        strict=False,
    )
    layer.input_layernorm = torch.nn.Identity()
    with torch.no_grad():
        seq = torch.tensor([ids])
        out = model(seq, output_hidden_states=True)
        hidden = out.hidden_states[-1]  # after the final norm
        tokens = torch.tensor([ids[1:] + [first_token]])
        x = torch.cat([model.model.embed_tokens(tokens), hidden], dim=-1)
        x = x @ weights["fc.weight"].T + weights["fc.bias"]
        positions = torch.arange(len(ids))[None]
        rope = model.model.rotary_emb(x, positions)
        y = layer(x, position_embeddings=rope, position_ids=positions)
        y = y[0] if isinstance(y, tuple) else y
        return int(model.lm_head(y)[0, -1].argmax())


def first_drafts(spec: pdserve.Engine, prompts: list[list[int]]) -> list[tuple]:
    """(prompt, its first token, the head's first draft after it) per prompt, one request at a
    time through the scheduler."""
    from pdserve.engine.request import Req, SamplingParams

    sched, out = spec.scheduler, []
    for i, ids in enumerate(prompts):
        req = Req(rid=f"r{i}", input_ids=ids, sampling=SamplingParams.from_dict(greedy(3)))
        sched.add_request(req)
        while not req.output_ids:
            sched.step()
        out.append((ids, req.output_ids[0], req.spec.next_draft))
        while not req.finished:
            sched.step()
        sched.drain()
    return out


def test_the_heads_first_draft_is_the_reference(head, request):
    spec = engine(head)
    request.node._engine = spec
    for i, (ids, first, draft) in enumerate(first_drafts(spec, prompts(0)[:3])):
        assert draft == reference_first_draft(head, ids, first), i


def test_greedy_tokens_and_logprobs_equal_plain_decoding(head, request):
    # Same bits across batchings only under deterministic inference: a verify step's rows are
    # another matmul shape than a plain step's, and MKL's float32 kernels on Intel AVX-512 CPUs
    # round them differently (a greedy token flipped at a near tie there without it).
    plain = engine(enable_deterministic_inference=True)
    spec = engine(head, enable_deterministic_inference=True)
    request.node._engine = spec
    ps = prompts(0) + prompts(4)[2:]
    sampled = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 20, "ignore_eos": True}
    sampled.update(seed=11, frequency_penalty=0.5)
    params = [greedy(NEW)] * len(ps) + [sampled]
    ids = ps + [ps[2]]
    ref = plain.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    out = spec.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    for k, (r, o) in enumerate(zip(ref, out)):
        assert o["output_ids"] == r["output_ids"], f"prompt {k}"
        a = [v for v, _, _ in o["meta_info"]["output_token_logprobs"]]
        b = [v for v, _, _ in r["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, f"prompt {k}"
    lengths = [o["meta_info"]["spec_accept_length"] for o in out[:-1]]
    assert max(lengths) > 1.5 and len(set(lengths)) > 1, lengths
    alone = spec.generate(input_ids=ps[0], sampling_params=greedy(NEW))
    assert alone["output_ids"] == ref[0]["output_ids"]
    info = spec.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0


def test_prefix_cache_hits_and_page_sizes(plain, head, request):
    for page_size in (1, 16):
        spec = engine(head, page_size=page_size)
        request.node._engine = spec
        first = prompts(1)[0]
        done = spec.generate(input_ids=first, sampling_params=greedy(NEW))
        follow = first + done["output_ids"] + prompts(1)[2][:20]
        out = spec.generate(input_ids=follow, sampling_params=greedy(NEW))
        assert out["meta_info"]["cached_tokens"] >= len(first) - page_size
        want = plain.generate(input_ids=follow, sampling_params=greedy(NEW))["output_ids"]
        assert out["output_ids"] == want
        info = spec.check_integrity()
        assert info["in_use_pages"] == 0 and info["running"] == 0


def test_seeded_sampling_gives_the_plain_tokens(plain, head, request):
    spec = engine(head)
    request.node._engine = spec
    ps = prompts(3)[:2]
    params = [
        {"temperature": 0.3, "top_k": 3, "max_new_tokens": 24, "seed": s, "ignore_eos": True}
        for s in range(8)
    ]
    ids = [ps[s % 2] for s in range(8)]
    ref = plain.generate(input_ids=ids, sampling_params=params)
    out = spec.generate(input_ids=ids, sampling_params=params)
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    assert any(o["meta_info"].get("spec_accept_length", 1) > 1 for o in out)


def test_unseeded_sampling_follows_the_target_distribution(request):
    path = build_tiny_checkpoint("llama", vocab_size=16)
    common = dict(model_path=path, max_total_tokens=65536, page_size=4)
    plain = engine(**common)
    spec = engine(build_eagle_head(path, scale=0.5), random_seed=1234, **common)
    request.node._engine = spec
    chi_square_at_speculative_rows(plain, spec)


def test_retractions_under_a_small_kv_budget(plain, head, request):
    spec = engine(head, max_total_tokens=400, disable_radix_cache=True)
    request.node._engine = spec
    ps = prompts(0) * 2
    outs = spec.generate(input_ids=ps, sampling_params=greedy(NEW))
    assert spec.scheduler.stats["retractions"] > 0
    assert spec.scheduler.stats["spec_accepted_tokens"] > 0
    ref = plain.generate(input_ids=ps, sampling_params=greedy(NEW))
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
    info = spec.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0


def test_bad_heads_and_settings_are_refused(tmp_path):
    import json
    import shutil

    with pytest.raises(ValueError, match="speculative_draft_model_path: is required with"):
        ServerArgs(model_path="unused", speculative_algorithm="EAGLE")
    two = tmp_path / "two-layers"
    shutil.copytree(build_eagle_head(target()), two)
    config = json.loads((two / "config.json").read_text())
    (two / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="an EAGLE head has one decoder layer, this one has 2"):
        engine(str(two))
    wide = tmp_path / "wide"
    shutil.copytree(build_eagle_head(target()), wide)
    (wide / "config.json").write_text(json.dumps(config | {"hidden_size": 128}))
    with pytest.raises(ValueError, match=r"EAGLE head's hidden size 128 is not the target's"):
        engine(str(wide), load_format="dummy")


def test_served_with_tp2(plain, head, tmp_path):
    """Two TP ranks, each building the same trees of drafts (top-k 2) from the same logits:
    the plain tokens (a chain at TP 2: STANDALONE's and EAGLE3's tests)."""

    from tests.helpers import cluster as c

    args = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", head]
    args += ["--page-size", "4", "--max-total-tokens", "8192", "--tp-size", "2"]
    args += ["--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"]
    args += ["--speculative-num-steps", "3"]
    server = c.server("Seagle", target(), tmp_path, *args)
    try:
        c.start_all([server])
        for ids in prompts(0)[:2]:
            body = {"input_ids": ids, "sampling_params": greedy(32)}
            r = localhttp.post(server.url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            want = plain.generate(input_ids=ids, sampling_params=greedy(32))["output_ids"]
            assert r.json()["output_ids"] == want
            assert r.json()["meta_info"]["spec_verify_ct"] > 0
        from tests.e2e.test_tp import all_ranks_idle

        all_ranks_idle(server)
    finally:
        server.stop()
