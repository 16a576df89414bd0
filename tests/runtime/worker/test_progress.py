"""Where a rank stands (ppdsl/runtime/worker/progress.py): each mark moves the
count the watchdog compares, and reads back as the phrase its hang report prints
(docs/runtime.md, "When a rank dies or hangs")."""

from __future__ import annotations

from ppdsl.ir.rank import Compute, Exchange, Transfer
from ppdsl.ir.schedule import Pass, PassKind
from ppdsl.runtime.worker import progress
from ppdsl.semantics import TransferKind


def test_each_mark_moves_the_count_and_is_current() -> None:
    """Every `at` moves the count by one, even to the same place, and `current`
    returns the mark as given (the engine returns to it after a wait)."""
    count, _ = progress.position()
    op = Compute(Pass(PassKind.F, 3, 1))
    progress.at(op)
    progress.at(op)
    assert progress.position() == (count + 2, "computing F(mb 3, stage 1)")
    assert progress.current() is op


def test_marks_read_as_phrases() -> None:
    """A compute pass, a wait on one transfer, an exchange and a phrase each
    read as the line a hang report prints for that rank."""
    act = Transfer(TransferKind.ACT, 2, 0, 1, 0, 1)
    grad = Transfer(TransferKind.GRAD, 2, 1, 0, 1, 0)
    assert progress.describe(Compute(Pass(PassKind.W, 5, 2))) == "computing W(mb 5, stage 2)"
    assert progress.describe(("receive", act)) == f"waiting to receive {act}"
    assert progress.describe(Exchange(sends=(grad,), recvs=(act,))) == (
        f"in an exchange: recv {act}, send {grad}")
    assert progress.describe("the optimizer step") == "the optimizer step"
