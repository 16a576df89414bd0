"""Communication as a backend does it: the rules a program's sends and
receives run under, for the deadlock check (`--comm-model`).

A program is, per rank, the `Item`s it issues in order: computations, lone
sends or receives, and groups (a `batch_isend_irecv`: parts posted together).
Three rule sets (`COMM_MODELS`):

- `rendezvous`: each item blocks the rank until every part has met its peer
  part; parts match by the transfer they move (ppdsl's own model, the one its
  lowering is proven under).
- `nccl`: the rules of NCCL point-to-point as torch's ProcessGroupNCCL drives it
  (its `pointToPoint`):
  - a lone send or receive runs on the communicator of its two ranks, every
    part of a group on the process group's communicator;
  - each communicator is one stream per rank: its operations run in issue
    order, and each starts only after the computations issued before it;
  - a group is one operation: its parts start together and it completes when
    all of them have;
  - no buffering: a send completes only once its receive has started, and a
    receive once its send has (sends that NCCL buffers inside a node hang
    across nodes), so a receive issued before a send on one stream holds the
    send back;
  - on one communicator the n-th send from r to q matches the n-th receive at
    q from r (NCCL has no tags); a pair that moves two different transfers is
    crossed, which hangs or swaps data, and is held to hang here;
  - the host never blocks: a computation waits (on its stream) for the
    receives whose tensors it takes, a send is waited for at the step's end.
- `gloo`: every send and receive is posted by the host without blocking and
  matched by its tag (the transfer); the host blocks where a computation takes
  a received tensor, until its sender has posted the send, and at the step's
  end until every send has been received.

`run` executes a program under a rule set with the rendezvous executor's
`advance` (`ppdsl.analysis.rendezvous`) over *lanes*: a rank's host (or its
compute stream) and, under `nccl`, each of its communicators' streams. Where
lanes stop, each waits for one other lane; following those waits ends in a
cycle, which `run` returns one `LaneWait` per line.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from ppdsl.analysis.rendezvous import advance
from ppdsl.diagnostics import Span

__all__ = [
    "COMM_MODELS",
    "Part",
    "Item",
    "LaneWait",
    "Verdict",
    "communicator_of",
    "run",
]

COMM_MODELS = ("rendezvous", "nccl", "gloo")
"""The rule sets `--comm-model` names (module docstring)."""


@dataclass(frozen=True, slots=True)
class Part:
    """One send or receive: to (from) rank `peer`, moving `transfer` (any
    hashable identity of the tensor; `text` says it to a person)."""

    sending: bool
    peer: int
    transfer: Hashable
    text: str

    def describe(self) -> str:
        return f"send {self.text} to rank {self.peer}" if self.sending else (
            f"receive {self.text} from rank {self.peer}")


@dataclass(frozen=True, slots=True)
class Item:
    """One thing a rank issues: a computation (no parts), a lone send or
    receive (one part, `group` False) or a group posted together (`group`
    True). `takes` are the transfers a computation waits to receive; `label`
    and `span` say where the item is written."""

    label: str
    span: Span | None = None
    parts: tuple[Part, ...] = ()
    group: bool = False
    takes: tuple[Hashable, ...] = ()

    @property
    def is_comm(self) -> bool:
        return bool(self.parts)


def communicator_of(rank: int, item: Item) -> str:
    """The NCCL communicator an item runs on: a group on the process group's,
    a lone op on its two ranks' own."""
    if item.group:
        return "group"
    peer = item.parts[0].peer
    return f"pair {min(rank, peer)}-{max(rank, peer)}"


@dataclass(frozen=True, slots=True)
class LaneWait:
    """One line of a wait cycle: rank `rank`'s item `item` (its index in the
    rank's program) waits for rank `peer`'s item `peer_item`; `text` says why."""

    rank: int
    item: int
    peer: int
    peer_item: int
    text: str


