"""The mutation corpus of comm orders, judged exactly: every mutant (a send and
a receive swapped, a receive moved before a send on its stream, a group split
into lone ops, two peers' operations reordered) that hangs under NCCL's rules
is rejected by `--comm-model nccl`, and every one that finishes is accepted.
The ground truth is `_reference_finishes`, a plain step-by-step executor of the
rules as ppdsl/analysis/comm_rules.py's docstring states them, sharing no code
with the checker."""

from __future__ import annotations

from collections import Counter

import pytest

from ppdsl.analysis.checks.deadlock import runtime_items
from ppdsl.analysis.comm_rules import Item, Part, run
from ppdsl.compiler import compile_file
from ppdsl.interchange import from_torch_csv, torch_comm_items
from tests.paths import EXAMPLES, ROOT

# -- the reference: NCCL's rules, one step at a time ---------------------------------


def _communicator(rank: int, item: Item) -> tuple:
    return ("group",) if item.group else ("pair", *sorted((rank, item.parts[0].peer)))


def _reference_finishes(programs: list[list[Item]]) -> bool:
    """Run every rank's items under NCCL's rules until nothing moves; True when
    every item has finished."""
    # the n-th send from r to q on a communicator meets the n-th receive there
    queues: dict[tuple, list[tuple[int, int, int]]] = {}
    for r, items in enumerate(programs):
        for i, item in enumerate(items):
            for k, part in enumerate(item.parts):
                src, dst = (r, part.peer) if part.sending else (part.peer, r)
                queues.setdefault((_communicator(r, item), src, dst, part.sending), []).append(
                    (r, i, k))
    meets: dict[tuple[int, int, int], tuple[int, int, int] | None] = {}
    for (comm, src, dst, sending), mine in queues.items():
        if not sending:
            continue
        theirs = queues.get((comm, src, dst, False), [])
        for n, a in enumerate(mine):
            meets[a] = theirs[n] if n < len(theirs) else None
            if n < len(theirs):
                meets[theirs[n]] = a
        for b in theirs[len(mine):]:
            meets[b] = None
    for r, items in enumerate(programs):
        for i, item in enumerate(items):
            for k in range(len(item.parts)):
                meets.setdefault((r, i, k), None)

    done: set[tuple[int, int]] = set()
    started: set[tuple[int, int]] = set()

    def receive_of(r: int, transfer) -> tuple[int, int] | None:
        for i, item in enumerate(programs[r]):
            if any(not p.sending and p.transfer == transfer for p in item.parts):
                return (r, i)
        return None

    moved = True
    while moved:
        moved = False
        for r, items in enumerate(programs):
            for i, item in enumerate(items):
                if (r, i) in done:
                    continue
                earlier = items[:i]
                if not item.parts:
                    # in order on the compute stream, after the receives it takes
                    if any((r, j) not in done for j, e in enumerate(earlier) if not e.parts):
                        continue
                    if any((x := receive_of(r, t)) is not None and x not in done
                           for t in item.takes):
                        continue
                    done.add((r, i))
                    moved = True
                    continue
                if (r, i) not in started:
                    # in order on its stream, after the computations issued before it
                    same = [j for j, e in enumerate(earlier)
                            if e.parts and _communicator(r, e) == _communicator(r, item)]
                    if any((r, j) not in done for j in same):
                        continue
                    if any((r, j) not in done for j, e in enumerate(earlier) if not e.parts):
                        continue
                    started.add((r, i))
                    moved = True
                ok = True
                for k, part in enumerate(item.parts):
                    other = meets[(r, i, k)]
                    if other is None or (other[0], other[1]) not in started:
                        ok = False
                    elif programs[other[0]][other[1]].parts[other[2]].transfer != part.transfer:
                        ok = False  # a crossed pair never completes
                if ok:
                    done.add((r, i))
                    moved = True
    return all((r, i) in done for r, items in enumerate(programs) for i in range(len(items)))


# -- the mutations ---------------------------------------------------------------


