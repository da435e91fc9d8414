"""Health, info, load, cache, metrics and abort endpoints of a live server."""

from __future__ import annotations

import socket
import threading
import time

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import SERVED_MODEL_NAME, sse_events, wait_for
from tests.helpers import localhttp

LONG = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}


def test_health_and_health_generate(live):
    assert live.http.get("/health").status_code == 200
    assert live.http.get("/health_generate").status_code == 200


def test_server_info_shape(live):
    for path in ("/server_info", "/get_server_info"):
        info = live.http.get(path).json()
        assert info["model_path"] == live.model_path
        assert info["served_model_name"] == SERVED_MODEL_NAME
        assert info["tp_size"] == 1 and info["dp_size"] == 1
        assert info["disaggregation_mode"] == "null"
        assert info["status"] == "ready"
        assert info["max_total_num_tokens"] > 0
        assert isinstance(info["internal_states"][0]["running"], int)


def test_model_info_and_models(live):
    for path in ("/model_info", "/get_model_info"):
        info = live.http.get(path).json()
        assert info["model_path"] == live.model_path
        assert info["tokenizer_path"] == live.model_path
        assert info["is_generation"] is True
        assert info["context_length"] == 4096
    models = live.http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [SERVED_MODEL_NAME]


def test_get_load_shape(live):
    load = live.http.get("/get_load").json()
    assert isinstance(load, list) and len(load) == 1
    # sglang's fields, and the requests a full queue refused (the autoscaler reads them)
    assert set(load[0]) == {
        "dp_rank",
        "num_reqs",
        "num_waiting_reqs",
        "num_tokens",
        "num_shed_reqs",
    }
    assert load[0]["dp_rank"] == 0
    assert all(isinstance(v, int) for v in load[0].values())


def test_flush_cache(live):
    live.http.post(
        "/generate", json={"text": "fill the cache " * 20, "sampling_params": {"max_new_tokens": 2}}
    )
    live.wait_idle()
    assert live.http.post("/flush_cache").status_code == 200
    assert live.wait_idle()["cached_pages"] == 0


def metric_samples(live) -> dict[tuple[str, tuple], float]:
    r = live.http.get("/metrics")
    assert r.status_code == 200
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[
                (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))
            ] = s.value
    return out


def test_metrics_parse_and_move(live):
    before = metric_samples(live)
    r = live.http.post(
        "/generate",
        json={"text": "count me", "sampling_params": {"max_new_tokens": 7, "ignore_eos": True}},
    )
    prompt_tokens = r.json()["meta_info"]["prompt_tokens"]
    after = metric_samples(live)

    def delta(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert delta("pdserve:generation_tokens_total") == 7
    assert delta("pdserve:prompt_tokens_total") == prompt_tokens
    assert delta("pdserve:time_to_first_token_seconds_count") == 1
    assert delta("pdserve:e2e_request_latency_seconds_count") == 1
    assert delta("pdserve:inter_token_latency_seconds_count") >= 1
    assert delta("pdserve:requests_total", (("finish_reason", "length"),)) == 1
    for gauge in (
        "pdserve:num_running_reqs",
        "pdserve:num_waiting_reqs",
        "pdserve:kv_pages_used",
        "pdserve:kv_pages_free",
        "pdserve:cache_hit_rate",
    ):
        assert (gauge, ()) in after, gauge
    assert after[("pdserve:kv_pages_free", ())] > 0
    # the gateway's view: nothing queued, the finished request's pages evictable, so free
    assert after[("pdserve:num_queue_reqs", ())] == 0
    assert after[("pdserve:kv_cache_usage_perc", ())] == 0


def test_kv_usage_counts_the_pages_a_running_request_holds(live):
    # the gauges are read while the stream is still open: breaking out of ``iter_lines`` would
    # close the connection (httpx closes it when the generator is dropped) and abort the request
    during = None
    with localhttp.Client(base_url=live.url, timeout=60) as c:
        with c.stream(
            "POST",
            "/generate",
            json={"text": "a long story", "sampling_params": LONG, "stream": True},
        ) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    during = metric_samples(live)
                    break
            lines.close()
    assert during is not None, "the stream sent no event"
    live.wait_idle()
    after = metric_samples(live)
    assert during[("pdserve:num_running_reqs", ())] == 1
    assert 0 < during[("pdserve:kv_cache_usage_perc", ())] < 1
    assert after[("pdserve:kv_cache_usage_perc", ())] == 0


def test_client_disconnect_mid_stream_aborts(live):
    generated_before = live.scheduler_stats()["generation_tokens"]
    with localhttp.Client(base_url=live.url, timeout=60) as c:
        with c.stream(
            "POST",
            "/generate",
            json={"text": "a long story", "sampling_params": LONG, "stream": True},
        ) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 2:
                    break
            assert chunks == 2
        # leaving the block closed the connection mid-stream
    live.wait_idle()
    assert live.scheduler_stats()["generation_tokens"] - generated_before < LONG["max_new_tokens"]


def test_client_disconnect_before_response_aborts(live):
    generated_before = live.scheduler_stats()["generation_tokens"]
    body = (
        b'{"text": "another long story", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": '
        b"true}}"
    )
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        # the request is running once the scheduler reports it
        wait_for(
            lambda: live.http.get("/get_load").json()[0]["num_reqs"] == 1,
            30,
            "the request to start",
        )
    live.wait_idle()
    assert live.scheduler_stats()["generation_tokens"] - generated_before < 4000


def test_abort_request_by_rid_ends_the_stream_with_an_error(live):
    events: list = []

    def stream() -> None:
        with localhttp.Client(base_url=live.url, timeout=60) as c:
            with c.stream(
                "POST",
                "/generate",
                json={
                    "text": "abort me",
                    "rid": "abort-me",
                    "sampling_params": LONG,
                    "stream": True,
                },
            ) as r:
                events.extend(sse_events(r.iter_lines()))

    t = threading.Thread(target=stream)
    t.start()
    wait_for(
        lambda: live.http.get("/get_load").json()[0]["num_reqs"] == 1, 30, "the request to start"
    )
    assert live.http.post("/abort_request", json={"rid": "abort-me"}).json() == {"aborted": 1}
    t.join(60)
    assert not t.is_alive()
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and events[-2]["error"]["code"] == 499
    assert all(len(e["output_ids"]) < LONG["max_new_tokens"] for e in events[:-2])


def test_an_idle_connection_outlives_pooling_clients(live):
    """A client that pools connections (pdserve's router keeps idle ones 30 s) sends its next
    request on a connection that sat idle: the server must not have closed it (uvicorn's default
    closes after 5 s, and the request racing that close failed with "Server disconnected")."""
    from pdserve.keepalive import CLIENT_IDLE_S, SERVER_IDLE_S

    assert SERVER_IDLE_S > max(CLIENT_IDLE_S, 90)  # 90 s: reqwest's pool, in sglang-router
    host, port = live.url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(7)  # past uvicorn's default keep-alive
        sock.sendall(request)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200"), "the server closed an idle connection"
