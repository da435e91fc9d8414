"""A draft model or an EAGLE head through PD on Mooncake, between TP sizes: prefill (TP 1)
computes the prompt with the target and the draft, the draft's KV travels in the same pages over
the Mooncake transfer engine and is sliced by KV head for decode's two ranks (TP 2), an EAGLE
head's first draft and hidden state in the metadata row, and decode speculates from its first
step (accepting what a colocated engine accepts): the tokens of the plain offline engine,
through pdserve's router."""

from __future__ import annotations

import pytest

from pdserve.disagg.transfer import get_backend
from tests.e2e.test_pd import COMMON
from tests.e2e.test_speculative import greedy, prompts
from tests.e2e.test_tp import all_ranks_idle
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import (
    build_draft_checkpoint,
    build_eagle_head,
    build_mtp_checkpoint,
    build_tiny_checkpoint,
)


# STANDALONE's draft KV moves as EAGLE's does (regions in the pages); tests/unit/test_pd_queues.py
# runs every algorithm through the local backend
@pytest.mark.parametrize("algorithm", ["EAGLE", "MTP"])
def test_draft_kv_moves_over_mooncake_between_tp_sizes(algorithm, tmp_path):
    try:
        get_backend("mooncake")
    except ValueError as e:
        pytest.skip(str(e))
    import pdserve

    model = build_mtp_checkpoint() if algorithm == "MTP" else build_tiny_checkpoint("llama")
    draft = {
        "STANDALONE": lambda: build_draft_checkpoint(model, noise=0.03),
        "EAGLE": lambda: build_eagle_head(model, scale=0.5),
        "MTP": lambda: model,  # DeepSeek-V3's layer in the model's checkpoint (latent KV)
    }[algorithm]()
    args = ["--page-size", "16", "--chunked-prefill-size", "64", "--dtype", "float32", *COMMON]
    args += ["--disaggregation-transfer-backend", "mooncake"]
    args += ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", draft]
    P, _ = c.prefill(f"P{algorithm}", model, tmp_path, *args)
    D = c.decode(f"D{algorithm}", model, tmp_path, *args, "--tp-size", "2")
    procs = [P, D]
    try:
        c.start_all((P, D))
        R = c.router(f"R{algorithm}", [P], [D], tmp_path)
        procs.append(R)
        R.start()
        ps = prompts(0)[:2] + prompts(4)[2:]  # 45..100 tokens: prefill's chunks of 64
        if algorithm == "MTP":
            from tests.e2e.test_speculative_mtp import mtp_prompts

            ps = mtp_prompts()[:3]
        plain = pdserve.Engine(
            model_path=model, torch_num_threads=1, max_total_tokens=8192, dtype="float32"
        )
        want = plain.generate(input_ids=ps, sampling_params=greedy(30))
        colocated = pdserve.Engine(
            model_path=model,
            torch_num_threads=1,
            max_total_tokens=8192,
            page_size=16,
            chunked_prefill_size=64,
            dtype="float32",
            speculative_algorithm=algorithm,
            speculative_draft_model_path=draft,
        ).generate(input_ids=ps, sampling_params=greedy(30))
        for ids, w, col in zip(ps, want, colocated):
            r = localhttp.post(
                R.url + "/generate",
                json={"input_ids": ids, "sampling_params": greedy(30)},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == w["output_ids"]
            meta = r.json()["meta_info"]
            # decode's draft read prefill's draft KV: it accepts what the colocated one does
            assert meta["spec_verify_ct"] == col["meta_info"]["spec_verify_ct"]
            assert meta["spec_accept_length"] == col["meta_info"]["spec_accept_length"]
        assert any(o["meta_info"]["spec_accept_length"] > 1 for o in colocated)
        all_ranks_idle(D)
        P.wait_idle()
        info = P.http.get("/debug/integrity").json()["integrity"]
        assert info["in_use_pages"] == 0, info
    finally:
        c.stop_all(reversed(procs))
