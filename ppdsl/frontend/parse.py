"""Parse `.pp` text into the AST (`ppdsl.frontend.ast`).

The grammar is grammar/ppdsl.lark (LALR). A post-lexer makes newlines and `;`
statement separators except inside ( ) and [ ]; a lark Transformer builds the AST
with a span on every node. Syntax errors become one located `CompileError`, labelled
for the common mistakes (`ppdsl.frontend.syntax_errors`: an unclosed brace, a
missing value after `=`, a misspelt statement keyword) so a person can act on it.
`parse_expression` parses one expression (a `-D` value) with the same grammar.
"""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction
from functools import lru_cache
from typing import Any

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedInput, VisitError

from ppdsl import limits
from ppdsl._resources import grammar_text
from ppdsl.diagnostics import CompileError, Diagnostic, Span
from ppdsl.frontend import ast
from ppdsl.frontend.syntax_errors import KEYWORDS, syntax_error, token_span

__all__ = ["parse", "parse_expression", "KEYWORDS"]

_OPENERS = {"LPAR": "RPAR", "LSQB": "RSQB", "LBRACE": "RBRACE"}
_CLOSERS = {v: k for k, v in _OPENERS.items()}
_GLUE_BEFORE = ("ELSE", "WITH")  # a newline before these does not end the statement


class _Postlex:
    """Newlines and `;` end statements, except inside ( ) and [ ]; runs collapse."""

    always_accept = ("_SEP",)

    def __init__(self) -> None:
        self.history: list[Token] = []

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        history: list[Token] = []
        self.history = history
        stack: list[str] = []
        pending: Token | None = None
        for tok in stream:
            kind = tok.type
            if kind == "_SEP":
                if (stack and stack[-1] != "LBRACE") or pending is not None:
                    continue
                if history and history[-1].type == "_SEP":
                    continue
                pending = tok
                continue
            if pending is not None:
                if kind not in _GLUE_BEFORE:
                    history.append(pending)
                    yield pending
                pending = None
            if kind in _OPENERS:
                stack.append(kind)
            elif kind in _CLOSERS and stack and stack[-1] == _CLOSERS[kind]:
                stack.pop()
            history.append(tok)
            yield tok
        if pending is not None:
            history.append(pending)
            yield pending


@lru_cache(maxsize=1)
def _parser() -> tuple[Lark, _Postlex]:
    postlex = _Postlex()
    lark = Lark(
        grammar_text(),
        parser="lalr",
        lexer="basic",
        postlex=postlex,
        propagate_positions=True,
        maybe_placeholders=False,
        start=["start", "expr"],
        cache=True,  # the LALR tables, in the temp directory (keyed by grammar and lark version)
    )
    return lark, postlex


def parse(text: str, file: str) -> ast.Module:
    """Parse one `.pp` file's text; `file` names it in spans."""
    return _parse(text, file, "start")


def parse_expression(text: str, file: str) -> ast.Expr:
    """Parse one expression (a `-D` value), spans in `file`; a syntax error is a
    CompileError."""
    return _parse(text, file, "expr")


def _parse(text: str, file: str, start: str) -> Any:
    lark, postlex = _parser()
    try:
        tree = lark.parse(text, start=start)
    except UnexpectedInput as exc:
        raise CompileError([_syntax_error(exc, text, file, postlex.history)]) from None
    _check_depth(tree, file)
    try:
        return _ToAst(file, text).transform(tree)
    except RecursionError:
        raise CompileError([_too_deep(file)]) from None
    except VisitError as exc:
        if isinstance(exc.orig_exc, CompileError):
            raise exc.orig_exc from None
        if isinstance(exc.orig_exc, RecursionError):
            raise CompileError([_too_deep(file)]) from None
        raise