@dataclass(frozen=True)
class Verdict:
    """What running a program under a rule set found: wait cycles, crossed
    pairs (n-th send and n-th receive moving different transfers, as (rank,
    item, peer, peer item, text)) and ops nothing matches (rank, item, text).
    All empty: every rank finishes."""

    cycles: list[list[LaneWait]]
    crossed: list[tuple[int, int, int, int, str]]
    unmatched: list[tuple[int, int, str]]

    @property
    def ok(self) -> bool:
        return not (self.cycles or self.crossed or self.unmatched)


class _Lanes:
    """Lanes of entries, each entry a (rank, item) with requirements
    'lane q has passed entry e' (position[q] >= e + 1) or 'has reached it'."""

    def __init__(self) -> None:
        self.names: list[tuple[int, str]] = []
        self.entries: list[list[tuple[int, int, str]]] = []  # (rank, item, role)
        self.reqs: list[list[list[tuple[int, int, str]]]] = []  # (lane, threshold, why)

    def lane(self, rank: int, name: str) -> int:
        self.names.append((rank, name))
        self.entries.append([])
        self.reqs.append([])
        return len(self.names) - 1

    def add(self, lane: int, rank: int, item: int, role: str) -> int:
        self.entries[lane].append((rank, item, role))
        self.reqs[lane].append([])
        return len(self.entries[lane]) - 1


def _match(
    programs: Sequence[Sequence[Item]], key_of
) -> tuple[dict[tuple[int, int, int], tuple[int, int, int]], list[tuple[int, int, str]]]:
    """Each part (rank, item, part) to the part it meets, sends and receives
    lined up per `key_of(rank, item, part)` in issue order; the parts nothing
    meets."""
    sends: dict[Hashable, list[tuple[int, int, int]]] = {}
    recvs: dict[Hashable, list[tuple[int, int, int]]] = {}
    for r, items in enumerate(programs):
        for i, item in enumerate(items):
            for k, part in enumerate(item.parts):
                side = sends if part.sending else recvs
                side.setdefault(key_of(r, item, part), []).append((r, i, k))
    mate: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    lone: list[tuple[int, int, str]] = []
    for key in sends.keys() | recvs.keys():
        s, v = sends.get(key, []), recvs.get(key, [])
        for a, b in zip(s, v, strict=False):
            mate[a] = b
            mate[b] = a
        for r, i, k in s[len(v):] + v[len(s):]:
            lone.append((r, i, programs[r][i].parts[k].describe()))
    return mate, sorted(lone)


def run(programs: Sequence[Sequence[Item]], model: str) -> Verdict:
    """Run `programs` (per rank, its items in issue order) under `model`."""
    if model not in COMM_MODELS:
        raise ValueError(f"comm model must be one of {', '.join(COMM_MODELS)}, not {model!r}")
    lanes = _Lanes()
    crossed: list[tuple[int, int, int, int, str]] = []
    if model == "nccl":
        mate, unmatched = _match(
            programs,
            lambda r, item, part: (communicator_of(r, item), r, part.peer, part.sending)
            if part.sending else (communicator_of(r, item), part.peer, r, True),
        )
        _nccl_lanes(programs, lanes, mate, crossed)
    else:
        mate, unmatched = _match(
            programs,
            lambda r, item, part: (part.transfer, r, part.peer) if part.sending
            else (part.transfer, part.peer, r),
        )
        if model == "gloo":
            _gloo_lanes(programs, lanes, mate)
        else:
            _rendezvous_lanes(programs, lanes, mate)
    cycles = _cycles(lanes, programs)
    return Verdict(cycles, crossed, unmatched)


_NEVER = -1  # a threshold no lane reaches (made total + 1 when laid out)


