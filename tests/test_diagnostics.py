"""Diagnostics: one error per cause, edits applied as LSP does, help lines."""

from __future__ import annotations

from ppdsl.diagnostics import (
    CompileError,
    Diagnostic,
    Edit,
    Fix,
    Span,
    apply_edits,
    group_repeats,
    register_source,
    render,
)


def _at(line: int) -> Span:
    return Span("g.pp", line, 5, line, 9)


def test_one_cause_on_several_devices_is_one_error():
    """Errors at one line that differ only in the device are one error naming
    the devices, whose notes show the first instances (docs/language.md, Errors)."""
    found = [
        Diagnostic("error", f"on device {dev}, B of stage {dev} collides", _at(7),
                   ((_at(6), f"F of stage {dev} starts here"),))
        for dev in range(4)
    ]
    [one] = group_repeats(found)
    assert one.message == "on devices 0\u20133 (device 0 shown), B of stage 0 collides"
    assert one.notes[0] == (_at(6), "F of stage 0 starts here")
    assert (_at(7), "also: on device 1, B of stage 1 collides") in one.notes
    assert len(CompileError(found).diagnostics) == 1


def test_different_lines_stay_apart():
    """The same message at two lines is two causes, not one."""
    found = [Diagnostic("error", "device 0 misses F7", _at(3)),
             Diagnostic("error", "device 1 misses F7", _at(4))]
    assert group_repeats(found) == found


def test_apply_edits_is_end_exclusive_and_in_the_old_positions():
    """Edits are 1-based, end exclusive, and all refer to the text before any of them."""
    text = "ab\ncdef\ng"
    edits = [Edit(1, 2, 1, 3, "XYZ"), Edit(2, 1, 2, 3, "")]
    assert apply_edits(text, edits) == "aXYZ\nef\ng"


def test_render_shows_each_fix_as_a_help_line_with_the_edited_line():
    """Text output carries each fix: `help:` and the source line as it reads after it."""
    register_source("h.pp", "schedule s {\n    F at s + 1\n}\n")
    fix = Fix("start F at s (was s + 1)", (Edit(2, 10, 2, 15, "s"),))
    d = Diagnostic("error", "collides", Span("h.pp", 2, 10, 2, 14), fixes=(fix,))
    lines = render(d).split("\n")
    assert lines[-2:] == ["  help: start F at s (was s + 1)", "    h.pp:2: F at s"]


def test_the_corpus_counts_an_error_repeated_per_device():
    """tests/mutations' measure of repeats counts per-device copies, and none once grouped."""
    from tests.mutations import repeated_errors

    found = [Diagnostic("error", f"on device {dev}, B of stage {dev} collides", _at(7))
             for dev in range(4)]
    assert repeated_errors(found) == 3
    assert repeated_errors(group_repeats(found)) == 0
