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

`comm_model` names the rules (`ppdsl.analysis.comm_rules`): `rendezvous` is the
above; `nccl` runs the programs as the runtime's NCCL transport posts them
(each exchange one `batch_isend_irecv`, receives first, on the process group's
communicator; a pass waits for the receives it takes, a send at the step's
end), `gloo` as its tagged transport does.
"""

from __future__ import annotations

from collections.abc import Sequence

from ppdsl.analysis import comm_rules
from ppdsl.analysis.rendezvous import Wait, as_arrays, stuck_waits
from ppdsl.diagnostics import Diagnostic, Span
from ppdsl.ir.rank import Compute, Exchange, RankArrays, RankProgram, Transfer
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
    comm_model: str = "rendezvous",
) -> list[Diagnostic]:
    """Deadlock cycles (one error each, one note per wait), unmatched and
    duplicated transfers.

    `sends_block=False` models a runtime that waits at an exchange for its
    receives only and lets its sends finish in the background (collected at the
    end of the step): then only receives wait. The default is the strict
    semantics above (NCCL's batch_isend_irecv coalesces a batch into one wait).
    `comm_model` other than "rendezvous": the module docstring."""
    if comm_model != "rendezvous":
        return _check_under(schedule, as_arrays(programs), comm_model)
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


def runtime_items(schedule: Schedule, programs: RankArrays) -> list[list[comm_rules.Item]]:
    """The rank programs as the runtime issues them (`comm_rules`' items): each
    pass a computation taking the tensors it receives, each exchange one group
    of its receives then its sends (`Transport.post`'s batch order)."""
    spans = _pass_spans(schedule)
    split = schedule.split_backward
    out: list[list[comm_rules.Item]] = []
    for program in programs.programs():
        taken: dict[tuple, list[tuple]] = {}  # consuming pass key -> transfers it takes
        for op in program.ops:
            if isinstance(op, Exchange):
                for t in op.recvs:
                    kind = transfer_pass(t.kind, False, split)
                    taken.setdefault((kind, t.microbatch, t.dst_stage), []).append(_key(t))
        items: list[comm_rules.Item] = []
        for op in program.ops:
            if isinstance(op, Compute):
                p = op.pass_
                items.append(comm_rules.Item(format_pass(p, True), spans.get(p.key),
                                             takes=tuple(taken.get(p.key, ()))))
                continue
            parts = tuple(
                comm_rules.Part(False, t.src_rank, _key(t), str(t)) for t in op.recvs
            ) + tuple(comm_rules.Part(True, t.dst_rank, _key(t), str(t)) for t in op.sends)
            if not parts:
                continue
            first = op.recvs[0] if op.recvs else op.sends[0]
            span, name = _span_of(first, not op.recvs, schedule, spans)
            items.append(comm_rules.Item(f"exchange before {name}" if op.recvs
                                         else f"exchange after {name}", span, parts, group=True))
        out.append(items)
    return out


def _key(t: Transfer) -> tuple:
    """A transfer's identity, ranks left out (they follow from the stages)."""
    return (t.kind.value, t.microbatch, t.src_stage, t.dst_stage)


def _check_under(schedule: Schedule, programs: RankArrays, model: str) -> list[Diagnostic]:
    items = runtime_items(schedule, programs)
    verdict = comm_rules.run(items, model)
    return verdict_diagnostics(verdict, items, model, "reorder the passes so one of these "
                               "transfers is posted earlier")


def verdict_diagnostics(
    verdict: comm_rules.Verdict, items: Sequence[Sequence[comm_rules.Item]], model: str,
    advice: str,
) -> list[Diagnostic]:
    """A verdict as errors: one per wait cycle (a note per wait, at the item
    that waits), one per op that nothing matches; each located at its item."""
    found: list[Diagnostic] = []
    for r, i, text in verdict.unmatched:
        found.append(Diagnostic(
            "error", f"rank {r}'s {items[r][i].label} posts a {text} that no rank matches under "
            f"{model}'s rules: the rank would wait forever", items[r][i].span))
    for cycle in verdict.cycles:
        if len(cycle) == 1 and cycle[0].peer == cycle[0].rank and cycle[0].item == cycle[0].peer_item:
            continue  # an unmatched op, reported above
        notes = tuple((items[w.rank][w.item].span, w.text) for w in cycle)
        ranks = ", ".join(dict.fromkeys(str(w.rank) for w in cycle))
        found.append(Diagnostic(
            "error", f"deadlock under {model}'s rules: ranks {ranks} wait on each other in a "
            f"cycle; {advice}:", notes[0][0], notes))
    return found