def _nccl_lanes(programs, lanes: _Lanes, mate, crossed) -> None:
    # per rank: its compute stream, then one lane per communicator it uses
    compute: list[int] = []
    where: dict[tuple[int, int], tuple[int, int]] = {}  # (rank, item) -> (lane, op entry)
    computed_before: dict[tuple[int, int], int] = {}
    streams: list[dict[str, int]] = []
    for r, items in enumerate(programs):
        compute.append(lanes.lane(r, "compute"))
        streams.append({})
        done = 0
        for i, item in enumerate(items):
            if not item.is_comm:
                lanes.add(compute[r], r, i, "compute")
                done += 1
                continue
            c = communicator_of(r, item)
            if c not in streams[r]:
                streams[r][c] = lanes.lane(r, c)
            lane = streams[r][c]
            computed_before[(r, i)] = done
            lanes.add(lane, r, i, "gate")
            where[(r, i)] = (lane, lanes.add(lane, r, i, "op"))
    received: dict[tuple[int, Hashable], tuple[int, int]] = {}
    for r, items in enumerate(programs):
        for i, item in enumerate(items):
            for part in item.parts:
                if not part.sending:
                    received.setdefault((r, part.transfer), (r, i))
    for r, items in enumerate(programs):
        n = 0
        for i, item in enumerate(items):
            if not item.is_comm:
                for t in item.takes:
                    if (r, t) in received:
                        lane, entry = where[received[(r, t)]]
                        lanes.reqs[compute[r]][n].append((lane, entry + 1, "complete"))
                n += 1
                continue
            lane, entry = where[(r, i)]
            lanes.reqs[lane][entry - 1].append((compute[r], computed_before[(r, i)], "computed"))
            for k, part in enumerate(item.parts):
                other = mate.get((r, i, k))
                if other is None:
                    lanes.reqs[lane][entry].append((lane, _NEVER, "unmatched"))
                    continue
                q, j, kk = other
                peer_lane, peer_entry = where[(q, j)]
                if programs[q][j].parts[kk].transfer != part.transfer:
                    # a crossed pair: each side waits for the other to finish
                    if part.sending:
                        crossed.append((r, i, q, j, f"{part.describe()} meets rank {q}'s "
                                        f"{programs[q][j].parts[kk].describe()}"))
                    lanes.reqs[lane][entry].append((peer_lane, peer_entry + 1, "crossed"))
                else:
                    lanes.reqs[lane][entry].append((peer_lane, peer_entry, "start"))


def _gloo_lanes(programs, lanes: _Lanes, mate) -> None:
    host = [lanes.lane(r, "host") for r in range(len(programs))]
    for r, items in enumerate(programs):
        for i in range(len(items)):
            lanes.add(host[r], r, i, "item")
        lanes.add(host[r], r, len(items), "end")
    received: dict[tuple[int, Hashable], tuple[int, int]] = {}
    for r, items in enumerate(programs):
        for i, item in enumerate(items):
            for k, part in enumerate(item.parts):
                if not part.sending:
                    received.setdefault((r, part.transfer), (i, k))
                other = mate.get((r, i, k))
                need = (host[r], _NEVER, "unmatched") if other is None else (
                    host[other[0]], other[1] + 1, "posted")
                lanes.reqs[host[r]][len(items)].append(need)
            for t in item.takes:
                if (r, t) in received:
                    j, k = received[(r, t)]
                    other = mate.get((r, j, k))
                    need = (host[r], _NEVER, "unmatched") if other is None else (
                        host[other[0]], other[1] + 1, "posted")
                    lanes.reqs[host[r]][i].append(need)


def _rendezvous_lanes(programs, lanes: _Lanes, mate) -> None:
    host = [lanes.lane(r, "host") for r in range(len(programs))]
    for r, items in enumerate(programs):
        for i in range(len(items)):
            lanes.add(host[r], r, i, "item")
    for r, items in enumerate(programs):
        for i, item in enumerate(items):
            for k in range(len(item.parts)):
                other = mate.get((r, i, k))
                need = (host[r], _NEVER, "unmatched") if other is None else (
                    host[other[0]], other[1], "start")
                lanes.reqs[host[r]][i].append(need)


