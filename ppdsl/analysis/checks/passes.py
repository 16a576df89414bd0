"""Every pass exactly once, on the device the placement says.

For each microbatch j < m and stage s < S the schedule must run F(j,s), R(j,s)
on a stage marked `recompute` (and on no other), and its backward (B(j,s) and
W(j,s) with a split backward, BW(j,s) with a fused one) exactly once, in the
order of the device that holds stage s. Under a bidirectional placement
(DualPipe) microbatch j goes through the stages of its lane only
(`semantics.microbatch_lane`). The other checks
assume this, so the driver stops here when it fails.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ppdsl import semantics
from ppdsl.diagnostics import Diagnostic, Span
from ppdsl.ir.flat import FlatSchedule, flatten
from ppdsl.ir.schedule import Pass, PassKind, Schedule, format_pass
from ppdsl.semantics import KINDS, NUM_KINDS

__all__ = ["check", "format_runs"]


def _name(p: Pass) -> str:
    return format_pass(p, True)


def format_runs(kind: PassKind, stage: int, microbatches: list[int], show_stage: bool) -> str:
    """`F0-F7:s3, F9:s3`: consecutive microbatches of one kind and stage as a run
    (first-last, both included), so that no pass is left out of a message."""
    parts = []
    suffix = f":s{stage}" if show_stage else ""
    k = kind.value
    i = 0
    while i < len(microbatches):
        j = i
        while j + 1 < len(microbatches) and microbatches[j + 1] == microbatches[j] + 1:
            j += 1
        a, b = microbatches[i], microbatches[j]
        parts.append(f"{k}{a}{suffix}" if a == b else f"{k}{a}-{k}{b}{suffix}")
        i = j + 1
    return ", ".join(parts)


def _list_passes(passes: list[Pass]) -> str:
    """Every pass, as runs per (kind, stage): `F8-F15:s1 (8 passes)`."""
    by_group: dict[tuple[PassKind, int], list[int]] = {}
    for p in passes:
        by_group.setdefault((p.kind, p.stage), []).append(p.microbatch)
    listed = ", ".join(
        format_runs(kind, stage, sorted(set(mbs)), True) for (kind, stage), mbs in by_group.items()
    )
    return listed if len(passes) == 1 else f"{listed} ({len(passes)} passes)"


def _span_of(microbatches: Iterable[int]) -> str:
    """`0..9` for the consecutive microbatches of a lane (its first and last)."""
    listed = [int(j) for j in microbatches]
    if len(listed) < 2:
        return f"microbatch {listed[0]}" if listed else "no microbatch"
    return f"microbatches {listed[0]}..{listed[-1]}"


def check(schedule: Schedule) -> list[Diagnostic]:
    """Out-of-range, misplaced, wrong-kind, duplicated and missing passes; all of
    them, sorted by location."""
    s = schedule
    m, S, d = s.num_microbatches, s.num_stages, s.num_devices
    found: list[Diagnostic] = []
    if len(s.orders) != d:
        found.append(
            Diagnostic(
                "error",
                f"the schedule has orders for {len(s.orders)} devices but its placement "
                f"uses {d}; give one order per device",
                s.span,
            )
        )
        return found
    flat = flatten(s)
    # allowed[kind code, stage]: the kinds each stage runs
    allowed = np.zeros((NUM_KINDS, S), dtype=bool)
    for stage in range(S):
        allowed[[k.code for k in s.stage_pass_kinds(stage)], stage] = True
    kind, mb, st, dev = flat.kind, flat.microbatch, flat.stage, flat.device
    ok_mb = (mb >= 0) & (mb < m)
    ok_stage = (st >= 0) & (st < S)
    # the lookups by stage and microbatch, where both are in range (a slice when
    # all are: views of the columns, not copies)
    known = ok_mb & ok_stage
    sel = slice(None) if known.all() else known
    ok_kind = np.zeros(flat.size, dtype=bool)
    ok_kind[sel] = allowed[kind[sel], st[sel]]
    lanes = s.placement.lanes
    length = S // lanes
    mb_lane = np.asarray(
        [semantics.microbatch_lane(j, m, lanes) for j in range(m)], dtype=np.int64
    )
    ok_lane = np.ones(flat.size, dtype=bool)
    if lanes > 1:
        ok_lane[sel] = mb_lane[mb[sel]] == st[sel] // length
    stage_device = np.asarray(s.placement.stage_device, dtype=np.int64)
    ok_device = np.zeros(flat.size, dtype=bool)
    ok_device[sel] = stage_device[st[sel]] == dev[sel]
    del known, sel
    ok = ok_mb & ok_stage & ok_kind & ok_device & ok_lane

    # passes that cannot be where they are: one error per (device, source line, reason),
    # listing every pass of the group (a loop line makes many)
    misplaced: dict[tuple, list[Pass]] = {}
    for k in np.flatnonzero(~ok).tolist():
        p = flat.passes[k]
        if not ok_mb[k]:
            reason: tuple = ("microbatch",)
        elif not ok_stage[k]:
            reason = ("stage",)
        elif not ok_lane[k]:
            reason = ("lane", int(mb_lane[p.microbatch]), p.stage // length)
        elif not ok_kind[k]:
            reason = ("kind", p.kind)
        else:
            reason = ("device", p.stage)
        misplaced.setdefault((int(dev[k]), p.span, reason), []).append(p)
    for (device, span, reason), bad in misplaced.items():
        what = f"device {device} runs {_list_passes(bad)}"
        if reason[0] == "microbatch":
            msg = f"{what}: microbatch out of range (m = {m}: microbatches 0..{m - 1})"
        elif reason[0] == "stage":
            msg = f"{what}: stage out of range (the placement has {S} stages: 0..{S - 1})"
        elif reason[0] == "lane":
            lane, wrong = reason[1], reason[2]
            mine = semantics.lane_stages(lane, S, lanes)
            theirs = [j for j in range(m) if mb_lane[j] == wrong]
            msg = (
                f"{what}: under '{s.placement.kind}' lane {lane} (stages {mine.start}.."
                f"{mine.stop - 1}) takes {_span_of(np.flatnonzero(mb_lane == lane))}, and "
                f"stage {p.stage} is in lane {wrong} ({_span_of(theirs)}); use a stage of "
                f"lane {lane} or a microbatch of lane {wrong}"
            )
        elif reason[0] == "kind":
            if bad[0].kind is PassKind.R:
                msg = (
                    f"{what}: a recompute pass R on stage {bad[0].stage}, which keeps its "
                    f"activations; mark it (`recompute[s] = ...`) or remove the R"
                )
            elif s.split_backward:
                msg = f"{what}: a fused backward BW in a split-backward schedule; write B and W"
            else:
                msg = f"{what}: B/W in a fused-backward schedule; write BW"
        else:
            stage = reason[1]
            msg = (
                f"{what}, but the placement ({s.placement.kind}) puts stage {stage} on "
                f"device {int(stage_device[stage])}; move "
                f"{'them' if len(bad) != 1 else 'it'} to that device's order"
            )
        found.append(Diagnostic("error", msg, span))

    # an overlapped pass is the backward of a pair whose forward runs just before it
    if flat.joined is not None:
        backwards = [k.code for k in s.backward_kinds]
        starts = np.zeros(flat.size, dtype=bool)
        starts[flat.offsets[:-1][np.diff(flat.offsets) > 0]] = True
        after_forward = np.zeros(flat.size, dtype=bool)
        after_forward[1:] = kind[:-1] == PassKind.F.code
        wrong = flat.joined & (starts | ~after_forward | ~np.isin(kind, backwards))
        for i in np.flatnonzero(wrong).tolist():
            p, device = flat.passes[i], int(flat.device[i])
            before = "first" if starts[i] else f"after {_name(flat.passes[i - 1])}"
            found.append(Diagnostic(
                "error",
                f"device {device} runs {_name(p)} overlapped, {before}: an overlapped "
                "pair is a forward then a backward (F(j, c) & B(k, c2))",
                p.span,
            ))

    # table[kind, microbatch, stage]: the last pass there, among those that can
    # be where they are (when all can: the flat schedule's index table)
    if ok.all():
        valid = None
        table = flat.index_table()
        repeated = any(
            (table[kind[part], mb[part], st[part]] != np.arange(part.start, part.stop)).any()
            for part in flat.chunks()
        )
    else:
        valid = np.flatnonzero(ok)
        table = np.full((NUM_KINDS, m, S), -1, dtype=np.int64)
        keys = (kind[valid], mb[valid], st[valid])
        table[keys] = valid
        repeated = bool((table[keys] != valid).any())
        del keys
    # duplicates: every occurrence after the first, grouped by the lines of the
    # repeat and of the first run, with a note at the first run
    if repeated:
        if valid is None:
            valid = np.arange(flat.size)
        linear = (kind[valid].astype(np.int64) * m + mb[valid]) * S + st[valid]
        counts = np.bincount(linear, minlength=NUM_KINDS * m * S)
        first: dict[int, int] = {}
        repeats: dict[tuple, list[int]] = {}
        for k, key in zip(valid.tolist(), linear.tolist(), strict=True):
            if counts[key] < 2:
                continue
            if key not in first:
                first[key] = k
                continue
            q = flat.passes[first[key]]
            group = (int(dev[k]), flat.passes[k].span, q.span)
            repeats.setdefault(group, []).append(k)
        for (device, span, first_span), ks in repeats.items():
            bad = [flat.passes[k] for k in ks]
            many = len(bad) != 1
            at = first[int(linear[np.searchsorted(valid, ks[0])])]
            found.append(
                Diagnostic(
                    "error",
                    f"{_list_passes(bad)} run{'' if many else 's'} again on device {device}; "
                    f"every pass runs exactly once: remove the repeat",
                    span,
                    (
                        (
                            first_span,
                            f"the first run of {_name(flat.passes[at])}: pass "
                            f"{at - int(flat.offsets[device])} of the order",
                        ),
                    ),
                )
            )

    expected = list(range(NUM_KINDS))
    present = (table >= 0) | ~allowed[:, None, :]
    if lanes > 1:  # the passes of another lane's stages are not needed
        present |= (mb_lane[:, None] != np.arange(S)[None, :] // length)[None, :, :]
    if not present.all():
        # group by the device that should run them, then by (kind, stage)
        missing = np.argwhere(~present)  # rows: (kind code, mb, stage)
        by_device: dict[int, dict[tuple[int, int], list[int]]] = {}
        for e, j, stage in missing.tolist():
            groups = by_device.setdefault(s.placement.stage_device[stage], {})
            groups.setdefault((expected[e], stage), []).append(j)
        for device in sorted(by_device):
            groups = by_device[device]
            show_stage = len(s.placement.chunks(device)) > 1
            count = sum(len(v) for v in groups.values())
            listed = "; ".join(
                format_runs(KINDS[code], stage, mbs, show_stage)
                for (code, stage), mbs in sorted(groups.items(), key=lambda x: (x[0][1], x[0][0]))
            )
            notes = _makers(flat, device, groups) + _unplaced(s, flat, device, groups)
            found.append(
                Diagnostic(
                    "error",
                    f"device {device} never runs {count} pass{'es' if count != 1 else ''} that "
                    f"its stages need: {listed}; add {'them' if count != 1 else 'it'} to its order",
                    notes[0][0] if notes else s.span,
                    tuple(notes),
                )
            )
    return found


def _unplaced(
    s: Schedule, flat: FlatSchedule, device: int, groups: dict[tuple[int, int], list[int]]
) -> list[tuple[Span | None, str]]:
    """A note at the `place` line for the stages of missing passes that the
    device's order never runs at all: the placement gave them to it."""
    lo, hi = int(flat.offsets[device]), int(flat.offsets[device + 1])
    run = set(np.unique(flat.stage[lo:hi]).tolist())
    unrun = sorted({stage for _, stage in groups} - run)
    if not unrun or s.placement.span is None:
        return []
    listed = ", ".join(str(stage) for stage in unrun)
    return [(
        s.placement.span,
        f"the placement ({s.placement.kind}) gives device {device} stage"
        f"{'s' if len(unrun) != 1 else ''} {listed}, which its order never runs",
    )]


