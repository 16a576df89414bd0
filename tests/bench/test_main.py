"""`python -m bench` (bench/__main__.py): flags and their values are the
modules', not bench names."""

from __future__ import annotations

from bench.__main__ import bench_names


def test_only_key_is_not_taken_for_a_bench_name():
    """`python -m bench exact --only KEY --write` runs the exact bench alone and
    leaves KEY to it (bench/bench_exact.py's docstring gives the command)."""
    assert bench_names(["exact", "--only", "unit, V-shape, V-Min's p=8 m=16", "--write"]) == [
        "exact"
    ]
    assert "bench_exact" in bench_names(["--quick"])