def _check_depth(tree: Tree, file: str) -> None:
    """Refuse a tree nested past `limits.Limits.depth` (before the recursive
    transformer, which would run out of stack), at its deepest point."""
    most = limits.active().depth
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > most:
            meta = node.meta
            span = Span(file, meta.line, meta.column, meta.end_line, meta.end_column - 1)
            what = f"expressions and blocks nest more than {most} levels deep here"
            message = (
                f"{what} (split long expressions with `let`); ppdsl's limit is {most:,} "
                f"levels (raise it with {limits.FLAGS['depth']} N)"
            )
            raise limits.LimitError(Diagnostic("error", message, span))
        stack.extend((child, depth + 1) for child in node.children if isinstance(child, Tree))


def _syntax_error(exc: UnexpectedInput, text: str, file: str, history: list[Token]) -> Diagnostic:
    lark, _ = _parser()
    return syntax_error(exc, text, file, history, lark, lambda t: lark.parse(t, start="start"))


def _too_deep(file: str) -> Diagnostic:
    return Diagnostic(
        "error",
        "the file nests expressions or blocks too deeply for ppdsl; split long "
        "expressions with `let`",
        Span(file, 1, 1, 1, 1),
    )


# --- the tree -> AST transformer ------------------------------------------------


_BINARY = {
    "add": "+",
    "sub": "-",
    "mul": "*",
    "div": "/",
    "floordiv": "//",
    "mod": "%",
    "pow": "^",
    "or_": "or",
    "and_": "and",
}


