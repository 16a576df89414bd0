"""Documents as microbatches of varying length (ppdsl/runtime/models/documents.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ppdsl.lengths import open_documents
from ppdsl.runtime.models.documents import IGNORED, DocumentBatches


@pytest.fixture
def batches(tmp_path) -> DocumentBatches:
    """Documents of 3, 2 and 4 tokens (ids 0..8), packed into 5 tokens."""
    path = tmp_path / "d.npz"
    np.savez(path, tokens=np.arange(9), offsets=np.array([0, 3, 5]))
    return DocumentBatches.of(open_documents(path), pack=5)


def test_a_packed_microbatch_restarts_positions_and_ignores_document_ends(batches):
    """Packed documents: ids one after the other, positions from 0 in each, the
    targets each document's own next tokens, -100 at its last token."""
    (ids, positions), targets = batches.tensors(batches.numbered[0])
    assert ids.tolist() == [[0, 1, 2, 3, 4]]
    assert positions.tolist() == [[0, 1, 2, 0, 1]]
    assert targets.tolist() == [[1, 2, IGNORED, 4, IGNORED]]


def test_weights_are_each_microbatchs_share_of_the_steps_targets(batches):
    """A step's loss weights are targets over the step's targets (3 of 6, 3 of 6)."""
    step = batches.step(0, 2)
    assert batches.lengths(step) == [5, 4]
    assert batches.weights(step) == [0.5, 0.5]
    assert batches.weights([((1, 1),), ((2, 4),)]) == [0.0, 1.0]
