"""A step's microbatch lengths from documents (issue 38), one rule for the
compiler's `--lengths-from` and the runtime's `--data`. Torch-free.

A document file is a `.npz` with `tokens` (1-D integers) and `offsets` (the N
document starts, ascending, the first 0, no end marker). Two ways to cut a
step's microbatches from it (`microbatches`):

- `max_seq_len=L`: step k's microbatch j is document (k·m + j) mod N, cut to
  its first L tokens;
- `pack=T`: the documents, in order, are packed greedily into microbatches of
  at most T tokens: each takes the next documents while their total stays at
  most T, and a document longer than T is cut to its first T tokens. The
  packed microbatches are numbered in order, and step k takes numbers k·m to
  k·m + m - 1 (mod their count).

Each document in a microbatch attends only within itself and its positions
restart at 0; one of n tokens has n - 1 targets, its own next tokens
(`Microbatch.targets`).

`long_tailed_lengths` is the stated distribution of issue 38's data (128 to
4,096 tokens), and `document_file` writes such a file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "DocumentError",
    "Piece",
    "Microbatch",
    "read_documents",
    "document_lengths",
    "microbatches",
    "step_lengths",
    "long_tailed_lengths",
    "document_file",
    "SHORTEST",
    "LONGEST",
]

SHORTEST = 128
"""The shortest document `long_tailed_lengths` draws."""
LONGEST = 4096
"""The longest: draws above it are cut to it."""


class DocumentError(ValueError):
    """A document file or a cutting rule that cannot be used; the message says
    which and what to do instead."""


@dataclass(frozen=True)
class Piece:
    """Part of one document in a microbatch: its first `tokens` tokens."""

    document: int
    """The document's index (its start is `offsets[document]`)."""
    tokens: int
    """How many of its tokens, from its start."""


@dataclass(frozen=True)
class Microbatch:
    """One microbatch: documents (or their first tokens), one after another."""

    pieces: tuple[Piece, ...]

    @property
    def tokens(self) -> int:
        """Its length: the sum of its pieces' tokens."""
        return sum(p.tokens for p in self.pieces)

    @property
    def targets(self) -> int:
        """Its target tokens: n - 1 for each piece of n tokens."""
        return sum(p.tokens - 1 for p in self.pieces)


def read_documents(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, offsets) of a document file, checked: `tokens` 1-D integers,
    `offsets` N >= 1 ascending document starts, the first 0, each document at
    least one token. Raises DocumentError saying what is wrong."""
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [k for k in ("tokens", "offsets") if k not in data.files]
            if missing:
                raise DocumentError(f"{path}: a document file holds 'tokens' and 'offsets'; "
                                    f"{' and '.join(repr(k) for k in missing)} missing")
            tokens, offsets = data["tokens"], data["offsets"]
    except DocumentError:
        raise
    except (OSError, ValueError) as exc:
        raise DocumentError(f"{path}: not a readable .npz document file ({exc})") from None
    for name, array in (("tokens", tokens), ("offsets", offsets)):
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise DocumentError(f"{path}: '{name}' must be a 1-D integer array, "
                                f"not {array.dtype} of shape {array.shape}")
    document_lengths(offsets, len(tokens), str(path))
    return tokens, offsets


def document_lengths(offsets: Sequence[int] | np.ndarray, num_tokens: int,
                     where: str = "offsets") -> list[int]:
    """Each document's length from its start and the next one's (the last
    runs to the end of the tokens). Raises DocumentError unless the starts are
    ascending from 0 with every document at least one token long."""
    starts = [int(x) for x in offsets]
    if not starts or starts[0] != 0:
        raise DocumentError(f"{where}: the document starts must begin with 0")
    ends = [*starts[1:], num_tokens]
    lengths = [b - a for a, b in zip(starts, ends, strict=True)]
    short = next((i for i, n in enumerate(lengths) if n < 1), None)
    if short is not None:
        raise DocumentError(f"{where}: document {short} starts at {starts[short]} and has no "
                            f"tokens; the starts must be strictly ascending and below "
                            f"{num_tokens} (the tokens' count)")
    return lengths


def microbatches(lengths: Sequence[int], step: int, num_microbatches: int, *,
                 max_seq_len: int | None = None, pack: int | None = None) -> list[Microbatch]:
    """Step `step`'s microbatches, from documents of these `lengths`, under
    one rule: `max_seq_len` (document (k·m + j) mod N cut to L tokens) or
    `pack` (greedy packing to at most T tokens; module docstring). Neither:
    whole documents. Raises DocumentError for both, or a value below 1."""
    if max_seq_len is not None and pack is not None:
        raise DocumentError("give --max-seq-len or --pack, not both (packing cuts each "
                            "document to the pack size itself)")
    for name, value in (("--max-seq-len", max_seq_len), ("--pack", pack)):
        if value is not None and value < 1:
            raise DocumentError(f"{name} must be at least 1 token, not {value}")
    if not lengths:
        raise DocumentError("the document file holds no documents")
    if step < 0 or num_microbatches < 1:
        raise DocumentError(f"step {step}, {num_microbatches} microbatches: need step >= 0 "
                            "and at least one microbatch")
    count = len(lengths)
    first = step * num_microbatches
    if pack is None:
        cut = max_seq_len if max_seq_len is not None else max(lengths)
        return [Microbatch((Piece(d, min(lengths[d], cut)),))
                for d in ((first + j) % count for j in range(num_microbatches))]
    packed = _packed(lengths, pack)
    return [packed[(first + j) % len(packed)] for j in range(num_microbatches)]


def _packed(lengths: Sequence[int], size: int) -> list[Microbatch]:
    """Every document in order, packed greedily into microbatches of at most
    `size` tokens."""
    out: list[Microbatch] = []
    current: list[Piece] = []
    total = 0
    for d, n in enumerate(lengths):
        n = min(n, size)
        if current and total + n > size:
            out.append(Microbatch(tuple(current)))
            current, total = [], 0
        current.append(Piece(d, n))
        total += n
    out.append(Microbatch(tuple(current)))
    return out


def step_lengths(lengths: Sequence[int], step: int, num_microbatches: int, *,
                 max_seq_len: int | None = None, pack: int | None = None) -> list[int]:
    """The tokens of each of step `step`'s microbatches (`microbatches`)."""
    return [mb.tokens for mb in microbatches(lengths, step, num_microbatches,
                                             max_seq_len=max_seq_len, pack=pack)]


def long_tailed_lengths(count: int, seed: int = 0) -> list[int]:
    """Issue 38's document lengths: floor(128 / U) cut to 4,096, U uniform in
    (0, 1] from numpy's PCG64 seeded with `seed`: P(length >= x) = 128 / x
    between 128 and 4,096 (a Pareto tail of index 1: median 256, one in eight
    above 1,024, one in 32 at 4,096)."""
    rng = np.random.default_rng(seed)
    u = 1.0 - rng.random(count)  # (0, 1]
    return [int(x) for x in np.minimum(LONGEST, np.floor(SHORTEST / u)).astype(np.int64)]


def document_file(path: str | Path, lengths: Sequence[int], vocab_size: int,
                  seed: int = 0) -> None:
    """Write a document file of documents with these `lengths`, each token
    drawn uniformly from 0..vocab_size-1 (numpy's PCG64 seeded with `seed`)."""
    if vocab_size < 1 or not lengths or min(lengths) < 1:
        raise DocumentError("a document file needs a vocabulary and documents of >= 1 token")
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tokens = rng.integers(0, vocab_size, int(sum(lengths)), dtype=np.int64)
    np.savez(path, tokens=tokens, offsets=offsets)
