"""The lowered rank programs cannot deadlock under blocking exchanges.

The semantics are `ppdsl.analysis.rendezvous`'s: each rank runs its ops in
order, posts an exchange's sends and receives together and waits for all of
them, and an op completes only once its peer has posted the other side (no
buffering assumed: a schedule that runs under this rendezvous also runs when
NCCL or gloo buffer small messages). The programs are deadlock-free when every
rank reaches the end of its program.

When ranks get stuck, each stuck rank waits for at least one peer that has not
reached its matching exchange; following those waits ends in a cycle, reported
one line per wait, each at the pass that sends or receives the tensor. A send or
receive with no matching op anywhere is reported on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from ppdsl.analysis.rendezvous import Wait, stuck_waits
from ppdsl.diagnostics import Diagnostic, Span
from ppdsl.ir.rank import RankArrays, RankProgram, Transfer
from ppdsl.ir.schedule import Pass, PassKind, Schedule, format_pass
from ppdsl.semantics import transfer_pass

__all__ = ["check", "Wait", "stuck_waits"]


def _pass_spans(schedule: Schedule) -> dict[tuple[PassKind, int, int], Span | None]:
    return {p.key: p.span for order in schedule.orders for p in order}


def _span_of(
    t: Transfer, sending: bool, schedule: Schedule, spans: dict
) -> tuple[Span | None, str]:
    """The pass that produces (sending) or consumes (receiving) the tensor."""
    stage = t.src_stage if sending else t.dst_stage
    kind = transfer_pass(t.kind, sending, schedule.split_backward)
    key = (kind, t.microbatch, stage)
    return spans.get(key), format_pass(Pass(kind, t.microbatch, stage), True)


def check(
    schedule: Schedule,
    programs: RankArrays | Sequence[RankProgram],
    *,
    sends_block: bool = True,
) -> list[Diagnostic]:
    """Deadlock cycles (one error each, one note per wait), unmatched and
    duplicated transfers.

    `sends_block=False` models a runtime that waits at an exchange for its
    receives only and lets its sends finish in the background (collected at the
    end of the step): then only receives wait. The default is the strict
    semantics above (NCCL's batch_isend_irecv coalesces a batch into one wait)."""
    cycles, unmatched, duplicates = stuck_waits(programs, sends_block)
    if isinstance(programs, RankArrays):
        # the last pass to need the rendezvous index (20 MB at 1.5M passes): not
        # kept while the passes after it run (remade if the check runs again)
        programs.derived.pop("exchange_index", None)
    if not (cycles or unmatched or duplicates):
        return []
    spans = _pass_spans(schedule)
    found: list[Diagnostic] = []
    for r, _i, t, sending in unmatched:
        span, name = _span_of(t, sending, schedule, spans)
        side = "send" if sending else "receive"
        other = "receive" if sending else "send"
        found.append(
            Diagnostic(
                "error",
                f"rank {r} posts a {side} of {t} for {name} but no rank posts the matching "
                f"{other}: the rank would wait forever (a lowering bug; please report it)",
                span,
            )
        )
    for r, _i, t, sending in duplicates:
        span, name = _span_of(t, sending, schedule, spans)
        found.append(
            Diagnostic(
                "error",
                f"rank {r} {'sends' if sending else 'receives'} {t} twice "
                "(a lowering bug; please report it)",
                span,
            )
        )
    for cycle in cycles:
        notes = []
        for w in cycle:
            span, name = _span_of(w.transfer, w.sending, schedule, spans)
            role = "output of" if w.sending else "input of"
            notes.append((span, f"{w.describe()} ({role} {name})"))
        ranks = ", ".join(str(w.rank) for w in cycle)
        found.append(
            Diagnostic(
                "error",
                f"the rank programs deadlock: ranks {ranks} wait on each other in a cycle under "
                "blocking send/recv (each exchange is posted together and waited for together); "
                "reorder the passes so one of these transfers is posted earlier:",
                notes[0][0],
                tuple(notes),
            )
        )
    return found
