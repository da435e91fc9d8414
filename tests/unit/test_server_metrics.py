"""The gauges gateway schedulers read, from a scheduler's stats (server/metrics.py)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdserve.server.metrics import ServerMetrics


def _gauges(m: ServerMetrics) -> dict[str, float]:
    return {
        s.name: s.value
        for family in text_string_to_metric_families(m.render().decode())
        for s in family.samples
    }


def test_queue_and_kv_usage_gauges():
    m = ServerMetrics("tiny")
    m.set_scheduler_stats(
        {
            "running": 3,
            "waiting": 2,
            "prealloc_queue": 4,
            "transfer_queue": 1,
            "inflight_queue": 7,  # prefilled, sending its KV: not queued
            "kv_pages_total": 100,
            "kv_pages_used": 60,
            "kv_pages_evictable": 20,  # prefix cache nobody uses: as good as free
        }
    )
    g = _gauges(m)
    assert g["pdserve:num_queue_reqs"] == 7
    assert g["pdserve:kv_cache_usage_perc"] == 0.4
    m.set_scheduler_stats(
        {"waiting": 0, "kv_pages_total": 100, "kv_pages_used": 5, "kv_pages_evictable": 5}
    )
    g = _gauges(m)
    assert g["pdserve:num_queue_reqs"] == 0 and g["pdserve:kv_cache_usage_perc"] == 0