def _lone(rank: int, item: Item) -> list[Item]:
    return [Item(f"{item.label}[{k}]", item.span, (p,)) for k, p in enumerate(item.parts)]


def _mutants(programs: list[list[Item]]):
    """(kind, mutant) for every single mutation of each kind."""
    for r, items in enumerate(programs):
        comm = [i for i, it in enumerate(items) if it.parts]
        for a, b in zip(comm, comm[1:], strict=False):
            x, y = items[a], items[b]
            sends = {p.sending for p in x.parts} | {p.sending for p in y.parts}
            peers_x = {p.peer for p in x.parts}
            peers_y = {p.peer for p in y.parts}
            swapped = list(items)
            swapped[a], swapped[b] = y, x
            if sends == {True, False}:
                yield "swap a send and a receive", _with(programs, r, swapped)
            if peers_x != peers_y:
                yield "reorder two peers' operations", _with(programs, r, swapped)
        for i, item in enumerate(items):
            if item.group and len(item.parts) > 1:
                yield "split a group", _split(programs, {p.transfer for p in item.parts})
            if item.parts and not item.group and not item.parts[0].sending:
                # the receive moved before the nearest earlier send on its stream
                for j in range(i - 1, -1, -1):
                    e = items[j]
                    if e.parts and _communicator(r, e) == _communicator(r, item):
                        if e.parts[0].sending and not e.group:
                            moved = list(items[:j]) + [item] + list(items[j:i]) + list(items[i + 1:])
                            yield "move a receive before a send", _with(programs, r, moved)
                        break


def _split(programs, transfers) -> list[list[Item]]:
    """Every group moving one of `transfers`, on every rank, posted as lone
    ops in part order (the two sides of a transfer stay on one communicator)."""
    out = []
    for r, items in enumerate(programs):
        row: list[Item] = []
        for item in items:
            if item.group and any(p.transfer in transfers for p in item.parts):
                row += _lone(r, item)
            else:
                row.append(item)
        out.append(row)
    return out


def _all_lone(programs, sends_first: bool) -> list[list[Item]]:
    """Every group posted as lone ops, its sends first (or its receives)."""
    out = []
    for items in programs:
        row: list[Item] = []
        for item in items:
            if not item.group:
                row.append(item)
                continue
            parts = sorted(item.parts, key=lambda p: p.sending != sends_first)
            row += [Item(f"{item.label}[{k}]", item.span, (p,)) for k, p in enumerate(parts)]
        out.append(row)
    return out


def _with(programs, r, items):
    return [list(items) if q == r else p for q, p in enumerate(programs)]


def _csv_programs(name: str) -> list[list[Item]]:
    path = ROOT / "tests" / "hangs" / name
    text = path.read_text()
    items = torch_comm_items(text, from_torch_csv(text, str(path)))
    assert items is not None
    return items


def _fixed_172668() -> list[list[Item]]:
    text = (ROOT / "tests" / "hangs" / "pytorch_172668.csv").read_text()
    for old, new in [("0SEND_F1,2RECV_F0", "2RECV_F0,0SEND_F1"),
                     ("2SEND_F0,2RECV_F1", "2RECV_F1,2SEND_F0"),
                     ("3SEND_B0,3RECV_F1", "3RECV_F1,3SEND_B0"),
                     ("2SEND_B0,2RECV_B1", "2RECV_B1,2SEND_B0"),
                     ("2SEND_B1,0RECV_B0", "0RECV_B0,2SEND_B1")]:
        text = text.replace(old, new)
    return torch_comm_items(text, from_torch_csv(text, "fixed.csv")) or []


def _runtime(name: str, **defines: int) -> list[list[Item]]:
    compiled = compile_file(EXAMPLES / f"{name}.pp", {k: str(v) for k, v in defines.items()},
                            comm_model="nccl")
    return runtime_items(compiled.schedule, compiled.lowered)


