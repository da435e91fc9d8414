"""The KV tiers below the pool (``--enable-hierarchical-cache``, ``engine/kv_tier``) on a live
server with a 16-page pool and a 16-page host tier over a disk tier: a prefix evicted from the
pool comes back from host memory, then (pushed out of host memory too) from disk, and after a
restart from disk again, with the outputs of its first, computed run token for token; a disk
entry with flipped bytes is detected, dropped and recomputed; KV events name the tier of each
block; write_through fills the host tier as pages enter the prefix cache; ``/flush_cache`` empties
every tier; a two-rank server hits each rank's tiers."""

from __future__ import annotations

import glob
import os
import re
import time

import pytest
import zmq

from pdserve.kv_events import chain_hashes
from tests.e2e.test_kv_events import DECODE, BlockRemoved, BlockStored, expected_hash
from tests.helpers import cluster as c
from tests.helpers import localhttp

PAGE = 16
N_NEW = 8


def tier_args(disk: str, policy: str, pub: int) -> list[str]:
    return [
        "--page-size",
        str(PAGE),
        "--max-total-tokens",
        "256",  # 16 pages
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        "1",  # 16 host pages
        "--hicache-write-policy",
        policy,
        "--hicache-storage-backend",
        "file",
        "--hicache-file-backend-storage-dir",
        disk,
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{pub}",
    ]


@pytest.fixture(scope="module")
def tiered(tmp_path_factory, tiny_llama_path):
    logs = tmp_path_factory.mktemp("kv_tier")
    disk = str(logs / "disk")
    state = {"disk": disk, "logs": logs, "model": tiny_llama_path, "servers": []}
    pub = c.free_port()
    s = c.server("Tier", tiny_llama_path, logs, *tier_args(disk, "write_back", pub))
    state["servers"].append(s)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    try:
        s.start()
        state.update(server=s, sub=sub)
        yield state
    finally:
        sub.close(linger=0)
        ctx.term()
        c.stop_all(state["servers"])


