"""Documents into microbatches (ppdsl/lengths.py; issue 38's Data rule)."""

from __future__ import annotations

import numpy as np
import pytest

from ppdsl.lengths import (
    DocumentError,
    document_file,
    long_tailed_lengths,
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


def test_step_k_takes_documents_in_turn_and_packs_in_order():
    """Step k's microbatch j is document (k*m + j) mod N cut to L; packed numbers
    k*m .. k*m + m - 1 mod their count, a longer document cut to T."""
    docs = [10, 300, 50, 700, 20]
    assert step_lengths(docs, 0, 3, max_seq_len=100) == [10, 100, 50]
    assert step_lengths(docs, 1, 3, max_seq_len=100) == [100, 20, 10]
    docs = [60, 30, 20, 250, 40, 40, 40]
    packed = step_microbatches(numbered(docs, pack=100), 0, 4)
    assert packed == [((0, 60), (1, 30)), ((2, 20),), ((3, 100),), ((4, 40), (5, 40))]
    assert [targets_of(mb) for mb in packed] == [88, 19, 99, 78]
    assert step_lengths(docs, 1, 4, pack=100) == [40, 90, 20, 100]
    with pytest.raises(DocumentError, match="no documents"):
        numbered([])


def test_document_file_round_trips(tmp_path):
    """document_file writes what open_documents reads back, naming the option
    that gave the file in its errors."""
    path = tmp_path / "docs.npz"
    document_file(path, [3, 5, 2], vocab_size=50, seed=1)
    docs = open_documents(path, vocab_size=50)
    assert docs.offsets.tolist() == [0, 3, 8] and docs.lengths.tolist() == [3, 5, 2]
    with pytest.raises(DocumentError, match="--lengths-from"):
        open_documents(tmp_path / "none.npz", flag="--lengths-from")


def test_long_tailed_lengths_follow_the_stated_tail():
    """Between 128 and 4,096; P(length >= x) = 128 / x: median near 256, one
    in eight at or above 1,024, one in 32 at 4,096; the same draws per seed."""
    drawn = np.array(long_tailed_lengths(200_000, seed=3))
    assert drawn.min() == 128 and drawn.max() == 4096
    assert abs(np.median(drawn) - 256) <= 2
    assert abs((drawn >= 1024).mean() - 1 / 8) < 0.005
    assert abs((drawn == 4096).mean() - 1 / 32) < 0.002
    assert long_tailed_lengths(5, seed=3) == drawn[:5].tolist()