def _both_send_first() -> list[list[Item]]:
    """Two ranks that each send before they receive (the smallest 172668)."""
    def op(label, sending, peer, t):
        return Item(label, parts=(Part(sending, peer, t, t),))
    return [
        [Item("a"), op("send x", True, 1, "x"), op("recv z", False, 1, "z"), Item("b", takes=("z",))],
        [Item("c"), op("send z", True, 0, "z"), op("recv x", False, 0, "x"), Item("d", takes=("x",))],
    ]


BASES = {
    "both send first (lone ops)": _both_send_first,
    "172668 fixed (lone ops)": _fixed_172668,
    "172668 (lone ops)": lambda: _csv_programs("pytorch_172668.csv"),
    "5100 (groups)": lambda: _csv_programs("megatron_5100.csv"),
    "1f1b d=3 m=4 (groups)": lambda: _runtime("1f1b", d=3, m=4),
    "zb_v d=2 m=4 (groups)": lambda: _runtime("zb_v", d=2, m=4),
    "interleaved d=2 m=4 (groups)": lambda: _runtime("interleaved_1f1b", d=2, m=4),
    "gpipe d=4 m=3 (lone, sends first)": lambda: _all_lone(_runtime("gpipe", d=4, m=3), True),
    "gpipe d=4 m=3 (lone, receives first)": lambda: _all_lone(_runtime("gpipe", d=4, m=3), False),
    "1f1b d=3 m=3 (lone, sends first)": lambda: _all_lone(_runtime("1f1b", d=3, m=3), True),
}


def test_the_reference_agrees_on_the_bases():
    """The reference and the checker agree on the unmutated programs: the fixed
    172668, the runtime's programs and GPipe's as lone ops (sends first) finish;
    the two reported hangs, GPipe's receiving first and 1F1B's as lone ops do not."""
    for name, make in BASES.items():
        programs = make()
        assert run(programs, "nccl").ok == _reference_finishes(programs), name
    assert _reference_finishes(_fixed_172668())
    assert not _reference_finishes(_csv_programs("pytorch_172668.csv"))
    assert _reference_finishes(BASES["gpipe d=4 m=3 (lone, sends first)"]())
    assert not _reference_finishes(BASES["1f1b d=3 m=3 (lone, sends first)"]())


@pytest.mark.parametrize("base", list(BASES))
def test_every_mutant_is_judged_as_the_reference_runs_it(base):
    """Each single mutation of the base is rejected under `nccl` exactly when the
    reference executor hangs on it."""
    tally: Counter[tuple[str, bool]] = Counter()
    for kind, mutant in _mutants(BASES[base]()):
        expected = _reference_finishes(mutant)
        assert run(mutant, "nccl").ok == expected, kind
        tally[(kind, expected)] += 1
    assert tally, "the base has no mutants"


def test_the_corpus_holds_both_verdicts_for_every_kind():
    """Across the bases, every kind of mutation gives both hanging and finishing
    mutants (the corpus can tell a checker that always says one thing)."""
    tally: Counter[tuple[str, bool]] = Counter()
    for make in BASES.values():
        for kind, mutant in _mutants(make()):
            tally[(kind, _reference_finishes(mutant))] += 1
    kinds = {kind for kind, _ in tally}
    assert kinds == {"swap a send and a receive", "reorder two peers' operations",
                     "split a group", "move a receive before a send"}
    for kind in kinds:
        assert tally[(kind, True)] and tally[(kind, False)], (kind, tally)


def test_a_lone_part_matches_in_part_order():
    """A hand case for the reference itself: two lone sends in one order, the
    receives in the other, hang (crossed), the same order finishes."""
    def prog(order):
        return [[Item("s1", parts=(Part(True, 1, "x", "x"),)),
                 Item("s2", parts=(Part(True, 1, "y", "y"),))],
                [Item(f"r{t}", parts=(Part(False, 0, t, t),)) for t in order]]
    assert _reference_finishes(prog("xy")) and not _reference_finishes(prog("yx"))
