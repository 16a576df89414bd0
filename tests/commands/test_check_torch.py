"""`ppdsl check --torch CLASS --pp N --v V` (ppdsl/commands/check_torch.py):
the program torch's own comm insertion lowers for each of its schedule
classes, checked under NCCL's rules without running it."""

from __future__ import annotations

import pytest

from ppdsl.analysis import comm_rules
from ppdsl.cli import main

pytest.importorskip("torch.distributed.pipelining.schedules")

from ppdsl.commands.check_torch import (  # noqa: E402
    default_microbatches,
    schedule_classes,
    torch_program_csv,
)
from ppdsl.commands.common import UsageError  # noqa: E402
from ppdsl.interchange import from_torch_csv, torch_comm_items  # noqa: E402


def _verdict(text: str, model: str = "nccl") -> comm_rules.Verdict:
    items = torch_comm_items(text, from_torch_csv(text, "torch.csv"))
    assert items is not None
    return comm_rules.run(items, model)


def _allowed():
    """(class, pp, v) for pp in {2, 4, 8}, v in {1, 2, 4} where the class allows it
    and torch's own comm insertion accepts its order."""
    for name in sorted(schedule_classes()):
        for pp in (2, 4, 8):
            for v in (1, 2, 4):
                try:
                    yield name, pp, v, torch_program_csv(name, pp, v, default_microbatches(pp * v, pp))
                except UsageError:
                    continue


@pytest.mark.slow
def test_every_torch_class_runs_under_nccl_rules():
    """Every class at pp in {2,4,8}, v in {1,2,4} (where allowed) lowers, by
    torch's own passes, to a program that finishes under NCCL's rules: no
    false deadlock (torch runs these)."""
    checked = []
    for name, pp, v, text in _allowed():
        verdict = _verdict(text)
        assert verdict.ok, (name, pp, v, verdict.cycles[:1])
        checked.append(name)
    # 1F1B's order is refused by torch's own _add_send_recv (a usage error here)
    assert set(checked) == set(schedule_classes()) - {"Schedule1F1B"}
    assert len(checked) == 3 * 3 + 3 * 3 + 3 * 3 + 3 + 3 + 3  # LoopedBFS, I1F1B, IZB; V's; GPipe


def test_the_warm_up_receives_moved_after_the_forwards_hang():
    """torch's pp=2 interleaved program runs; with rank 0's warm-up receives moved
    after its forwards (the patch of pytorch#172668, tests/hangs/README.md) the
    ranks send before they receive and it hangs under NCCL, not under gloo."""
    text = torch_program_csv("ScheduleInterleaved1F1B", 2, 2, 4)
    assert _verdict(text).ok
    row0, rest = text.split("\r\n", 1)
    moved = row0.replace(",2RECV_F0", "").replace(",2RECV_F1", "").replace(
        ",2F0,", ",2RECV_F0,2RECV_F1,2F0,", 1)
    assert moved != row0
    hanging = moved + "\r\n" + rest
    assert not _verdict(hanging).ok
    assert _verdict(hanging, "gloo").ok


def test_the_command_prints_ok_and_refuses_bad_classes(capsys):
    """The command checks under nccl by default; an unknown class, or a v the
    class does not allow, is a usage error naming what to give instead."""
    assert main(["check", "--torch", "ScheduleInterleaved1F1B", "--pp", "2", "--v", "2"]) == 0
    out, _ = capsys.readouterr()
    assert "ok under nccl's rules: 2 ranks, 4 stages, 4 microbatches" in out
    assert main(["check", "--torch", "ScheduleNope", "--pp", "2"]) == 2
    _, err = capsys.readouterr()
    assert "not one of torch's schedule classes (Schedule1F1B, " in err
    assert main(["check", "--torch", "ScheduleZBVZeroBubble", "--pp", "2", "--v", "1"]) == 2
    _, err = capsys.readouterr()
    assert "needs two stages per rank: --v 2, not 1" in err
    assert main(["check"]) == 2
