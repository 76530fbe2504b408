"""The links inside one node (harness.node_links): on this CPU host the host memory copy runs through the same
code a GPU node runs (measure, check, table, JSON); the judgement names a pinned host link below the rating's
floor with both ends, and only such a link."""

from __future__ import annotations

import json

from harness.node_links import NodeLink, judge, main, table
from harness.validate_cluster import payload_gbs


def test_cpu_run_writes_every_size_checked_and_timed(tmp_path):
    status = main(["--device", "cpu", "--sizes-mib", "1", "4", "--repeats", "3", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "node-links.json").read_text())
    assert status == 0 and data["verdict"] == "PASS", data
    assert [(x["link"], x["size_bytes"]) for x in data["links"]] == [
        ("host-memcpy", 1 << 20),
        ("host-memcpy", 4 << 20),
    ]
    for x in data["links"]:
        assert len(x["times_s"]) == 3 and all(t > 0 for t in x["times_s"]), x
        assert abs(x["gbs"] - x["size_bytes"] / x["time_s"] / 1e9) < 1e-9 * x["gbs"], x
    md = (tmp_path / "node-links.md").read_text()
    assert "| host-memcpy |" in md and "1 MiB" in md and "4 MiB" in md, md


def _link(name: str, gbs: float, size: int = 1 << 30) -> NodeLink:
    return NodeLink(name, "node7:host", "node7:cuda:0 (H200)", size, [size / gbs / 1e9])


def test_a_pinned_host_link_below_the_floor_is_named_with_both_ends():
    floor = payload_gbs(512) * 0.7  # PCIe Gen5 x16: 64 GB/s raw, 57.6 of payload, floor 40.3
    links = [
        _link("h2d-pinned", floor * 1.05),
        _link("d2h-pinned", floor * 0.5),
        _link("h2d-pageable", floor * 0.2),  # reported, not judged: it bounces through a staging buffer
        _link("d2h-pinned", floor * 0.1, size=1 << 20),  # only the largest size is judged
    ]
    below = judge(links, 512, 0.7)
    assert len(below) == 1, below
    assert below[0].startswith("d2h-pinned node7:host -> node7:cuda:0 (H200)"), below
    assert f"{floor:.1f} GB/s" in below[0], below
    assert judge(links, None, 0.7) == [], "no rating: nothing can be judged below it"


def test_table_has_a_row_per_link_and_a_column_per_size():
    links = [_link("h2d-pinned", 50.0, 1 << 20), _link("h2d-pinned", 55.0), _link("d2d", 2000.0)]
    rows = table(links).splitlines()
    assert rows[0] == "| link | from | to | 1 MiB | 1024 MiB |", rows
    assert rows[2].endswith("| 50.0 | 55.0 |") and rows[3].endswith("| – | 2000.0 |"), rows
