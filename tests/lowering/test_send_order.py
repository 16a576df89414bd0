"""Receives in send order (ppdsl/lowering/send_order.py): after the step each
rank receives from each peer in the order the peer sends, and no receive
moves later than its exchange."""

from __future__ import annotations

import pytest

from ppdsl.compiler import compile_file
from ppdsl.ir.rank import Exchange, RankArrays
from ppdsl.lowering.send_order import receives_in_send_order
from tests.paths import EXAMPLES


def _orders(programs: RankArrays) -> tuple[dict, dict, dict]:
    sent: dict = {}
    received: dict = {}
    where: dict = {}
    for program in programs.programs():
        for k, op in enumerate(program.ops):
            if isinstance(op, Exchange):
                for t in op.sends:
                    sent.setdefault((t.src_rank, t.dst_rank), []).append(t)
                for t in op.recvs:
                    received.setdefault((t.src_rank, t.dst_rank), []).append(t)
                    where[t] = k
    return sent, received, where


@pytest.mark.parametrize("name", ["zb_v", "v_half", "dualpipe_v"])
def test_receives_follow_the_send_order(name):
    """V-shape schedules, whose early receives cross, come out with every
    pair's receives in its send order, each receive no later than before."""
    before = compile_file(EXAMPLES / f"{name}.pp").lowered
    _, received_before, where_before = _orders(before)
    sent, _, _ = _orders(before)
    assert any(received_before[pair] != sent[pair] for pair in sent)  # the step has work
    after = receives_in_send_order(before)
    _, received, where = _orders(after)
    assert received == sent
    assert all(where[t] <= where_before[t] for t in where)


def test_programs_already_in_order_are_kept():
    """1F1B's programs are in send order already: the same object comes back."""
    programs = compile_file(EXAMPLES / "1f1b.pp").lowered
    assert receives_in_send_order(programs) is programs
