"""Documents into microbatches (ppdsl/lengths.py; issue 38's Data rule)."""

from __future__ import annotations

import numpy as np
import pytest

from ppdsl.lengths import (
    DocumentError,
    numbered,
    open_documents,
    step_lengths,
    step_microbatches,
    targets_of,
    tokens_of,
)


def _write(path, lengths, vocab=50, **extra):
    tokens = np.arange(sum(lengths), dtype=np.int64) % vocab
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    arrays = {"tokens": tokens, "offsets": offsets, **extra}
    np.savez(path, **arrays)
    return path


def test_documents_are_cut_to_max_seq_len():
    """Without packing, microbatch i is document i cut to its first L tokens."""
    assert numbered([5, 3, 9], max_seq_len=4) == [((0, 4),), ((1, 3),), ((2, 4),)]
    assert numbered([5, 3, 9]) == [((0, 5),), ((1, 3),), ((2, 9),)]


def test_packing_is_greedy_in_document_order():
    """--pack T takes the next documents while their total is at most T; a longer
    document is cut to T and stands alone."""
    assert numbered([3, 4, 2, 9, 1, 1], pack=8) == [
        ((0, 3), (1, 4)), ((2, 2),), ((3, 8),), ((4, 1), (5, 1))]
    assert numbered([3, 5, 1], pack=8) == [((0, 3), (1, 5)), ((2, 1),)]  # exactly T fits


def test_step_k_takes_numbers_k_m_onwards_modulo_their_count():
    """Step k's microbatch j is numbered microbatch (k*m + j) mod count."""
    found = numbered([1, 2, 3, 4, 5])
    assert [tokens_of(mb) for mb in step_microbatches(found, 1, 3)] == [4, 5, 1]
    assert step_lengths([1, 2, 3, 4, 5], 2, 3, max_seq_len=3) == [2, 3, 3]


def test_a_piece_of_n_tokens_has_n_minus_one_targets():
    """Targets are each document's own next tokens: n - 1 per piece."""
    assert targets_of(((0, 3), (1, 4))) == 5
    assert targets_of(((2, 1),)) == 0


def test_the_two_rules_exclude_each_other():
    """--max-seq-len with --pack is refused with a message saying why."""
    with pytest.raises(DocumentError, match="exclude each other"):
        numbered([3], max_seq_len=2, pack=4)
    with pytest.raises(DocumentError, match="--pack 0"):
        numbered([3], pack=0)


def test_open_documents_reads_tokens_and_offsets(tmp_path):
    """A well-formed file opens; its lengths and pieces are the documents'."""
    docs = open_documents(_write(tmp_path / "d.npz", [4, 2, 3]), vocab_size=50)
    assert docs.lengths.tolist() == [4, 2, 3]
    assert docs.piece((1, 2)).tolist() == [4, 5]


@pytest.mark.parametrize(("arrays", "message"), [
    ({"tokens": np.arange(4)}, "lacks 'offsets'"),
    ({"tokens": np.arange(4), "offsets": np.array([1, 2])}, "first offset is 1"),
    ({"tokens": np.arange(4), "offsets": np.array([0, 2, 2])}, "document 1"),
    ({"tokens": np.arange(4), "offsets": np.array([0, 5])}, "ascend strictly"),
    ({"tokens": np.arange(4.0), "offsets": np.array([0])}, "1-D integers"),
    ({"tokens": np.arange(400), "offsets": np.array([0])}, "outside the model's vocabulary"),
])
def test_bad_document_files_are_named(tmp_path, arrays, message):
    """Each malformed file gets a message saying what is wrong."""
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DocumentError, match=message):
        open_documents(path, vocab_size=128)


def test_a_missing_file_is_named(tmp_path):
    """A path that is no file says so."""
    with pytest.raises(DocumentError, match="no such file"):
        open_documents(tmp_path / "none.npz")
