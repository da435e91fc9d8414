import json
import threading
import time
import urllib.request

import pytest

from pdserve.disagg.bootstrap import (
    BootstrapError,
    BootstrapNotReady,
    BootstrapServer,
    fetch_prefill_info,
    fetch_rank_info,
    health,
    register_rank,
)
from tests.helpers.ports import free_port

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def rank_info(tp_rank, pp_rank=0, tp_size=2, pp_size=1, port=None, **over):
    info = {
        "tp_size": tp_size,
        "tp_rank": tp_rank,
        "dp_size": 1,
        "dp_rank": 0,
        "pp_size": pp_size,
        "pp_rank": pp_rank,
        "rank_ip": "127.0.0.1",
        "rank_port": port or 40000 + 10 * tp_rank + pp_rank,
        "page_size": 16,
        "kv_dtype": "bfloat16",
        "layout": "layer,kv,page,head,token,dim",
        "model_fingerprint": "fp1",
        "num_layers": 4,
        "kv_heads": 8,
    }
    info.update(over)
    return info


def get(port, path):
    try:
        with _opener.open(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def server():
    s = BootstrapServer("127.0.0.1", 0, expected_ranks=2)
    yield s
    s.shutdown()


def test_instance_info_503_until_all_ranks(server):
    assert health("127.0.0.1", server.port)
    code, body = get(server.port, "/route?prefill_dp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
    assert code == 503 and b"0 of 2" in body
    register_rank("127.0.0.1", server.port, rank_info(0))
    with pytest.raises(BootstrapNotReady, match="1 of 2"):
        fetch_prefill_info("127.0.0.1", server.port)
    register_rank("127.0.0.1", server.port, rank_info(1))
    info = fetch_prefill_info("127.0.0.1", server.port)
    assert info == {
        "tp_size": 2,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": 16,
        "kv_dtype": "bfloat16",
        "layout": "layer,kv,page,head,token,dim",
        "model_fingerprint": "fp1",
        "num_layers": 4,
        "kv_heads": 8,
    }
    assert server.num_registered == 2


def test_rank_lookup_404_400(server):
    register_rank("127.0.0.1", server.port, rank_info(1, port=41234))
    assert fetch_rank_info("127.0.0.1", server.port, 0, 1, 0) == {
        "rank_ip": "127.0.0.1",
        "rank_port": 41234,
        "dp_rank": 0,
        "tp_rank": 1,
        "pp_rank": 0,
    }
    code, body = get(server.port, "/route?prefill_dp_rank=0&target_tp_rank=0&target_pp_rank=0")
    assert code == 404 and b"tp0" in body
    with pytest.raises(BootstrapError, match="HTTP 404"):
        fetch_rank_info("127.0.0.1", server.port, 0, 0, 0)
    for q in (
        "prefill_dp_rank=0&target_tp_rank=1",
        "prefill_dp_rank=0&target_tp_rank=x&target_pp_rank=0",
        "prefill_dp_rank=-1&target_tp_rank=1&target_pp_rank=0",
    ):
        code, body = get(server.port, "/route?" + q)
        assert code == 400, q
    code, _ = get(server.port, "/nope")
    assert code == 404


def test_bad_registrations_rejected(server):
    with pytest.raises(BootstrapError, match="missing field 'rank_port'"):
        info = rank_info(0)
        del info["rank_port"]
        register_rank("127.0.0.1", server.port, info)
    with pytest.raises(BootstrapError, match="tp_rank 2 out of range"):
        register_rank("127.0.0.1", server.port, rank_info(2))
    register_rank("127.0.0.1", server.port, rank_info(0))
    with pytest.raises(BootstrapError, match="page_size: 16 vs 32"):
        register_rank("127.0.0.1", server.port, rank_info(1, page_size=32))
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/route", data=b"{not json", method="PUT"
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        _opener.open(req, timeout=5)
    assert e.value.code == 400


def test_register_retries_until_server_is_up():
    port = free_port()
    started = []

    def start_later():
        time.sleep(0.3)
        started.append(BootstrapServer("127.0.0.1", port, expected_ranks=1))

    t = threading.Thread(target=start_later)
    t.start()
    try:
        register_rank(
            "127.0.0.1", port, rank_info(0, tp_size=1), attempts=20, backoff=0.05, max_backoff=0.2
        )
        t.join()
        assert fetch_prefill_info("127.0.0.1", port)["tp_size"] == 1
    finally:
        t.join()
        for s in started:
            s.shutdown()


def test_unreachable_server_is_not_ready():
    port = free_port()
    with pytest.raises(BootstrapNotReady, match="unreachable"):
        fetch_prefill_info("127.0.0.1", port, timeout=1)
    with pytest.raises(BootstrapError, match="after 2 attempts"):
        register_rank("127.0.0.1", port, rank_info(0), attempts=2, backoff=0.01)
    assert not health("127.0.0.1", port)


def test_shutdown_frees_port():
    s = BootstrapServer("127.0.0.1", 0, expected_ranks=1)
    port = s.port
    s.shutdown()
    s2 = BootstrapServer("127.0.0.1", port, expected_ranks=1)  # port reusable right away
    try:
        assert json.loads(
            get(port, "/route?prefill_dp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")[1]
        )
    finally:
        s2.shutdown()
