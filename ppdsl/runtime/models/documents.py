"""Documents as microbatches of varying length (`--data FILE.npz`, issue 38):
the torch side of `ppdsl.lengths`' rule.

A microbatch is one sample (dim 0 of size 1) of the tokens of its documents one
after the other (packed under `--pack`): its inputs are the token ids and each
token's position within its document (restarting at 0 at each document), its
targets each token's next token in the same document, and -100 (ignored) at a
document's last token. A document of n tokens thus has n - 1 targets, and a
model that reads positions (rotary or learned) sees each document as if alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppdsl.lengths import (
    DocumentError,
    Documents,
    Microbatch,
    numbered,
    open_documents,
    step_microbatches,
    targets_of,
    tokens_of,
)
from ppdsl.runtime.errors import ModelError

__all__ = ["IGNORED", "DocumentBatches", "is_documents", "open_batches"]

IGNORED = -100
"""The target of a document's last token (cross_entropy's ignore_index)."""


@dataclass(frozen=True)
class DocumentBatches:
    """A document file cut into numbered microbatches by `ppdsl.lengths`' rule."""

    documents: Documents
    """The file."""
    numbered: tuple[Microbatch, ...]
    """Its numbered microbatches."""

    @classmethod
    def of(cls, documents: Documents, *, max_seq_len: int | None = None,
           pack: int | None = None) -> DocumentBatches:
        """`documents` under `--max-seq-len` or `--pack` (`ppdsl.lengths.numbered`)."""
        return cls(documents, tuple(numbered(documents.lengths, max_seq_len=max_seq_len,
                                             pack=pack)))

    @property
    def longest(self) -> int:
        """The most tokens a microbatch holds."""
        return max(tokens_of(mb) for mb in self.numbered)

    def step(self, step: int, num_microbatches: int) -> list[Microbatch]:
        """Step `step`'s microbatches (the same on every rank)."""
        return step_microbatches(self.numbered, step, num_microbatches)

    @staticmethod
    def lengths(microbatches: Sequence[Microbatch]) -> list[int]:
        """Each microbatch's tokens."""
        return [tokens_of(mb) for mb in microbatches]

    @staticmethod
    def weights(microbatches: Sequence[Microbatch]) -> list[float]:
        """Each microbatch's share of the step's loss: its targets over the
        step's (the loss is then the mean over the step's target tokens)."""
        counts = [targets_of(mb) for mb in microbatches]
        total = sum(counts)
        return [c / total if total else 0.0 for c in counts]

    def tensors(self, microbatch: Microbatch) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                       torch.Tensor]:
        """((token ids, positions), targets) of `microbatch`, each of shape [1, tokens]."""
        ids, positions, targets = [], [], []
        for piece in microbatch:
            tokens = self.documents.piece(piece)
            ids.append(tokens)
            positions.append(np.arange(tokens.shape[0], dtype=np.int64))
            targets.append(np.append(tokens[1:], IGNORED))
        def row(parts: list[np.ndarray]) -> torch.Tensor:
            return torch.from_numpy(np.concatenate(parts)).unsqueeze(0)
        return (row(ids), row(positions)), row(targets)


def is_documents(path: str | None) -> bool:
    """Whether `--data` names a document file (`.npz`: `ppdsl.lengths`)."""
    return path is not None and Path(path).suffix == ".npz"


def open_batches(options: Any, vocab: int | None, max_positions: Any) -> DocumentBatches | None:
    """The document file of `options.data` (an `HFOptions`) cut into
    microbatches by its `max_seq_len` or `pack`, checked against the model's
    vocabulary and positions (a document's run from 0); None when `--data`
    names no document file; `ModelError` saying what is wrong."""
    if not is_documents(options.data):
        return None
    if options.eval_data is not None:
        raise ModelError("--eval-data with a document file (--data FILE.npz) is not supported "
                         "yet; leave out --eval-every")
    try:
        batches = DocumentBatches.of(open_documents(options.data, vocab),
                                     max_seq_len=options.max_seq_len, pack=options.pack)
    except DocumentError as exc:
        raise ModelError(str(exc)) from exc
    longest = max(size for mb in batches.numbered for _, size in mb)
    if isinstance(max_positions, int) and longest > max_positions:
        raise ModelError(f"--data {options.data!r}: a document of {longest} tokens is longer than "
                         f"the model's {max_positions} positions; give --max-seq-len "
                         f"{max_positions} (or --pack {max_positions}, or less)")
    return batches
