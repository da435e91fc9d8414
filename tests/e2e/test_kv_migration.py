"""KV migration (``POST /migrate``, router ``--drain-migrate``): running requests move from one
decode to another mid-generation, KV pages and all, over the PD transfer path; every client
stream (OpenAI chat and /generate, through the router) ends with exactly the tokens of an
unmigrated run, and both decodes' pools end free and consistent.

One cluster for the module: a prefill, decode D1 behind the router, decode D2 outside it (the
target) until the drain test adds it to the router and removes D1. D1 speculates (n-gram drafts):
its requests move with their speculative state and the target decodes them on."""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import pytest

from tests.helpers import cluster as c
from tests.helpers import localhttp

NEW_TOKENS = 400  # long enough that the scheduler is still at it when the move comes
LONG = 800  # the drain tests: generations that outlast a drain by far
# the decodes may exchange requests with any server on 127.0.0.1 (and nothing else)
COMMON = [*c.PAGED_PD_ARGS, "--migration-peers", "127.0.0.1"]
SPECULATE = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_path):
    logs = tmp_path_factory.mktemp("kv_migration")
    P, _ = c.prefill("Pm", tiny_llama_path, logs, *COMMON)
    D1 = c.decode("Dm1", tiny_llama_path, logs, *COMMON, *SPECULATE)
    D2 = c.decode("Dm2", tiny_llama_path, logs, *COMMON)
    R = None
    try:
        c.start_all((P, D1, D2))
        R = c.router("Rm", [P], [D1], logs, "--drain-migrate").start()
        yield P, D1, D2, R
    finally:
        c.stop_all([x for x in (R, D2, D1, P) if x is not None])


def prompts(n: int, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 70))] for _ in range(n)]


def chat_body(ids: list[int], stream: bool, tokens: int = NEW_TOKENS) -> dict:
    # a chat prompt of the same tokens: the router and the server apply the same template
    text = " ".join(str(t) for t in ids)
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


def generate_body(ids: list[int], stream: bool, tokens: int = NEW_TOKENS) -> dict:
    return {**c.greedy_body(ids, tokens), "stream": stream}