def generate(s: c.Proc, ids: list[int]) -> list[int]:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True},
    }
    r = localhttp.post(s.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def stats(s: c.Proc) -> dict:
    return s.http.get("/server_info").json()["internal_states"][0]


def delta(before: dict, after: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def drain(sub) -> list:
    """Every event published so far (waits for the last batch to settle)."""
    events, idle_since = [], time.monotonic()
    while time.monotonic() - idle_since < 0.3:
        if sub.poll(50):
            _, _, payload = sub.recv_multipart()
            events += DECODE.decode(payload).events
            idle_since = time.monotonic()
    return events


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


A = prompt(100, 80)  # 5 pages; a hit reuses 4 (one token is always computed)
FILLERS = [prompt(1000 + 200 * k, 150) for k in range(7)]  # 9 reusable pages each


def test_evicted_prefix_comes_back_from_host_then_disk(tiered):
    s, sub = tiered["server"], tiered["sub"]
    time.sleep(0.3)  # the subscription settles (PUB drops what no subscriber asked for yet)
    refs = tiered["refs"] = {}
    refs["A"] = generate(s, A)  # computed: the reference
    for i, f in enumerate(FILLERS[:2]):
        refs[i] = generate(s, f)
    before = stats(s)
    assert generate(s, A) == refs["A"]
    after = stats(s)
    from_host = delta(before, after, "hicache_hit_tokens_cpu")
    assert from_host > 0 and delta(before, after, "hicache_hits_storage") == 0, after
    assert delta(before, after, "cache_hit_tokens") == 4 * PAGE  # pool + host: the whole prefix
    s.wait_idle()

    # five more fillers (45 pages) push A out of the pool and out of the 16-page host tier
    for i, f in enumerate(FILLERS[2:], start=2):
        refs[i] = generate(s, f)
    before = stats(s)
    assert generate(s, A) == refs["A"]
    after = stats(s)
    assert delta(before, after, "hicache_hit_tokens_storage") == 4 * PAGE, after
    assert delta(before, after, "hicache_hits_cpu") == 0
    assert after["hicache_corrupt_cpu"] == after["hicache_corrupt_storage"] == 0
    s.wait_idle()

    events = drain(sub)
    a_hashes = chain_hashes(None, A, PAGE)
    by_medium: dict = {}
    for e in events:
        if isinstance(e, BlockStored):
            by_medium.setdefault(("stored", e.medium), set()).update(e.block_hashes)
            parent = e.parent_block_hash  # every stored block chains from its tokens
            for i, h in enumerate(e.block_hashes):
                assert h == expected_hash(parent, e.token_ids[i * PAGE : (i + 1) * PAGE])
                parent = h
        elif isinstance(e, BlockRemoved):
            by_medium.setdefault(("removed", e.medium), set()).update(e.block_hashes)
    assert set(a_hashes[:4]) <= by_medium[("stored", "CPU")]
    assert set(a_hashes[:4]) <= by_medium[("stored", "STORAGE")]
    assert set(a_hashes[:4]) <= by_medium[("removed", "CPU")]  # the host tier's LRU dropped them
    assert set(a_hashes[:4]) <= by_medium[("removed", None)]  # the pool's own events: no medium
    assert ("removed", "STORAGE") not in by_medium

    metrics = s.http.get("/metrics").text
    hit_lines = [
        ln for ln in metrics.splitlines() if ln.startswith("pdserve:hicache_hit_tokens_total")
    ]
    assert any('medium="CPU"' in ln and float(ln.split()[-1]) >= from_host for ln in hit_lines)
    assert any('medium="STORAGE"' in ln and float(ln.split()[-1]) >= 4 * PAGE for ln in hit_lines)


def page_file(disk: str, h: int) -> str:
    (path,) = glob.glob(os.path.join(disk, "*", f"{h:016x}.kv"))
    return path


def test_restart_hits_the_disk_and_a_corrupt_entry_is_recomputed(tiered):
    s, disk, refs = tiered["server"], tiered["disk"], tiered["refs"]
    a_hashes, f_hashes = chain_hashes(None, A, PAGE), chain_hashes(None, FILLERS[0], PAGE)

    def written():  # every page of both prompts has been evicted, so written to disk
        return all(
            glob.glob(os.path.join(disk, "*", f"{h:016x}.kv")) for h in a_hashes[:4] + f_hashes[:9]
        )

    c.wait_for(written, 30, "the disk tier's writes")
    s.stop()
    # flip bytes in the payload of A's first page: its whole prefix must be recomputed
    path = page_file(disk, a_hashes[0])
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        tail = f.read(8)
        f.seek(-100, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))

    pub = c.free_port()
    s2 = c.server("Tier2", tiered["model"], tiered["logs"], *tier_args(disk, "write_through", pub))
    tiered["servers"].append(s2)
    s2.start()
    tiered["server2"] = s2
    # the disk's entries are announced with their medium
    snap = s2.http.get("/kv_events/snapshot").json()["groups"][0]["events"]
    on_disk = {h for e in snap if e.get("medium") == "STORAGE" for h in e["block_hashes"]}
    assert set(f_hashes[:9]) <= on_disk

    before = stats(s2)
    assert generate(s2, FILLERS[0]) == refs[0]
    after = stats(s2)
    assert delta(before, after, "hicache_hit_tokens_storage") == 9 * PAGE, after

    assert generate(s2, A) == refs["A"]
    final = stats(s2)
    assert delta(after, final, "hicache_corrupt_storage") == 1
    assert delta(after, final, "hicache_hit_tokens_storage") == 0

    def rewritten():  # dropped, and written again (write_through) from the recomputed pages
        try:
            with open(path, "rb") as f:
                f.seek(-100, os.SEEK_END)
                return f.read(8) == tail
        except OSError:
            return False

    c.wait_for(rewritten, 30, "the corrupt entry to be replaced by an intact one")
    s2.wait_idle()


def test_write_through_fills_the_host_tier_and_flush_cache_empties_every_tier(tiered):
    """With write_through a prompt's pages are in the host tier (and on disk) as soon as they
    enter the prefix cache; ``/flush_cache`` then empties the pool and every tier: the snapshot
    holds no block, the disk no file, and the prompt is computed again (no hit anywhere)."""
    s2, disk = tiered["server2"], tiered["disk"]
    C = prompt(5000, 70)  # 4 reusable pages
    hashes = chain_hashes(None, C, PAGE)[:4]
    ref = generate(s2, C)
    s2.wait_idle()

    def blocks(medium):
        snap = s2.http.get("/kv_events/snapshot").json()["groups"][0]["events"]
        return {h for e in snap if e.get("medium") == medium for h in e["block_hashes"]}

    assert set(hashes) <= blocks("CPU")  # written through while the pool still holds them
    c.wait_for(lambda: set(hashes) <= blocks("STORAGE"), 30, "the disk tier's writes")
    assert s2.http.post("/flush_cache").status_code == 200
    assert not blocks("CPU") and not blocks("STORAGE") and not blocks(None)
    assert not glob.glob(os.path.join(disk, "*", "*.kv"))
    before = stats(s2)
    assert generate(s2, C) == ref
    after = stats(s2)
    for key in ("cache_hit_tokens", "hicache_hit_tokens_cpu", "hicache_hit_tokens_storage"):
        assert delta(before, after, key) == 0, (key, after)
    s2.wait_idle()


def test_a_two_rank_server_hits_its_ranks_tiers(tiered):
    """Under TP each rank keeps its own tiers (its heads of each page, under its rank's layout
    key) and the ranks load as many pages as the one that found fewest: a prefix evicted from
    the pool comes back from both ranks' host tiers and disks with the tokens of its first run,
    and when one rank's disk lost it, both compute it again (rather than part ways)."""
    disk = str(tiered["logs"] / "disk-tp2")
    args = [a for a in tier_args(disk, "write_back", c.free_port()) if a]
    s = c.server("TierTp2", tiered["model"], tiered["logs"], *args, "--tp-size", "2")
    tiered["servers"].append(s)
    s.start()
    ref = generate(s, A)
    for f in FILLERS[:2]:
        generate(s, f)
    before = stats(s)
    assert generate(s, A) == ref
    after = stats(s)
    assert delta(before, after, "cache_hit_tokens") == 4 * PAGE, after  # pool + host
    assert delta(before, after, "hicache_hit_tokens_cpu") > 0, after
    for f in FILLERS[2:]:  # out of the host tiers too
        generate(s, f)
    before = stats(s)
    assert generate(s, A) == ref
    after = stats(s)
    assert delta(before, after, "hicache_hit_tokens_storage") == 4 * PAGE, after
    layouts = {re.search(r"-tp\d+of\d+-", d).group() for d in glob.glob(os.path.join(disk, "*"))}
    assert layouts == {"-tp0of2-", "-tp1of2-"}  # each rank's pages under its own key
    # rank 1 loses A's entries (a full disk, a wiped directory): both ranks compute A again
    for f in FILLERS:
        generate(s, f)
    s.wait_idle()
    for h in chain_hashes(None, A, PAGE)[:4]:
        for path in glob.glob(os.path.join(disk, "*-tp1of2-*", f"{h:016x}.kv")):
            os.unlink(path)
    before = stats(s)
    assert generate(s, A) == ref
    after = stats(s)
    assert delta(before, after, "hicache_hit_tokens_storage") == 0, after  # rank 0 found them
    from tests.e2e.test_tp import all_ranks_idle

    all_ranks_idle(s)
    s.stop()


# ---- PD: the tiers on a prefill server and on a decode server with its prefix cache -----------
PD_ARGS = [
    "--page-size",
    str(PAGE),
    "--max-total-tokens",
    "512",  # 32 pages
    "--num-reserved-decode-tokens",
    "64",
    "--enable-hierarchical-cache",
    "--hicache-write-policy",
    "write_back",
    "--disaggregation-bootstrap-timeout",
    "20",
    "--disaggregation-waiting-timeout",
    "20",
]


@pytest.fixture(scope="module")
def pd_tiered(tmp_path_factory, tiny_llama_path):
    logs = tmp_path_factory.mktemp("kv_tier_pd")
    P, _ = c.prefill("Ptier", tiny_llama_path, logs, *PD_ARGS)
    D = c.decode(
        "Dtier", tiny_llama_path, logs, "--disaggregation-decode-enable-radix-cache", *PD_ARGS
    )
    R = None
    try:
        c.start_all((P, D))
        R = c.router("Rtier", [P], [D], logs).start()
        yield P, D, R
    finally:
        c.stop_all([x for x in (R, D, P) if x is not None])


def test_pd_prefill_and_decode_both_hit_their_host_tier(pd_tiered, reference):
    P, D, R = pd_tiered
    ids = prompt(30000, 200)  # 12 reusable pages

    def run(x: list[int]) -> list[int]:
        body = {
            "input_ids": x,
            "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True},
        }
        r = localhttp.post(R.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    assert run(ids) == reference(ids)["output_ids"]
    for k in range(4):  # 4 x 19 pages: the prompt leaves both pools
        run(prompt(40000 + 500 * k, 300))
    for s in (P, D):
        s.wait_idle()
    before = {s: stats(s) for s in (P, D)}
    assert run(ids) == reference(ids)["output_ids"]
    for s in (P, D):
        s.wait_idle()
        after = stats(s)
        assert delta(before[s], after, "hicache_hit_tokens_cpu") == 12 * PAGE, (s.name, after)
