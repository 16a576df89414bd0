"""ppdsl/runtime/models/data.py: token files and the documented batching (docs/runtime.md,
"Hugging Face models")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ppdsl.runtime.models.data import DataError, batch_tokens, open_tokens


def test_batches_follow_the_documented_rule_and_wrap(tmp_path: Path) -> None:
    """Step k uses sequences kB .. (k+1)B-1 of L+1 consecutive tokens from the
    file's start, positions modulo its length; uint32 .bin files read with
    --data-dtype uint32 give the same batches as the .npy of the same ids."""
    ids = np.arange(70_000, 70_023, dtype=np.uint32)  # 23 ids past uint16's range
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", ids.astype(np.int64))
    raw = open_tokens(tmp_path / "t.bin", 4, vocab_size=80_000, dtype="uint32")
    npy = open_tokens(tmp_path / "t.npy", 4, vocab_size=80_000)
    for step in range(4):
        got = batch_tokens(raw, step, 3, 4)
        assert np.array_equal(got, batch_tokens(npy, step, 3, 4))
        for row, i in enumerate(range(3 * step, 3 * step + 3)):
            want = [int(ids[(i * 5 + t) % 23]) for t in range(5)]
            assert got[row].tolist() == want, (step, row)
    assert batch_tokens(raw, 1, 3, 4)[1, 0] == 70_000 + 20  # sequence 4 starts at 20
    assert batch_tokens(raw, 1, 3, 4)[1, 3] == 70_000 + 0   # ... and wraps after 22


def test_bad_token_files_say_what_is_wrong(tmp_path: Path) -> None:
    """A 2-D array, a uint32 file read as uint16 (ids past the vocabulary, with
    the hint) and an unknown --data-dtype are refused with a message."""
    np.save(tmp_path / "two.npy", np.zeros((4, 4), dtype=np.int32))
    with pytest.raises(DataError, match=r"shape \(4, 4\); token files are flat"):
        open_tokens(tmp_path / "two.npy", 2)
    np.arange(70_000, 70_050, dtype=np.uint32).tofile(tmp_path / "big.bin")
    with pytest.raises(DataError, match="outside the model's vocabulary of 1000 ids; if the file "
                                        "holds uint32 ids, give --data-dtype uint32"):
        open_tokens(tmp_path / "big.bin", 4, vocab_size=1000)
    with pytest.raises(DataError, match="--data-dtype 'int8'"):
        open_tokens(tmp_path / "big.bin", 4, dtype="int8")