def references(url: str, ps: list[list[int]], tokens: int = NEW_TOKENS) -> list[tuple]:
    """Unmigrated runs of ``ps`` (alternately chat and /generate), all at once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(ps)) as ex:
        kinds = ["chat", "generate"]
        return list(ex.map(lambda a: reference(url, kinds[a[0] % 2], a[1], tokens), enumerate(ps)))


def reference(url: str, kind: str, ids: list[int], tokens: int = NEW_TOKENS) -> tuple:
    """(output, completion tokens) of an unmigrated run."""
    if kind == "chat":
        r = localhttp.post(
            url + "/v1/chat/completions", json=chat_body(ids, False, tokens), timeout=300
        )
        assert r.status_code == 200, r.text
        body = r.json()
        return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]
    r = localhttp.post(url + "/generate", json=generate_body(ids, False, tokens), timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"], r.json()["meta_info"]["completion_tokens"]


class Stream(threading.Thread):
    """One streaming request; ``progress`` counts its events so far."""

    def __init__(self, url: str, kind: str, ids: list[int], tokens: int = NEW_TOKENS, **extra):
        super().__init__(daemon=True)
        self.tokens = tokens
        self.url, self.kind, self.ids, self.extra = url, kind, ids, extra
        self.progress = 0
        self.result = None
        self.error = None

    def run(self) -> None:
        try:
            path, body = (
                ("/v1/chat/completions", chat_body(self.ids, True, self.tokens))
                if self.kind == "chat"
                else ("/generate", generate_body(self.ids, True, self.tokens))
            )
            body.update(self.extra)
            text, usage, last = "", None, None
            with localhttp.stream("POST", self.url + path, json=body, timeout=300) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    assert "error" not in ev, ev
                    self.progress += 1
                    if self.kind == "chat":
                        if ev.get("usage"):
                            usage = ev["usage"]
                        for ch in ev.get("choices", []):
                            text += ch["delta"].get("content") or ""
                    else:
                        last = ev
            if self.kind == "chat":
                self.result = (text, usage["completion_tokens"], usage["prompt_tokens"])
            else:
                meta = last["meta_info"]
                self.result = (last["output_ids"], meta["completion_tokens"], meta["prompt_tokens"])
                self.meta = meta
        except Exception as e:  # reported by the test
            self.error = e


def start_streams(url: str, n: int, seed: int = 11, tokens: int = NEW_TOKENS) -> list[Stream]:
    kinds = ["chat", "generate"]
    streams = [Stream(url, kinds[i % 2], ids, tokens) for i, ids in enumerate(prompts(n, seed))]
    for s in streams:
        s.start()
    c.wait_for(lambda: all(s.progress >= 4 for s in streams), 120, "every stream to be going")
    return streams


def check_streams(streams: list[Stream], refs: list[tuple], tokens: int = NEW_TOKENS) -> None:
    for s in streams:
        s.join(300)
    for s, (out, completion) in zip(streams, refs):
        assert s.error is None, s.error
        assert s.result[0] == out, (s.kind, s.result[0], out)
        assert s.result[1] == completion == tokens
        assert s.result[2] > 0


def server_stats(server: c.Proc) -> dict:
    return server.http.get("/server_info").json()["internal_states"][0]


def test_migrate_errors(cluster):
    P, D1, D2, R = cluster

    def post(server, body):
        return localhttp.post(server.url + "/migrate", json=body, timeout=30)

    # nothing runs: nothing to move, the (listed) target is not even asked
    r = post(D1, {"rid": "all", "target": f"127.0.0.1:{c.free_port()}"})
    assert r.status_code == 200 and r.json() == {"moved": [], "refused": {}}, r.text
    r = post(D1, {"rid": ["nope", "nope"], "target": D2.url})
    assert r.status_code == 200 and list(r.json()["refused"]) == ["nope"], r.text
    assert "no request with this id" in r.json()["refused"]["nope"]
    r = post(P, {"rid": "all", "target": D2.url})
    assert r.status_code == 400 and "only a decode" in r.text
    for bad, why in (
        ({}, "target"),
        ({"target": []}, "at least one"),
        ({"target": "\ud8ff\udca4\u00ddf"}, "characters a URL cannot have"),
        ({"target": "http://[::1"}, "not a URL"),
        ({"target": "127.0.0.1:99999"}, "Port out of range"),
        ({"target": "http://u:p@127.0.0.1:1"}, "no user name"),
        ({"target": "http://127.0.0.1:1/admin?x=1"}, "no path"),
        ({"target": "ftp://127.0.0.1:1"}, "scheme"),
    ):
        r = localhttp.post(
            D1.url + "/migrate",
            content=json.dumps({"rid": "all", **bad}).encode(),
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400 and why in r.text, (bad, r.text)
    # with a request running, each target is asked whether it can take it
    probe = Stream(R.url, "generate", prompts(1, seed=61)[0], LONG, rid="probe")
    probe.start()
    c.wait_for(lambda: probe.progress >= 4, 120, "the probe stream")
    try:
        r = post(D1, {"rid": "all", "target": D1.url})
        assert r.status_code == 400 and "is this server" in r.text
        r = post(D1, {"rid": "all", "target": P.url})
        assert r.status_code == 400 and "not a decode" in r.text
        r = post(D1, {"rid": "probe", "target": f"127.0.0.1:{c.free_port()}"})
        assert r.status_code == 400 and "cannot reach" in r.text
    finally:
        localhttp.post(D1.url + "/abort_request", json={"rid": "probe"}, timeout=30)
        probe.join(60)
    moved = {
        "rid": "x",
        "input_ids": [5, 6],
        "output_ids": [7],
        "sampling_params": {},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 1,
        "bootstrap_room": 1,
    }
    r = localhttp.post(P.url + "/migrate_in", json=moved, timeout=30)
    assert r.status_code == 400 and "not a decode" in r.text
    for bad, why in (
        ({"output_ids": []}, "output_ids"),
        ({"input_ids": [-1]}, "out of range"),
        ({"bootstrap_host": "not a host"}, "not a host name"),
        ({"bootstrap_port": 0}, "bootstrap_port"),
    ):
        r = localhttp.post(D2.url + "/migrate_in", json={**moved, **bad}, timeout=30)
        assert r.status_code == 400 and why in r.text, r.text
    for s in (P, D1, D2):
        s.wait_idle()


def test_targets_outside_the_peers_are_refused_without_a_connection(cluster):
    """A decode connects only to its --migration-peers: /migrate and /switch_role's migrate_to
    naming another host (or a name for a listed address: names are not resolved) answer 403
    while a request runs that would move, and /migrate_in naming another source 403; a listener
    at each named address sees no connection. (The moves to a listed decode are the tests
    around.)"""
    P, D1, D2, R = cluster
    listeners = []
    for host in ("127.0.0.2", "127.0.0.1"):
        sock = socket.socket()
        sock.bind((host, 0))
        sock.listen(8)
        sock.settimeout(0.5)
        listeners.append(sock)
    outside, same_port = listeners[0].getsockname(), listeners[1].getsockname()[1]
    before = server_stats(D1).get("migrated", 0)
    stream = Stream(R.url, "generate", prompts(1, seed=71)[0], LONG, rid="stays")
    stream.start()
    c.wait_for(lambda: stream.progress >= 4, 120, "the stream")
    for target in (f"http://{outside[0]}:{outside[1]}", f"localhost:{same_port}"):
        assert D1.integrity()["running"] == 1  # a request that a move would take
        r = localhttp.post(D1.url + "/migrate", json={"rid": "all", "target": [D2.url, target]})
        assert r.status_code == 403 and "--migration-peers" in r.text, r.text
        body = {"role": "prefill", "bootstrap_port": c.free_port(), "migrate_to": [target]}
        r = localhttp.post(D1.url + "/switch_role", json=body, timeout=30)
        assert r.status_code == 403 and "migrate_to" in r.text, r.text
    moved = {
        "rid": "from-outside",
        "input_ids": [5, 6],
        "output_ids": [7],
        "sampling_params": {},
        "bootstrap_host": outside[0],
        "bootstrap_port": outside[1],
        "bootstrap_room": 1,
    }
    r = localhttp.post(D2.url + "/migrate_in", json=moved, timeout=30)
    assert r.status_code == 403 and "bootstrap_host" in r.text, r.text
    assert D1.http.get("/server_info").json()["disaggregation_mode"] == "decode"
    localhttp.post(D1.url + "/abort_request", json={"rid": "stays"}, timeout=30)
    stream.join(60)
    assert D1.http.get("/server_info").json()["internal_states"][0].get("migrated", 0) == before
    for sock in listeners:
        with pytest.raises(socket.timeout):
            sock.accept()  # nothing connected
        sock.close()
    for s in (P, D1, D2):
        s.wait_idle()


def test_migrate_mid_generation(cluster):
    """8 streams (chat and /generate) move from D1 to D2 mid-generation, speculating on D1: each
    ends with exactly the tokens of the unmigrated run; D1's pages are free and D2 decoded
    them."""
    P, D1, D2, R = cluster
    refs = references(R.url, prompts(8))
    before = server_stats(D1).get("migrated", 0)
    streams = start_streams(R.url, 8)
    r = localhttp.post(D1.url + "/migrate", json={"rid": "all", "target": D2.url}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["moved"]) == 8 and not body["refused"], body
    assert all(s.progress < NEW_TOKENS for s in streams)  # it moved mid-generation
    c.wait_for(lambda: server_stats(D1).get("migrated", 0) - before == 8, 60, "the moves")
    # D1 decodes nothing any more while the streams go on
    assert D1.integrity()["running"] == 0
    check_streams(streams, refs)
    assert server_stats(D1)["migration_kv_bytes_sent"] > 0
    assert server_stats(D1)["spec_verify_steps"] > 0  # they moved while speculating
    for s in (P, D1, D2):
        s.wait_idle()


def run_streams(url: str, ps, extra, move=None) -> list[Stream]:
    """/generate streams of ``ps`` (with ``extra`` fields each), all at once; with ``move``
    (source, target), moved once each has output."""
    streams = [Stream(url, "generate", ids, **e) for ids, e in zip(ps, extra)]
    for s in streams:
        s.start()
    c.wait_for(lambda: all(s.progress >= 4 for s in streams), 120, "every stream to be going")
    if move is not None:
        source, target = move
        r = localhttp.post(
            source.url + "/migrate", json={"rid": "all", "target": target.url}, timeout=30
        )
        assert r.status_code == 200 and len(r.json()["moved"]) == len(ps), r.text
        for s in streams:
            s.at_move = s.progress
    for s in streams:
        s.join(300)
        assert s.error is None, s.error
    return streams


SAMPLED = {
    "temperature": 0.9,
    "top_p": 0.95,
    "frequency_penalty": 0.4,
    "presence_penalty": 0.3,
    "max_new_tokens": NEW_TOKENS,
    "ignore_eos": True,
}


def test_seeded_sampling_and_logprobs_move(cluster):
    """Seeded sampling with penalties and logprobs: the moved request draws what it would have
    drawn (the seed and the penalties' counts move with it) and its logprobs line up. One
    request at a time, so that both runs compute every step in a batch of one (a batch's
    composition changes the logits' last bits, and a sampled token near a boundary with them).
    The prompt runs once before both, so that both find it in the prefill's prefix cache: a
    prompt computed on top of cached pages differs from a cold one in the last bits too (with
    the kernels capped at AVX2 the cold and the warm run drew another token at step 26)."""
    P, D1, D2, R = cluster
    for i, ids in enumerate(prompts(1, seed=21)):
        extra = [{"sampling_params": {**SAMPLED, "seed": 100 + i}, "return_logprob": True}]
        run_streams(R.url, [ids], extra)  # the prompt's pages into the prefix cache
        (ref,) = run_streams(R.url, [ids], extra)
        (moved,) = run_streams(R.url, [ids], extra, move=(D1, D2))
        assert moved.result[0] == ref.result[0], moved.at_move
        got, want = moved.meta["output_token_logprobs"], ref.meta["output_token_logprobs"]
        assert [t for _, t, _ in got] == [t for _, t, _ in want] == ref.result[0]
        assert max(abs(a[0] - b[0]) for a, b in zip(got, want)) < 1e-4
        assert moved.meta["completion_tokens"] == NEW_TOKENS
    for s in (P, D1, D2):
        s.wait_idle()


def test_a_refused_move_goes_on_here(cluster):
    """A target that refuses the request (its rid is taken there) leaves it on the source,
    which goes on with the same tokens; both pools end consistent."""
    P, D1, D2, R = cluster
    (ids,), (other,) = prompts(1, seed=31), prompts(1, seed=32)
    ref = reference(R.url, "generate", ids)
    before = server_stats(D1).get("migrations_failed", 0)
    mine = Stream(R.url, "generate", ids, rid="taken")
    theirs = Stream(D2.url, "generate", other, rid="taken")  # served on D2 itself
    for s in (mine, theirs):
        s.start()
    c.wait_for(lambda: mine.progress >= 4 and theirs.progress >= 4, 120, "both streams")
    r = localhttp.post(D1.url + "/migrate", json={"rid": "taken", "target": D2.url}, timeout=30)
    assert r.status_code == 200 and len(r.json()["moved"]) == 1, r.text
    c.wait_for(lambda: server_stats(D1)["migrations_failed"] == before + 1, 60, "the refusal")
    check_streams([mine], [ref])
    theirs.join(300)
    assert theirs.error is None, theirs.error
    for s in (P, D1, D2):
        s.wait_idle()


def test_a_client_gone_after_the_move_ends_it_on_the_target(cluster):
    """The client leaves mid-stream after the move: the relay's request to the target ends, the
    target aborts the request, and both decodes end with nothing held."""
    P, D1, D2, R = cluster
    before = server_stats(D1).get("migrated", 0)
    made = server_stats(D2)["generation_tokens"]
    (ids,) = prompts(1, seed=51)
    events = 0
    with localhttp.stream("POST", R.url + "/generate", json=generate_body(ids, True, LONG)) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            events += 1
            if events == 4:
                m = localhttp.post(D1.url + "/migrate", json={"rid": "all", "target": D2.url})
                assert m.status_code == 200 and len(m.json()["moved"]) == 1, m.text
                moved = lambda: server_stats(D1).get("migrated", 0) == before + 1  # noqa: E731
                c.wait_for(moved, 60, "the move")
            if events == 4 + 8:
                break
    D2.wait_idle()
    # the target stopped early: it holds the request's whole output once it reaches the end
    assert server_stats(D2)["generation_tokens"] - made < LONG
    for s in (P, D1, D2):
        s.wait_idle()


def test_drain_migrate(cluster):
    """The router's drain of D1 with --drain-migrate moves its requests to D2 and ends while
    the generations go on; the streams still end with the unmigrated tokens."""
    P, D1, D2, R = cluster
    refs = references(R.url, prompts(4, 3), LONG)
    streams = start_streams(R.url, 4, seed=3, tokens=LONG)  # D1 is the router's only decode yet
    r = localhttp.post(
        R.url + "/workers", json={"url": D2.url, "worker_type": "decode"}, timeout=60
    )
    assert r.status_code == 202, r.text
    assert D1.integrity()["running"] == 4
    t0 = time.monotonic()
    r = localhttp.delete(f"{R.url}/workers/{D1.url}", timeout=30)
    assert r.status_code == 202, r.text

    def gone():
        workers = localhttp.get(R.url + "/workers", timeout=10).json()
        return all(w["url"] != D1.url for w in workers.get("workers", workers))

    c.wait_for(gone, 120, "the drain of D1")
    drain_s = time.monotonic() - t0
    # the drain ended while the generations still ran
    assert sum(s.is_alive() for s in streams) > 0, drain_s
    assert D1.integrity()["running"] == 0
    check_streams(streams, refs, LONG)
    for s in (P, D1, D2):
        s.wait_idle()


def test_switch_role_moves_requests(cluster, tmp_path):
    """POST /switch_role with migrate_to: the decode moves its requests to D2 and becomes a
    prefill while they go on (relayed by its front end), with the unmigrated tokens."""
    P, D1, D2, R = cluster
    R2 = c.router("Rm2", [P], [D1], tmp_path).start()  # R let D1 go in the drain test
    try:
        refs = references(R2.url, prompts(4, 41), LONG)
        streams = start_streams(R2.url, 4, seed=41, tokens=LONG)
        body = {"role": "prefill", "bootstrap_port": c.free_port(), "migrate_to": [D2.url]}
        r = localhttp.post(D1.url + "/switch_role", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["aborted_requests"] == 0 and r.json()["drained_requests"] == 4
        assert sum(s.is_alive() for s in streams) > 0  # it switched while they still ran
        # their streams go through this server still: its preStop hook (deploy/k8s) waits for them
        metrics = D1.http.get("/metrics").text
        relayed = [ln for ln in metrics.splitlines() if ln.startswith("pdserve:num_relayed_reqs")]
        assert relayed and float(relayed[0].split()[-1]) > 0, relayed
        check_streams(streams, refs, LONG)
        for s in (P, D1, D2):
            s.wait_idle()
        info = D1.http.get("/server_info").json()
        assert info["disaggregation_mode"] == "prefill"
    finally:
        R2.stop()


@pytest.fixture(scope="module")
def mooncake_decodes(tmp_path_factory, tiny_llama_path):
    """Two decodes on Mooncake, no prefill: requests without PD fields are computed on the
    decode itself (as on a colocated server), which is all a move needs."""
    from pdserve.disagg.transfer import get_backend

    try:
        get_backend("mooncake")
    except ValueError as e:
        pytest.skip(str(e))
    logs = tmp_path_factory.mktemp("kv_migration_mooncake")
    args = [*COMMON, "--disaggregation-transfer-backend", "mooncake"]
    D1 = c.decode("Dmc1", tiny_llama_path, logs, *args)
    D2 = c.decode("Dmc2", tiny_llama_path, logs, *args)
    try:
        c.start_all((D1, D2))
        yield D1, D2
    finally:
        c.stop_all((D2, D1))


def test_migrate_on_mooncake_with_a_direct_client(mooncake_decodes):
    """The move over Mooncake (TCP), for clients that talk to the decode directly: the pages go
    through the Mooncake engines and the old decode relays the new one's stream."""
    D1, D2 = mooncake_decodes
    refs = references(D1.url, prompts(4, 5))
    streams = start_streams(D1.url, 4, seed=5)
    r = localhttp.post(D1.url + "/migrate", json={"rid": "all", "target": D2.url}, timeout=30)
    assert r.status_code == 200 and len(r.json()["moved"]) == 4, r.text
    check_streams(streams, refs)
    assert server_stats(D1)["migration_kv_bytes_sent"] > 0
    for s in (D1, D2):
        s.wait_idle()