def _cycles(lanes: _Lanes, programs) -> list[list[LaneWait]]:
    sizes = [len(e) for e in lanes.entries]
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    total = int(offsets[-1])
    req_offsets = np.zeros(total + 1, dtype=np.int64)
    req_lane: list[int] = []
    req_op: list[int] = []
    g = 0
    for reqs in lanes.reqs:
        for entry_reqs in reqs:
            for q, threshold, _why in entry_reqs:
                req_lane.append(q)
                req_op.append(total + 1 if threshold == _NEVER else int(offsets[q]) + threshold)
            g += 1
            req_offsets[g] = len(req_lane)
    position = offsets[:-1].copy()
    lane_arr = np.array(req_lane, dtype=np.int64)
    op_arr = np.array(req_op, dtype=np.int64)
    advance(position, offsets, req_offsets, lane_arr, op_arr, np.ones(len(req_op), dtype=bool))
    waits: dict[int, tuple[int, int, str]] = {}  # lane -> (lane waited for, its entry, why)
    for lane in range(len(sizes)):
        at = int(position[lane])
        if at >= offsets[lane + 1]:
            continue
        local = at - int(offsets[lane])
        for q, threshold, why in lanes.reqs[lane][local]:
            need = total + 1 if threshold == _NEVER else int(offsets[q]) + threshold
            if position[q] < need:
                if threshold == _NEVER:
                    target = local
                elif why in ("start",):
                    target = threshold  # the entry lane q has to reach
                else:
                    target = threshold - 1  # the entry lane q has to pass
                waits[lane] = (q, target, why)
                break
    cycles: list[list[LaneWait]] = []
    state: dict[int, int] = {}
    for first in sorted(waits):
        walk: list[int] = []
        lane = first
        while lane in waits and lane not in state:
            state[lane] = 1
            walk.append(lane)
            lane = waits[lane][0]
        if lane in waits and state.get(lane) == 1:
            cycle = walk[walk.index(lane):]
            cycles.append([_describe(lanes, x, waits[x], position, offsets, programs)
                           for x in cycle])
        for x in walk:
            state[x] = 2
    return cycles


def _describe(lanes: _Lanes, lane: int, wait, position, offsets, programs) -> LaneWait:
    q, entry, why = wait
    local = int(position[lane] - offsets[lane])
    rank, item, role = lanes.entries[lane][local]
    peer, peer_item, _ = lanes.entries[q][entry]
    name = lanes.names[lane][1]
    me = _item_text(programs, rank, item)
    them = _item_text(programs, peer, peer_item)
    if role == "end":
        text = f"rank {rank} ends its step waiting for rank {peer} to post {them}"
    elif role == "gate":
        text = (f"rank {rank}'s {me} (on the {name} communicator) cannot start before "
                f"its {them} has run (issued before it)")
    elif role == "compute":
        text = f"rank {rank}'s {me} waits for its {them} to complete"
    elif why == "unmatched":
        text = f"rank {rank}'s {me} waits for a matching op that no rank posts"
    elif why == "crossed":
        text = (f"rank {rank}'s {me} (on the {name} communicator) is matched, in order, with "
                f"rank {peer}'s {them}, which moves another tensor (a crossed pair: it hangs "
                "or swaps the data)")
    elif role == "op":
        text = (f"rank {rank}'s {me} (on the {name} communicator) waits for rank {peer} "
                f"to start {them}")
    elif why == "posted":
        text = f"rank {rank}'s {me} waits for rank {peer} to post {them}"
    else:
        text = f"rank {rank}'s {me} waits for rank {peer} to reach {them}"
    return LaneWait(rank, item, peer, peer_item, text)


def _item_text(programs, rank: int, item: int) -> str:
    items = programs[rank]
    if item >= len(items):
        return "end of step"
    it = items[item]
    if not it.is_comm:
        return it.label
    parts = "; ".join(p.describe() for p in it.parts)
    return f"{it.label} ({parts})" if it.label != parts else it.label
