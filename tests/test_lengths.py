"""A step's microbatch lengths from documents (ppdsl/lengths.py): the
--max-seq-len and --pack rules of issue 38 as its text states them, the
document file's checks, and the long-tailed distribution's stated shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ppdsl import lengths
from ppdsl.lengths import DocumentError, Piece


def test_max_seq_len_takes_documents_in_turn_and_cuts_them() -> None:
    """Step k's microbatch j is document (k*m + j) mod N cut to L tokens."""
    docs = [10, 300, 50, 700, 20]
    assert lengths.step_lengths(docs, 0, 3, max_seq_len=100) == [10, 100, 50]
    assert lengths.step_lengths(docs, 1, 3, max_seq_len=100) == [100, 20, 10]
    first = lengths.microbatches(docs, 1, 3, max_seq_len=100)[0]
    assert first.pieces == (Piece(3, 100),) and first.targets == 99


def test_pack_fills_greedily_in_document_order() -> None:
    """Documents join a microbatch while the total stays <= T; a longer one is
    cut to T; step k takes packed numbers k*m .. k*m + m - 1 mod their count."""
    docs = [60, 30, 20, 250, 40, 40, 40]
    packed = lengths.microbatches(docs, 0, 4, pack=100)
    assert [[(p.document, p.tokens) for p in mb.pieces] for mb in packed] == [
        [(0, 60), (1, 30)], [(2, 20)], [(3, 100)], [(4, 40), (5, 40)]]
    assert [mb.targets for mb in packed] == [88, 19, 99, 78]
    # five packed microbatches: step 1 takes numbers 4, 5 = 0, 6 = 1, 7 = 2
    assert lengths.step_lengths(docs, 1, 4, pack=100) == [40, 90, 20, 100]


def test_rules_refuse_what_they_cannot_do() -> None:
    """Both rules at once, a size below 1 and an empty file are errors that say so."""
    with pytest.raises(DocumentError, match="not both"):
        lengths.microbatches([5], 0, 1, max_seq_len=4, pack=4)
    with pytest.raises(DocumentError, match="at least 1 token"):
        lengths.microbatches([5], 0, 1, pack=0)
    with pytest.raises(DocumentError, match="no documents"):
        lengths.microbatches([], 0, 1)


def test_document_file_round_trips_and_is_checked(tmp_path: Path) -> None:
    """document_file writes what read_documents reads back; starts that are not
    ascending from 0 are refused, naming the document."""
    path = tmp_path / "docs.npz"
    lengths.document_file(path, [3, 5, 2], vocab_size=50, seed=1)
    tokens, offsets = lengths.read_documents(path)
    assert offsets.tolist() == [0, 3, 8] and len(tokens) == 10 and tokens.max() < 50
    assert lengths.document_lengths(offsets, len(tokens)) == [3, 5, 2]
    bad = tmp_path / "bad.npz"
    np.savez(bad, tokens=np.arange(10), offsets=np.array([0, 4, 4]))
    with pytest.raises(DocumentError, match="document 1 starts at 4 and has no tokens"):
        lengths.read_documents(bad)
    np.savez(bad, tokens=np.arange(10))
    with pytest.raises(DocumentError, match="'offsets' missing"):
        lengths.read_documents(bad)


def test_long_tailed_lengths_follow_the_stated_tail() -> None:
    """Between 128 and 4,096; P(length >= x) = 128 / x: median near 256, one
    in eight at or above 1,024, one in 32 at 4,096; the same draws per seed."""
    drawn = np.array(lengths.long_tailed_lengths(200_000, seed=3))
    assert drawn.min() == 128 and drawn.max() == 4096
    assert abs(np.median(drawn) - 256) <= 2
    assert abs((drawn >= 1024).mean() - 1 / 8) < 0.005
    assert abs((drawn == 4096).mean() - 1 / 32) < 0.002
    assert lengths.long_tailed_lengths(5, seed=3) == drawn[:5].tolist()