@v_args(meta=True)
class _ToAst(Transformer):
    """Builds `ppdsl.frontend.ast` nodes; every node gets the span of its source text."""

    def __init__(self, file: str, text: str):
        super().__init__()
        self.file = file
        self.text = text

    def _span(self, meta) -> Span:
        return Span(self.file, meta.line, meta.column, meta.end_line, max(1, meta.end_column - 1))

    def _error(self, message: str, span: Span) -> CompileError:
        return CompileError([Diagnostic("error", message, span)])

    # the file
    def start(self, meta, children):
        return children[0]

    def schedule(self, meta, children):
        name, *stmts = children
        span = token_span(self.file, name)
        return ast.Module(str(name), tuple(stmts), self.file, span)

    # top-level statements
    def param(self, meta, children):
        default = children[1] if len(children) > 1 else None
        return ast.Param(str(children[0]), default, self._span(meta))

    def let(self, meta, children):
        return ast.Let(str(children[0]), children[1], self._span(meta))

    def require(self, meta, children):
        message = str(children[1])[1:-1] if len(children) > 1 else None
        return ast.Require(children[0], message, self._span(meta))

    def place_named(self, meta, children):
        kind = children[0]
        arg = children[1] if len(children) > 1 else None
        return ast.Place(str(kind), arg, (), self._span(meta), token_span(self.file, kind))

    def place_list(self, meta, children):
        span = self._span(meta)
        return ast.Place("list", None, tuple(children), span, span)

    def backward(self, meta, children):
        mode = children[0]
        return ast.Backward(str(mode), self._span(meta), token_span(self.file, mode))

    def stage_index(self, meta, children):
        return ("index", str(children[0]))

    def _per_stage(self, node, meta, children):
        name = children[0]
        index = children[1][1] if len(children) == 3 else None
        value = children[-1]
        return node(str(name), index, value, self._span(meta), token_span(self.file, name))

    def cost(self, meta, children):
        return self._per_stage(ast.Cost, meta, children)

    def memory(self, meta, children):
        return self._per_stage(ast.Memory, meta, children)

    def recompute(self, meta, children):
        index = next((c[1] for c in children if isinstance(c, tuple)), None)
        value = next((c for c in children if not isinstance(c, tuple)), None)
        return ast.Recompute(index, value, self._span(meta))

    # the block form
    def block(self, meta, children):
        period, *lines = children
        group = None
        if lines and isinstance(lines[0], ast.Group):
            group, *lines = lines
        return ast.BlockDecl(period, tuple(lines), self._span(meta), group)

    def group(self, meta, children):
        size, spacing = children
        return ast.Group(size, spacing, self._span(meta))

    def slot(self, meta, children):
        kind, start = children
        return ast.Slot(str(kind), start, self._span(meta))

    def slot_line(self, meta, children):
        return ast.SlotLine(None, tuple(children), self._span(meta))

    def chunk_line(self, meta: Any, children: list) -> ast.SlotLine:
        which, *slots = children
        chunk: int | str
        if which.type == "NUMBER":
            value = Fraction(str(which))
            if value.denominator != 1:
                raise self._error(
                    f"a chunk index must be an integer, got {which}", token_span(self.file, which)
                )
            chunk = int(value)
        else:
            chunk = str(which)
        return ast.SlotLine(chunk, tuple(slots), self._span(meta))

    def fill(self, meta, children):
        return ast.Fill(str(children[0]), self._span(meta))

    # the order form
    def order(self, meta, children):
        return ast.OrderDecl(children[0], self._span(meta))

    def body(self, meta, children):
        return tuple(children)

    def for_(self, meta, children):
        var, rng, body = children
        return ast.For(str(var), rng, body, self._span(meta))

    def span_range(self, meta, children):
        return ast.SpanRange(children[0], children[1], self._span(meta))

    def reversed_range(self, meta, children):
        return ast.ReversedRange(children[0], self._span(meta))

    def named_range(self, meta, children):
        return ast.NamedRange(children[0], self._span(meta))

    def repeat(self, meta, children):
        return ast.Repeat(children[0], children[1], self._span(meta))

    def if_(self, meta: Any, children: list) -> ast.If:
        cond, then, *rest = children
        else_: tuple = ()
        if rest:
            else_ = rest[0] if isinstance(rest[0], tuple) else (rest[0],)
        return ast.If(cond, then, else_, self._span(meta))

    def interleave(self, meta, children):
        return ast.Interleave(children[0], children[1], self._span(meta))

    def pass_(self, meta, children):
        kind, *args = children
        return ast.PassCall(str(kind), tuple(args), self._span(meta))

    def overlap(self, meta, children):
        return ast.Overlap(children[0], children[1], self._span(meta))

    # expectations
    def expect(self, meta, children):
        metric = children[0]
        device = children[1] if len(children) == 4 else None
        op, bound = children[-2], children[-1]
        b = bound.span
        text = self.text[
            _offset(self.text, b.line, b.column) : _offset(self.text, b.end_line, b.end_column) + 1
        ]
        return ast.ExpectDecl(
            str(metric),
            device,
            str(op),
            bound,
            " ".join(text.split()),
            self._span(meta),
            token_span(self.file, metric),
        )

    # expressions
    def number(self, meta, children):
        span = self._span(meta)
        text = str(children[0])
        limits.check_literal(text, span)
        value = Fraction(text)
        limits.check_integer(value, span, "the number")
        return ast.Number(value, span)

    def name(self, meta, children):
        return ast.Name(str(children[0]), self._span(meta))

    def call(self, meta, children):
        func, *args = children
        return ast.Call(str(func), tuple(args), self._span(meta))

    def neg(self, meta, children):
        return ast.Unary("-", children[0], self._span(meta))

    def not_(self, meta, children):
        return ast.Unary("not", children[0], self._span(meta))

    def compare(self, meta, children):
        left, op, right = children
        return ast.Binary(str(op), left, right, self._span(meta))

    def cond(self, meta, children):
        return ast.Cond(children[0], children[1], children[2], self._span(meta))

    def __default__(self, data, children, meta):
        op = _BINARY.get(data)
        if op is None:  # pragma: no cover - every rule of the grammar has a method
            raise AssertionError(f"no AST builder for rule {data!r}")
        return ast.Binary(op, children[0], children[1], self._span(meta))


def _offset(text: str, line: int, column: int) -> int:
    pos = 0
    for _ in range(line - 1):
        pos = text.index("\n", pos) + 1
    return pos + column - 1
