"""Bad input never crashes the compiler: every example, edited at random the way
a hurried user breaks a file (characters and lines deleted, duplicated or
swapped, tokens and numbers dropped in), either compiles or comes back as
CompileError diagnostics, every error located in the file. Any other exception
is a bug (the CLI would report it as an internal error, exit 3)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppdsl.compiler import compile_source
from ppdsl.diagnostics import CompileError
from tests.paths import EXAMPLES

SOURCES = {p.stem: p.read_text() for p in sorted(EXAMPLES.glob("*.pp"))}
TOKENS = [
    "{", "}", "(", ")", ",", ";", ":", "=", "..", "*", "/", "//", "%", "-", "+", "?",
    "==", "<=", "0", "1", "-1", "3/2", "1e400", "99999999999999999999", "d", "m", "i", "s",
    "j", "c", "F", "B", "W", "BW", "at", "fill", "chunk", "block", "period", "order",
    "for", "in", "repeat", "if", "else", "let", "param", "place", "vshape", "looped(0)",
    "wave(2)", "expect", "peak_memory[9]", "bubble", "min(", "ceil(", "\n", " ", "\t",
    "#", "\"", "é", "\x00",
]


@st.composite
def edited_sources(draw) -> str:
    text = SOURCES[draw(st.sampled_from(sorted(SOURCES)))]
    for _ in range(draw(st.integers(1, 4))):
        n = len(text)
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, min(n, a + 40)))
        edit = draw(st.sampled_from(["delete", "insert", "duplicate", "swap_lines", "replace"]))
        if edit == "delete":
            text = text[:a] + text[b:]
        elif edit == "insert":
            text = text[:a] + draw(st.sampled_from(TOKENS)) + text[a:]
        elif edit == "duplicate":
            text = text[:b] + text[a:b] + text[b:]
        elif edit == "replace":
            text = text[:a] + draw(st.sampled_from(TOKENS)) + text[b:]
        else:
            lines = text.split("\n")
            x = draw(st.integers(0, len(lines) - 1))
            y = draw(st.integers(0, len(lines) - 1))
            lines[x], lines[y] = lines[y], lines[x]
            text = "\n".join(lines)
    return text


@pytest.mark.slow
@settings(
    max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(edited_sources(), st.sampled_from([{}, {"d": "2"}, {"d": "3", "m": "5"}]))
def test_edited_examples_compile_or_fail_with_located_errors(text, overrides):
    """Compiles, or raises CompileError whose errors all point into the file."""
    try:
        compile_source(text, "edited.pp", dict(overrides))
    except CompileError as err:
        errors = [d for d in err.diagnostics if d.severity == "error"]
        assert errors
        for d in errors:
            # a -D override the edited file no longer declares is a command-line error
            if d.span is None:
                assert d.message.startswith("-D "), d
                continue
            assert d.span.file == "edited.pp" and d.span.line >= 1 and d.span.column >= 1, d