_SHOWN_MAKERS = 3
"""How many (kind, stage) groups of missing passes get a note at their nearest pass."""


def _makers(
    flat: FlatSchedule, device: int, groups: dict[tuple[int, int], list[int]]
) -> list[tuple[Span | None, str]]:
    """For each (kind, stage) of missing passes, the line that makes the pass of
    that kind on that stage (or, failing that, of that kind on the device) nearest
    the first missing microbatch: the loop or block line that should have made
    it. Where no such pass exists, the nearest pass of that stage."""
    lo, hi = int(flat.offsets[device]), int(flat.offsets[device + 1])
    kinds, stages, microbatches = (
        flat.kind[lo:hi], flat.stage[lo:hi], flat.microbatch[lo:hi]
    )
    notes: list[tuple[Span | None, str]] = []
    for (code, stage), mbs in sorted(groups.items(), key=lambda x: (x[0][1], x[0][0])):
        if len(notes) == _SHOWN_MAKERS:
            break
        for select, what in (
            ((kinds == code) & (stages == stage), f"{KINDS[code].value} of stage {stage}"),
            (kinds == code, f"{KINDS[code].value}"),
            (stages == stage, f"pass of stage {stage}"),
        ):
            candidates = np.flatnonzero(select)
            if candidates.size:
                k = int(candidates[np.argmin(np.abs(microbatches[candidates] - mbs[0]))])
                p = flat.passes[lo + k]
                notes.append((
                    p.span,
                    f"{format_runs(KINDS[code], stage, mbs, True)} missing: the nearest {what} on "
                    f"device {device}, {_name(p)}, is made here",
                ))
                # the missing passes' place in the order: right after their
                # nearest pass (a dropped line leaves its gap there)
                if lo + k + 1 < hi:
                    q = flat.passes[lo + k + 1]
                    if q.span is not None and p.span is not None and q.span.line != p.span.line:
                        notes.append((q.span, f"the order goes on with {_name(q)} here"))
                break
    return notes
