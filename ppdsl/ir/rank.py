"""The rank-program IR: per rank, the compute passes plus the transfers they
need, in the order the rank performs them.

Lowering (`ppdsl.lowering.lower`) builds it from the schedule IR; the deadlock check,
codegen and the runtime consume it. Communication is grouped: an `Exchange` is
one batch of point-to-point operations that the rank posts together and waits
for together (torch.distributed.batch_isend_irecv), the way Megatron's
send_forward_recv_backward pairs a send with a receive so neighbours do not
block on each other.

`RankArrays` is the same programs as flat arrays (what lowering builds and the
rendezvous passes read, about 2.5 ops per pass at scale); `RankArrays.programs`
builds the objects above from them when a command prints or generates code.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ppdsl.ir.schedule import Pass, PassOrder, pass_texts
from ppdsl.semantics import TransferKind, receives

__all__ = [
    "TransferKind",
    "Transfer",
    "Compute",
    "Exchange",
    "Op",
    "RankProgram",
    "RankArrays",
    "receive_buffers_peak",
    "format_rank_programs",
    "rank_program_texts",
    "entry_groups",
    "index_dtype",
    "narrow_dtype",
]


def index_dtype(count: int) -> type[np.signedinteger]:
    """The integer type of indices (and counts) below `count`: int32 while they
    fit, halving the per-entry arrays of a large schedule."""
    return np.int32 if count < 2**31 else np.int64


def narrow_dtype(values: np.ndarray) -> type[np.signedinteger]:
    """The narrowest of int8, int16, int32, int64 that holds every value of
    `values` (microbatches, stages, ranks of the per-entry columns)."""
    lo, hi = int(values.min(initial=0)), int(values.max(initial=0))
    for dtype in (np.int8, np.int16, np.int32):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return dtype
    return np.int64


@dataclass(frozen=True, slots=True)
class Transfer:
    """One tensor moving between ranks: produced by `src_stage` on `src_rank`,
    consumed by `dst_stage` on `dst_rank`, for `microbatch`."""

    kind: TransferKind
    microbatch: int
    src_stage: int
    dst_stage: int
    src_rank: int
    dst_rank: int

    def __str__(self) -> str:
        return _transfer_texts([self.kind.code], [self.microbatch], [self.src_stage],
                               [self.dst_stage], [self.src_rank], [self.dst_rank])[0]


def _transfer_texts(*columns: Sequence[int], sending: Sequence[bool] | None = None) -> list[str]:
    """The text of transfers given as columns (kind code, microbatch, source and
    destination stage, source and destination rank), each headed `send ` or
    `recv ` where `sending` is given: the one transfer printer."""
    names = [k.value for k in _TRANSFER_KINDS]
    if sending is None:
        return [f"{names[k]}(mb {j}, stage {a}->{b}, rank {ra}->{rb})"
                for k, j, a, b, ra, rb in zip(*columns, strict=True)]
    return [f"{'send' if s else 'recv'} {names[k]}(mb {j}, stage {a}->{b}, rank {ra}->{rb})"
            for s, k, j, a, b, ra, rb in zip(sending, *columns, strict=True)]


@dataclass(frozen=True, slots=True)
class Compute:
    """Run one compute pass."""

    pass_: Pass


@dataclass(frozen=True, slots=True)
class Exchange:
    """Post these sends and receives together, then wait for all of them."""

    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


Op = Compute | Exchange


@dataclass(frozen=True)
class RankProgram:
    """What one rank does, in order."""

    rank: int
    ops: tuple[Op, ...]


_TRANSFER_KINDS = tuple(sorted(TransferKind, key=lambda t: t.code))


@dataclass(frozen=True, eq=False)
class RankArrays:
    """Rank programs as flat arrays. Ops are numbered globally, rank 0's first
    (`offsets[r]:offsets[r+1]` are rank r's); an op is a `Compute` of
    `passes[op_pass[g]]` or, where `op_pass[g]` is -1, an `Exchange`. Its
    posted sends and receives ("entries") are listed in rank and op order, an
    exchange's sends before its receives, each with the transfer it moves."""

    offsets: np.ndarray
    """int64[ranks + 1]."""
    op_pass: np.ndarray
    """int per op (int32 as lowered, `index_dtype`): index into `passes`, -1
    for an exchange."""
    passes: Sequence[Pass]
    where: np.ndarray
    """int per entry (int32 as lowered): the global op (an exchange) that posts it."""
    sending: np.ndarray
    """bool per entry: a send (else a receive)."""
    transfer: np.ndarray
    """int per entry: the `TransferKind.code`."""
    microbatch: np.ndarray
    """int per entry; this column and the four below are, as lowered, of the
    narrowest type that holds their values (`narrow_dtype`)."""
    src_stage: np.ndarray
    dst_stage: np.ndarray
    src_rank: np.ndarray
    dst_rank: np.ndarray
    entry_pass: np.ndarray
    """int per entry (int32 as lowered): index into `passes` of the pass that
    sends (produces) or receives (consumes) it; -1 where unknown (programs made
    by hand)."""
    derived: dict[str, Any] = field(default_factory=dict, repr=False)
    """What passes compute once from these arrays (the rendezvous index; the
    matching it starts from, "mirror", where early receives carried it over)."""

    @property
    def num_ranks(self) -> int:
        return len(self.offsets) - 1

    @property
    def total(self) -> int:
        """How many ops, all ranks together."""
        return int(self.offsets[-1])

    def transfer_of(self, e: int) -> Transfer:
        """Entry `e`'s transfer as an object."""
        return Transfer(
            _TRANSFER_KINDS[int(self.transfer[e])],
            int(self.microbatch[e]),
            int(self.src_stage[e]),
            int(self.dst_stage[e]),
            int(self.src_rank[e]),
            int(self.dst_rank[e]),
        )

    def programs(self) -> tuple[RankProgram, ...]:
        """The programs as objects (built once; a transfer is one object shared
        by its send and its receive)."""
        built = self.derived.get("programs")
        if built is not None:
            return built
        key_of = self._keys()
        made: dict[int, Transfer] = {}
        first_entry = np.searchsorted(self.where, np.arange(self.total + 1)).tolist()
        keys = key_of.tolist()
        sending = self.sending.tolist()
        op_pass = self.op_pass.tolist()
        passes = self.passes
        offsets = self.offsets.tolist()
        out = []
        for r in range(self.num_ranks):
            ops: list[Op] = []
            for g in range(offsets[r], offsets[r + 1]):
                p = op_pass[g]
                if p >= 0:
                    ops.append(Compute(passes[p]))
                    continue
                sends: list[Transfer] = []
                recvs: list[Transfer] = []
                for e in range(first_entry[g], first_entry[g + 1]):
                    t = made.get(keys[e])
                    if t is None:
                        t = made[keys[e]] = self.transfer_of(e)
                    (sends if sending[e] else recvs).append(t)
                ops.append(Exchange(tuple(sends), tuple(recvs)))
            out.append(RankProgram(r, tuple(ops)))
        built = self.derived["programs"] = tuple(out)
        return built

    def _keys(self) -> np.ndarray:
        """A transfer's identity as one integer per entry (kind, microbatch, stages);
        made afresh by each of its two users (the matching, `programs`), not kept."""
        stages = int(max(self.src_stage.max(initial=0), self.dst_stage.max(initial=0))) + 1
        kinds = len(_TRANSFER_KINDS)
        mb, src, dst = (
            int(np.abs(c).max(initial=0)) for c in (self.microbatch, self.src_stage, self.dst_stage)
        )
        dtype = index_dtype(((mb * stages + src) * stages + dst + 1) * kinds)
        keys = self.microbatch.astype(dtype)
        keys *= stages
        keys += self.src_stage
        keys *= stages
        keys += self.dst_stage
        keys *= kinds
        keys += self.transfer
        return keys

    def receive_buffers_peaks(self) -> list[int]:
        """Per rank, the most received tensors held at once before the passes
        that consume them (`receive_buffers_peak`, for
        programs lowered from a schedule: each receive is freed by its pass)."""
        peaks = self.derived.get("receive_buffers_peaks")
        if peaks is None:
            peaks = self.derived["receive_buffers_peaks"] = self._receive_buffers_peaks()
        return peaks

    def _receive_buffers_peaks(self) -> list[int]:
        if np.any(self.entry_pass[~self.sending] < 0):
            return [receive_buffers_peak(p) for p in self.programs()]
        small = index_dtype(max(self.total, len(self.where)) + 1)
        recv = np.flatnonzero(~self.sending)
        compute_op = np.empty(len(self.passes), dtype=small)
        is_compute = self.op_pass >= 0
        compute_op[self.op_pass[is_compute]] = np.flatnonzero(is_compute)
        del is_compute
        delta = np.zeros(self.total + 1, dtype=small)
        np.add.at(delta, self.where[recv], 1)
        np.add.at(delta, compute_op[self.entry_pass[recv]], -1)
        del recv, compute_op
        held = np.cumsum(delta, out=delta)
        peaks = []
        for r in range(self.num_ranks):
            lo, hi = int(self.offsets[r]), int(self.offsets[r + 1])
            before = held[lo - 1] if lo else 0
            peaks.append(max(0, int((held[lo:hi] - before).max(initial=0))))
        return peaks

    @staticmethod
    def of_programs(programs: Sequence[RankProgram]) -> RankArrays:
        """The arrays of programs given as objects (made by hand, or read back)."""
        offsets = np.zeros(len(programs) + 1, dtype=np.int64)
        np.cumsum([len(p.ops) for p in programs], out=offsets[1:])
        passes: list[Pass] = []
        op_pass: list[int] = []
        entries: list[tuple[int, bool, Transfer]] = []
        g = 0
        for prog in programs:
            for op in prog.ops:
                if type(op) is Compute:
                    op_pass.append(len(passes))
                    passes.append(op.pass_)
                else:
                    assert isinstance(op, Exchange)
                    op_pass.append(-1)
                    entries += [(g, True, t) for t in op.sends]
                    entries += [(g, False, t) for t in op.recvs]
                g += 1

        def column(values: Iterable[Any], dtype: type = np.int64) -> np.ndarray:
            return np.fromiter(values, dtype=dtype, count=len(entries))

        return RankArrays(
            offsets,
            np.asarray(op_pass, dtype=np.int64),
            tuple(passes),
            column(w for w, _, _ in entries),
            column((s for _, s, _ in entries), bool),
            column(t.kind.code for _, _, t in entries),
            column(t.microbatch for _, _, t in entries),
            column(t.src_stage for _, _, t in entries),
            column(t.dst_stage for _, _, t in entries),
            column(t.src_rank for _, _, t in entries),
            column(t.dst_rank for _, _, t in entries),
            np.full(len(entries), -1, dtype=np.int64),
        )


def receive_buffers_peak(program: RankProgram) -> int:
    """The most received tensors the rank holds at once before the passes that
    consume them. A receive pulled forward (`ppdsl.lowering.early_receives`) is
    held from its earlier exchange on; these are transfer buffers, not
    activations, so the memory model does not count them and `stats` shows
    them apart."""
    alive: set[tuple[TransferKind, int, int]] = set()
    peak = 0
    for op in program.ops:
        if type(op) is Exchange:
            alive.update((t.kind, t.microbatch, t.dst_stage) for t in op.recvs)
            peak = max(peak, len(alive))
        elif type(op) is Compute:
            p = op.pass_
            for t, _ in receives(p.kind):
                alive.discard((t, p.microbatch, p.stage))
    return peak


def format_rank_programs(
    programs: Sequence[RankProgram] | RankArrays, multi_stage: bool = True
) -> str:
    """Canonical text: one line per op, `send`/`recv` lines inside an exchange."""
    return "".join(rank_program_texts(programs, multi_stage))


def rank_program_texts(
    programs: Sequence[RankProgram] | RankArrays, multi_stage: bool = True
) -> Iterator[str]:
    """`format_rank_programs`, rank by rank (its text is their concatenation):
    the text of a large schedule is hashed without being held whole."""
    yield from _format_arrays(
        programs if isinstance(programs, RankArrays) else RankArrays.of_programs(programs),
        multi_stage,
    )


def entry_groups(programs: RankArrays) -> np.ndarray:
    """`first[g]:first[g + 1]` are the entries op `g` posts (an array: a list
    of Python ints would cost 36 bytes an op; slice a rank's and `tolist` it)."""
    return np.searchsorted(programs.where, np.arange(programs.total + 1))


def _format_arrays(programs: RankArrays, multi_stage: bool) -> Iterator[str]:
    """`rank_program_texts` of the arrays, without making the op objects; a
    rank's lines are made from its slice of the arrays only."""
    first = entry_groups(programs)
    columns = PassOrder.of(programs.passes)  # read as columns, not a Pass per op
    offsets = programs.offsets.tolist()
    for r in range(programs.num_ranks):
        # this rank's entry groups, relative to its first entry
        groups = first[offsets[r] : offsets[r + 1] + 1].tolist()
        lo, hi = groups[0], groups[-1]
        groups = [x - lo for x in groups]
        entries = _transfer_texts(
            *(column[lo:hi].tolist() for column in (
                programs.transfer, programs.microbatch, programs.src_stage, programs.dst_stage,
                programs.src_rank, programs.dst_rank)),
            sending=programs.sending[lo:hi].tolist())
        lines = [f"rank {r}:"]
        op_pass = programs.op_pass[offsets[r] : offsets[r + 1]]
        chosen = op_pass[op_pass >= 0]  # this rank's passes
        texts = ["  " + text for text in pass_texts(
            columns.kind[chosen].tolist(), columns.microbatch[chosen].tolist(),
            columns.stage[chosen].tolist(), multi_stage)]
        pass_lines = iter(texts)
        for g, k in enumerate(op_pass.tolist()):
            if k >= 0:
                lines.append(next(pass_lines))
            else:
                lines.append("  exchange { " + "; ".join(entries[groups[g] : groups[g + 1]]) + " }")
        yield "\n".join(lines) + "\n"
