"""Syntax errors a person can act on: lark's error, labelled.

Where the parser stopped (its LALR state) is matched against example bad inputs
(`_EXAMPLE_ERRORS`, as lark's `match_examples` does): a missing value after `=`,
`at` or an operator; a second schedule in one file. What needs the words
themselves is read from the tokens: a keyword that starts a new statement on
the same line, a misspelt statement keyword ("did you mean"), and brackets that
do not match (checked on the text, which names the bracket left open).
Anything else is "unexpected X; expected Y".
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from lark import Lark, Token
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from ppdsl.diagnostics import Diagnostic, Span

__all__ = ["KEYWORDS", "syntax_error", "token_span"]

# Words the grammar reserves; they cannot name a param or a loop variable.
KEYWORDS = (
    "schedule param let require place backward cost memory recompute block period group every "
    "order expect chunk at fill for in reversed repeat if else interleave with and or not"
).split()
_STATEMENTS = (
    "param", "let", "require", "place", "backward", "cost", "memory", "recompute", "block",
    "order", "expect",
)
_ORDER_STATEMENTS = ("let", "for", "repeat", "if", "interleave")


# Where a value must follow: each prefix below, cut off by the end of a line, a
# closing bracket, a comma or the end of the file.
_NEEDS_VALUE = [
    "param d =",
    "let x =",
    "cost F =",
    "cost F[s] =",
    "memory M_B =",
    "memory M_B[s] =",
    "expect bubble <=",
    "expect peak_memory[0] <=",
    "block period 3 {\n F at",
    "block period 3 {\n chunk 0: F at",
    "order {\n let x =",
    "order {\n for j in 0..",
    *(f"param d = 1 {op}" for op in ("+", "-", "*", "/", "//", "%", "<", "==")),
]
_CUT = ("\n}\n", "}", ")", "]", ",", "")
# a block header's values, cut off by the next word of the header or its brace
_HEADER_NEEDS_VALUE = [
    "block period {",
    "block period group 2 every 3 {",
    "block period 3 group {",
    "block period 3 group every 3 {",
    "block period 3 group 2 every {",
]

_EXAMPLE_ERRORS: dict[str, list[str]] = {
    "value": [f"schedule s {{\n{prefix}{cut}" for prefix in _NEEDS_VALUE for cut in _CUT]
    + [f"schedule s {{\n{header}\n}}\n}}\n" for header in _HEADER_NEEDS_VALUE],
    "second schedule": ["schedule s {\n}\nschedule t {\n}\n"],
}
"""Bad inputs by label: an error in the same parser state, at a token of the
same kind, gets the label."""


_labels: dict[tuple[object, str], str] = {}


def _label(exc: UnexpectedToken, parse_fn: Callable[[str], object]) -> str | None:
    """The label of the example that fails in the parser state `exc` failed in
    (the LALR state on top of the stack, whatever is below it: the same mistake
    nested deeper in an expression is the same mistake), at a token of the same
    type. lark's `match_examples` also compares the stack depth, so it is not
    used as is."""
    if not _labels:
        for label, texts in _EXAMPLE_ERRORS.items():
            for text in texts:
                try:
                    parse_fn(text)
                except UnexpectedToken as example:
                    _labels.setdefault((example.state.position, example.token.type), label)
                else:  # pragma: no cover - a bad example is a bug in this file
                    raise AssertionError(f"the example {text!r} parses")
    state = getattr(exc, "state", None)
    return _labels.get((state.position, exc.token.type)) if state is not None else None


def token_span(file: str, tok: Any) -> Span:
    """The span of a token."""
    return Span(file, tok.line, tok.column, tok.end_line, max(tok.column, tok.end_column - 1))


def _describe(tok: Token) -> str:
    if tok.type == "$END":
        return "end of file"
    if tok.type == "_SEP":
        return "';'" if tok.value == ";" else "end of line"
    if tok.type == "NAME":
        return f"name '{tok.value}'"
    if tok.type == "NUMBER":
        return f"number {tok.value}"
    return f"'{tok.value}'"


# Terminals that continue an expression; listed as "an operator" when many are expected.
_OPERATORS = frozenset(
    ["PLUS", "MINUS", "STAR", "SLASH", "_FLOORDIV", "PERCENT", "CMP", "AND", "OR", "QMARK"]
    + ["_DOTDOT"]
)
def _expected_words(expected: set[str], lark: Lark) -> list[str]:
    words = []
    if len(expected) > 6 and expected & _OPERATORS:
        expected = expected - _OPERATORS
        words.append("an operator")
    for name in sorted(expected):
        if name == "CMP":
            words.append("a comparison (<= < == >= >)")
        elif name == "NAME":
            words.append("a name")
        elif name == "NUMBER":
            words.append("a number")
        elif name == "_SEP":
            words.append("end of line")
        elif name == "$END":
            words.append("end of file")
        else:
            try:
                pattern = lark.get_terminal(name).pattern
            except KeyError:
                continue
            words.append(f"'{pattern.value}'" if pattern.type == "str" else name)
    return words


def _keyword_candidates(expected: set[str]) -> list[str]:
    return [k for k in KEYWORDS if k.upper() in expected]


def _unclosed(text: str, file: str) -> Diagnostic | None:
    """A bracket never closed or closed by the wrong kind; None when all match.
    A `}` less indented than the line of the `{` it would close is taken to close an
    outer `{` instead: the inner one is the one never closed."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    lines = text.split("\n")
    indents = [len(line) - len(line.lstrip(" \t")) for line in lines]
    stack: list[tuple[str, int, int]] = []
    suspect: tuple[str, int, int] | None = None
    for lineno, line in enumerate(lines, start=1):
        for col, ch in enumerate(line, start=1):
            if ch == "#":
                break
            if ch in pairs:
                stack.append((ch, lineno, col))
            elif ch in ")]}":
                if not stack:
                    span = Span(file, lineno, col, lineno, col)
                    return Diagnostic("error", f"'{ch}' closes nothing", span)
                opener, oline, ocol = stack.pop()
                if pairs[opener] != ch:
                    span = Span(file, lineno, col, lineno, col)
                    return Diagnostic(
                        "error", f"'{ch}' does not match '{opener}' opened at {oline}:{ocol}", span
                    )
                if ch == "}" and suspect is None and indents[oline - 1] > indents[lineno - 1]:
                    suspect = (opener, oline, ocol)
    if not stack:
        return None
    opener, oline, ocol = suspect if suspect is not None else stack[-1]
    span = Span(file, oline, ocol, oline, ocol)
    return Diagnostic("error", f"'{opener}' opened at {oline}:{ocol} is never closed", span)


