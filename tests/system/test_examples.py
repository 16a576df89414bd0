"""Every examples/*.pp compiles, checks and simulates at d in {2, 4, 8, 16} and
the microbatch counts its header allows (its `expect` clauses hold there)."""

from __future__ import annotations

import pytest

from ppdsl.compiler import compile_file
from tests.paths import EXAMPLES

DEVICES = (2, 4, 8, 16)

# example -> the microbatch counts to try for d devices (the header's constraint)
MICROBATCHES = {
    "gpipe": lambda d: (1, d, 2 * d + 1),
    "1f1b": lambda d: (d, 2 * d, 3 * d + 1),
    "1f1b_recompute": lambda d: (d, 2 * d, 3 * d + 1),
    "zb_h1": lambda d: (d, 2 * d, 3 * d + 1),
    "zb_h2": lambda d: (2 * d - 1, 2 * d, 3 * d + 1),
    "v_min": lambda d: (2, d, 2 * d, 3 * d + 1),
    "v_half": lambda d: (d, 2 * d, 3 * d + 1),
    "v_zb": lambda d: (2 * d - 1, 2 * d, 3 * d + 1),
    "zb_v": lambda d: (2 * d - 1, 2 * d, 3 * d + 1),
    "interleaved_1f1b": lambda d: (d, 2 * d, 3 * d),
    "interleaved_zb": lambda d: (d, 2 * d, 3 * d),
    "looped_bfs": lambda d: (d, 2 * d, 3 * d + 1),
    "dualpipe_v": lambda d: (2 * d, 2 * d + 1, 3 * d),
    "dualpipe": lambda d: (2 * d, 2 * d + 2, 4 * d),
}
# extra parameters worth a run (chunks per device)
VARIANTS = {
    "interleaved_1f1b": ({"v": "3"},),
    "interleaved_zb": ({"v": "3"},),
    "looped_bfs": ({"v": "3"},),
}


def _compile(name: str, overrides: dict[str, str]):
    compiled = compile_file(EXAMPLES / f"{name}.pp", overrides)
    return compiled.schedule, compiled.timeline


def test_every_example_has_a_grid():
    """A new example must say which microbatch counts it allows."""
    assert sorted(p.stem for p in EXAMPLES.glob("*.pp")) == sorted(MICROBATCHES)


def test_examples_cite_a_paper_and_their_constraint():
    """Each header names its source and the (d, m) it works for."""
    for path in EXAMPLES.glob("*.pp"):
        head = path.read_text().split("\nschedule ", 1)[0]
        assert "Works for every d" in head, path.name
        assert any(word in head for word in ("ICLR", "NeurIPS", "MLSys", "SC 2021", "arXiv")), (
            path.name
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MICROBATCHES))
@pytest.mark.parametrize("d", DEVICES)
def test_example_compiles_at_its_default_microbatches(name, d):
    """The file's own m at d devices: valid, expectations hold, no warnings of error rank."""
    schedule, timeline = _compile(name, {"d": str(d)})
    assert schedule.num_devices == d
    assert timeline.makespan > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MICROBATCHES))
def test_example_compiles_on_the_whole_grid(name):
    """Every d in {2, 4, 8, 16} and every allowed m (and the chunk-count variants)."""
    for d in DEVICES:
        for m in MICROBATCHES[name](d):
            for extra in ({}, *VARIANTS.get(name, ())):
                schedule, _ = _compile(name, {"d": str(d), "m": str(m), **extra})
                assert schedule.num_microbatches == m
