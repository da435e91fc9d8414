"""``pdserve bench-transfer`` end to end on a small size: every available backend moves the pages
through pdserve and through its library, and the figures come out."""

import json

import pytest

from pdserve.bench.transfer import Geometry, main, parse_size


def test_parse_size():
    assert parse_size("16KiB") == 16384
    assert parse_size("4 MiB") == 4 << 20
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("47MB") == 47_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(Exception, match="not a size"):
        parse_size("4 parsecs")


def test_geometry_one_descriptor_per_page():
    geo = Geometry.for_page_bytes(1 << 30, 256 << 10)
    assert geo.item_bytes == 256 << 10 and geo.total_bytes == 1 << 30
    assert sorted(geo.dst_pages()) == geo.src_pages()  # a permutation of the same pages


def test_small_run_reports_every_backend(tmp_path, capsys):
    out = tmp_path / "transfer.json"
    assert (
        main(
            [
                "--size",
                "2MiB",
                "--page-sizes",
                "64KiB",
                "--repeats",
                "1",
                "--no-request",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    rows = {r["backend"]: r for r in data["rows"]}
    assert set(rows) | set(data["skipped"]) == {"local", "mooncake", "nixl"}
    assert "local" in rows
    for name, row in rows.items():
        assert row["bytes"] == 2 << 20 and row["descriptors"] == 32
        assert row["ours_gbps"] > 0 and row["memcpy_gbps"] > 0 and row["ours_over_memcpy"] > 0
        if name != "local":
            assert row["raw_gbps"] > 0 and row["ours_over_raw"] > 0
    printed = capsys.readouterr().out
    assert "ours/raw" in printed and "ours/memcpy" in printed
