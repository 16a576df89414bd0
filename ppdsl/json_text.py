"""`json.dumps(obj, indent=N)`, to the byte, fast on long lists.

With an indent, the standard library encodes in Python, a few microseconds per
value: `stats --json` of a 400k-pass schedule spent 10 s there. `dumps` writes
the same text (the same separators, `float.__repr__`, NaN/Infinity, ASCII
escapes) with every list of plain scalars joined in one go.

`dump` writes the same text through a `write` callable piece by piece, and a
`Deferred` value is made only when the encoder reaches it: a document of a
million-pass schedule (per device its actions and memory profile) is then never
held whole, as objects or as text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from json.encoder import encode_basestring_ascii
from typing import Any

__all__ = ["Deferred", "dump", "dumps"]

_INF = float("inf")
_BATCH = 1 << 16
"""Values encoded at once in a list of scalar lists."""
_FLUSH = 1 << 20
"""`dump` writes once its pending text passes this many characters."""


class Deferred:
    """A value the encoder makes (`make()`) when it reaches it, and drops after."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]):
        self.make = make


class _Sink:
    """What `_encode` appends to in `dump`: pending text, written in large pieces."""

    def __init__(self, write: Callable[[str], Any]):
        self.write = write
        self.parts: list[str] = []
        self.size = 0

    def append(self, text: str) -> None:
        self.parts.append(text)
        self.size += len(text)
        if self.size > _FLUSH:
            self.flush()

    def flush(self) -> None:
        if self.parts:
            self.write("".join(self.parts))
            self.parts.clear()
            self.size = 0


def _scalar(x: Any) -> str | None:
    """The text of a JSON scalar, or None for a container or another type."""
    t = type(x)
    if t is str:
        return encode_basestring_ascii(x)
    if t is float:
        if x != x:
            return "NaN"
        if x == _INF:
            return "Infinity"
        if x == -_INF:
            return "-Infinity"
        return float.__repr__(x)
    if t is int:
        return int.__repr__(x)
    if x is None:
        return "null"
    if x is True:
        return "true"
    if x is False:
        return "false"
    return None


def _scalars(values: Any) -> list[str] | None:
    """The texts of a sequence of JSON scalars (None if one is not a scalar);
    one C-level map where all are floats, ints or strings."""
    kinds = set(map(type, values))
    if kinds == {float} and not any(map(math.isinf, values)) and not any(map(math.isnan, values)):
        return list(map(float.__repr__, values))
    if kinds == {int}:
        return list(map(int.__repr__, values))
    if kinds == {str}:
        return list(map(encode_basestring_ascii, values))
    texts = [_scalar(x) for x in values]
    return None if None in texts else texts  # type: ignore[return-value]


def dumps(obj: Any, indent: int = 2) -> str:
    """`json.dumps(obj, indent=indent)` (dicts with str keys, lists, tuples, str,
    int, float, bool, None; anything else goes to `json.dumps` as is)."""
    parts: list[str] = []
    _encode(obj, 0, " " * indent, parts)
    return "".join(parts)


def dump(obj: Any, write: Callable[[str], Any], indent: int = 2) -> None:
    """`dumps(obj, indent)`'s text, given to `write` (e.g. `sys.stdout.write`) in
    pieces of about a megabyte."""
    sink = _Sink(write)
    _encode(obj, 0, " " * indent, sink)  # type: ignore[arg-type]
    sink.flush()


def _encode(obj: Any, level: int, step: str, out: list[str]) -> None:
    if type(obj) is Deferred:
        obj = obj.make()
    text = _scalar(obj)
    if text is not None:
        out.append(text)
        return
    t = type(obj)
    inner = "\n" + step * (level + 1)
    if t is list or t is tuple:
        if not obj:
            out.append("[]")
            return
        texts = _scalars(obj)
        if texts is not None:
            out.append("[" + inner + ("," + inner).join(texts) + "\n" + step * level + "]")
            return
        if all(type(x) is list or type(x) is tuple for x in obj):
            # a list of scalar lists (a memory profile's (time, level) pairs, a
            # manifest's per-rank actions), encoded a batch of lists at a time:
            # one `_scalars` per batch of about _BATCH values, not per list
            inner2 = "\n" + step * (level + 2)
            close = "\n" + step * (level + 1) + "]"
            parts: list[str] = []
            sizes = list(map(len, obj))
            i = 0
            while i < len(obj):
                j, count = i + 1, sizes[i]
                while j < len(obj) and count + sizes[j] <= _BATCH:
                    count += sizes[j]
                    j += 1
                texts = _scalars([v for x in obj[i:j] for v in x])
                if texts is None:
                    break
                k = 0
                for n in sizes[i:j]:
                    parts.append("[" + inner2 + ("," + inner2).join(texts[k : k + n]) + close if n else "[]")
                    k += n
                i = j
            else:
                out.append("[" + inner + ("," + inner).join(parts) + "\n" + step * level + "]")
                return
        out.append("[")
        for k, x in enumerate(obj):
            out.append(inner if k == 0 else "," + inner)
            _encode(x, level + 1, step, out)
        out.append("\n" + step * level + "]")
        return
    if t is dict and all(type(k) is str for k in obj):
        if not obj:
            out.append("{}")
            return
        out.append("{")
        for k, (key, x) in enumerate(obj.items()):
            out.append((inner if k == 0 else "," + inner) + encode_basestring_ascii(key) + ": ")
            _encode(x, level + 1, step, out)
        out.append("\n" + step * level + "}")
        return
    # another type: the standard encoder's text (or its TypeError), re-indented
    text = json.dumps(obj, indent=len(step))
    out.append(text.replace("\n", "\n" + step * level))
