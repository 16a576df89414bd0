"""Families of schedules (docs/testing.md): ranges over parameters, their
enumeration in order, seeded sampling, and shrinking to the smallest failing
parameters."""

from __future__ import annotations

import io

import pytest

from ppdsl.families import (
    Outcome,
    count_instances,
    instances,
    parse_range,
    parse_ranges,
    progress_reporter,
    shrink,
    sweep,
)


def _broken_at_12_odd(params: dict[str, int]) -> Outcome:
    """A family that fails only at d >= 12 with m odd."""
    bad = params["d"] >= 12 and params["m"] % 2 == 1
    return Outcome(("broken",) if bad else ())  # type: ignore[arg-type]


def test_ranges_include_both_ends_and_may_use_earlier_names():
    """`d=2..4`, `m=d..2*d` enumerates d from 2 to 4 and m from d to 2d, in order."""
    ranges = parse_ranges(["d=2..4", "m=d..2*d"])
    got = [(p["d"], p["m"]) for p in instances(ranges)]
    assert got == [(d, m) for d in range(2, 5) for m in range(d, 2 * d + 1)]
    assert count_instances(ranges) == len(got) == 3 + 4 + 5


def test_a_list_range_gives_its_values():
    """`v=1,2,4` gives exactly those values."""
    assert [p["v"] for p in instances(parse_ranges(["v=1,2,4"]))] == [1, 2, 4]


@pytest.mark.parametrize(
    ("text", "message"),
    [("d", "expected NAME=LOW..HIGH"), ("d=1..2..3", "one '..'"), ("m=d..4", "d"),
     ("d=1..(", "'('"), ("3=1..2", "expected NAME")],
)
def test_a_bad_range_is_a_clear_error(text, message):
    """A malformed range or one using a name no earlier range gives is a ValueError naming it."""
    with pytest.raises(ValueError, match="--for") as info:
        parse_range(text, [])
    assert message in str(info.value)


def test_a_bound_that_is_no_integer_is_an_error():
    """`m=d/2..d` at an odd d is a ValueError naming the range and the instance."""
    ranges = parse_ranges(["d=3..3", "m=d/2..d"])
    with pytest.raises(ValueError, match="not an integer"):
        list(instances(ranges))


def test_enumeration_stops_at_the_first_failure():
    """The sweep stops at d=12, m=13: the first invalid instance in order."""
    ranges = parse_ranges(["d=2..16", "m=d..4*d"])
    result = sweep(_broken_at_12_odd, ranges)
    assert result.failure is not None
    assert result.failure.params == {"d": 12, "m": 13}
    before = sum(3 * d + 1 for d in range(2, 12)) + 2  # every d < 12, then m = 12, 13
    assert result.checked == before and result.mode == "enumerate"


def test_shrink_lowers_each_parameter_to_the_smallest_failing_value():
    """From d=15, m=37, shrinking reaches d=12 and the smallest odd m of its range."""
    ranges = parse_ranges(["d=2..16", "m=d..4*d"])
    assert shrink(lambda p: _broken_at_12_odd(p).failed, ranges, {"d": 15, "m": 37}) == {
        "d": 12, "m": 13}


def test_sampling_finds_and_shrinks_the_failure_reproducibly():
    """`samples` draws instances with hypothesis; the failure shrinks to (12, 13)
    and the same seed checks the same instances."""
    ranges = parse_ranges(["d=2..64", "m=d..4*d"])
    first = sweep(_broken_at_12_odd, ranges, samples=200, seed=7)
    again = sweep(_broken_at_12_odd, ranges, samples=200, seed=7)
    assert first.mode == "sample" and first.failure is not None
    assert first.failure.params == {"d": 12, "m": 13}
    assert list(first.outcomes) == list(again.outcomes)


def test_a_valid_family_checks_every_instance_and_counts_skips():
    """A family with no failure checks every instance; `require`-skipped ones are counted."""
    ranges = parse_ranges(["d=1..5", "m=1..d"])

    def check(params):
        return Outcome(("outside",), skipped=True) if params["m"] == 1 else Outcome()  # type: ignore[arg-type]

    result = sweep(check, ranges)
    assert result.failure is None
    assert result.checked == 15 and result.skipped == 5


def test_progress_prints_when_asked(monkeypatch):
    """With PPDSL_PROGRESS=1 the reporter writes `done/total instances (params)`; =0 is silent."""
    out = io.StringIO()
    monkeypatch.setenv("PPDSL_PROGRESS", "1")
    report = progress_reporter("x.pp", out)
    report.every = 0.0
    report(3, 10, {"d": 4, "m": 8})
    assert "x.pp: 3/10 instances (d=4 m=8)" in out.getvalue()
    monkeypatch.setenv("PPDSL_PROGRESS", "0")
    quiet = io.StringIO()
    silent = progress_reporter("x.pp", quiet)
    silent.every = 0.0
    silent(3, 10, {"d": 4})
    assert quiet.getvalue() == ""