def syntax_error(
    exc: UnexpectedInput,
    text: str,
    file: str,
    history: list[Token],
    lark: Lark,
    parse_fn: Callable[[str], object],
) -> Diagnostic:
    """The one diagnostic for a syntax error `exc` in `text`: what is wrong, at
    its place. `history` is the token stream up to the failure (after the
    post-lexer); `parse_fn` parses a whole file (to match the examples)."""
    if isinstance(exc, UnexpectedCharacters):
        span = Span(file, exc.line, exc.column, exc.line, exc.column)
        bracket = _unclosed(text, file)
        if bracket is not None and exc.char in ")]}":
            return bracket
        return Diagnostic("error", f"unexpected character {exc.char!r}", span)
    assert isinstance(exc, UnexpectedToken)
    tok = exc.token
    if tok.type == "$END":
        line = text.count("\n") + 1
        col = len(text.rsplit("\n", 1)[-1]) + 1
        span = Span(file, line, col, line, col)
    else:
        span = token_span(file, tok)
    # a bracket problem at or before the failure is its likely cause
    bracket = _unclosed(text, file)
    if bracket is not None and bracket.span is not None:
        if (bracket.span.line, bracket.span.column) <= (span.line, span.column):
            return bracket
    # the tokens before the failing one (history ends with it)
    before = history[:-1] if history and history[-1] is tok else history
    prev = before[-1] if before else None
    expected = set(exc.expected)
    try:  # the terminals really acceptable here (LALR's expected set is wider)
        expected = set(exc.interactive_parser.accepts()) or expected
    except Exception:  # pragma: no cover - only a better message is lost
        pass
    label = _label(exc, parse_fn)
    if label == "value" and prev is not None:
        return Diagnostic("error", f"expected a value after '{prev.value}'", span)
    if label == "second schedule":
        return Diagnostic("error", "a file holds one schedule; this is a second one", span)
    at_statement_start = prev is None or prev.type in ("_SEP", "LBRACE")
    keyword = tok.type.lower() if tok.type.lower() in KEYWORDS else None
    if (
        keyword in _STATEMENTS + _ORDER_STATEMENTS
        and "_SEP" in expected
        and prev is not None
        and prev.line == tok.line
    ):
        return Diagnostic(
            "error",
            f"'{keyword}' starts a new statement: put it on its own line or after ';'",
            span,
        )
    if tok.type == "NAME" and at_statement_start:
        words = _keyword_candidates(expected)
        if words:
            return _unknown_word(f"unknown statement '{tok.value}'", tok.value, words, span)
    if (
        tok.type == "NAME"
        and prev is not None
        and prev.type == "NAME"
        and len(before) >= 2
        and before[-2].type in ("_SEP", "LBRACE")
    ):
        # `fr j in ...`: a word at the start of an order statement taken as a pass name
        close = difflib.get_close_matches(prev.value, _ORDER_STATEMENTS, n=1, cutoff=0.6)
        if close and "LPAR" in expected:
            pspan = token_span(file, prev)
            return Diagnostic(
                "error", f"unknown statement '{prev.value}'; did you mean '{close[0]}'?", pspan
            )
        words = _keyword_candidates(expected)
        if words:
            return _unknown_word(
                f"unexpected name '{tok.value}' after '{prev.value}'", tok.value, words, span
            )
    if tok.type == "NAME":
        words = _keyword_candidates(expected)
        close = difflib.get_close_matches(tok.value, words, n=1, cutoff=0.6)
        if close:
            return Diagnostic(
                "error", f"unexpected name '{tok.value}'; did you mean '{close[0]}'?", span
            )
    wanted = _expected_words(expected, lark)
    message = f"unexpected {_describe(tok)}"
    if wanted and len(wanted) <= 6:
        message += "; expected " + ", ".join(wanted[:-1]) + (" or " if len(wanted) > 1 else "")
        message += wanted[-1]
    return Diagnostic("error", message, span)


def _unknown_word(message: str, word: str, candidates: list[str], span: Span) -> Diagnostic:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    if close:
        message += f"; did you mean '{close[0]}'?"
    else:
        message += "; expected " + ", ".join(f"'{c}'" for c in candidates)
    return Diagnostic("error", message, span)
