"""Random building blocks, written as `.pp` text the way a user would write them
and compiled by the whole compiler: whatever it accepts satisfies every static
guarantee (checked here independently of the checks), and whatever it rejects
comes back as located errors, never as a crash."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.analysis.lifespans import block_memory
from ppdsl.analysis.memory import peak_memory
from ppdsl.analysis.simulate import simulate
from ppdsl.compiler import compile_source
from ppdsl.diagnostics import CompileError
from ppdsl.ir.schedule import Pass, PassKind
from ppdsl.testing import block_sources, grouped_block_sources
from tests.factories import brute_force_finishes

FILE = "random_block.pp"


def _needs(kind: PassKind, j: int, s: int, last: int, split: bool, recompute=frozenset()):
    if kind is PassKind.F:
        return [(PassKind.F, j, s - 1)] if s > 0 else []
    if kind is PassKind.W:
        return [(PassKind.B, j, s)]
    if kind is PassKind.R:
        return [(PassKind.F, j, s)]
    back = PassKind.B if split else PassKind.BW
    mine = [(PassKind.R, j, s)] if s in recompute else [(PassKind.F, j, s)]
    return mine + ([(back, j, s + 1)] if s < last else [])


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(block_sources(), st.integers(0, 2**32 - 1))
def test_accepted_blocks_keep_every_guarantee(source, seed):
    """Random plain blocks: accepted ones keep every guarantee, rejected ones are
    located errors."""
    _keeps_every_guarantee(source, seed)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(grouped_block_sources(), st.integers(0, 2**32 - 1))
def test_accepted_grouped_blocks_keep_every_guarantee(source, seed):
    """Random grouped blocks: the same; and an accepted one's orders are its plain
    repetition (each device's passes by slot start + (j // G) T + (j % G) U,
    computed here) or, tightened, neither later nor holding more on any device."""
    compiled = _keeps_every_guarantee(source, seed)
    if compiled is None:
        return
    s = compiled.schedule
    block = s.block
    assert block is not None
    if s.split_backward and not any(slot.kind is PassKind.W for slot in block.slots):
        return  # W fill places W by its own timeline
    plain = []
    for device in range(s.num_devices):
        timed = sorted(
            (slot.start + (j // block.group_size) * block.period
             + (j % block.group_size) * block.group_spacing, k, j, slot)
            for k, slot in enumerate(block.slots)
            if slot.device == device
            for j in range(s.num_microbatches)
        )
        plain.append(tuple(Pass(slot.kind, j, slot.stage) for _, _, j, slot in timed))
    ours = [[p.key for p in order] for order in s.orders]
    if ours == [[p.key for p in order] for order in plain]:
        return
    repeated = replace(s, orders=tuple(plain))
    assert compiled.timeline.makespan <= simulate(repeated).makespan + 1e-9, source
    assert all(a <= b for a, b in zip(peak_memory(s), peak_memory(repeated), strict=True)), source


def _keeps_every_guarantee(source, seed):
    """The compiled schedule, or None when the compiler rejected the source."""
    try:
        compiled = compile_source(source, FILE)
    except CompileError as err:
        errors = [d for d in err.diagnostics if d.severity == "error"]
        assert errors, source
        for diag in errors:  # located in the file the user wrote
            assert diag.span is not None and diag.span.file == FILE, (diag, source)
            assert diag.span.line >= 1 and diag.span.column >= 1
        return None
    s = compiled.schedule
    split = s.split_backward
    kinds = (PassKind.F, PassKind.B, PassKind.W) if split else (PassKind.F, PassKind.BW)
    # every (kind, microbatch, stage) exactly once, on the stage's device
    seen = {}
    for dev, order in enumerate(s.orders):
        for index, p in enumerate(order):
            key = (p.kind, p.microbatch, p.stage)
            assert key not in seen, (key, source)
            assert s.placement.stage_device[p.stage] == dev
            seen[key] = (dev, index)
    marked = s.recompute
    expected = {
        (k, j, st_)
        for j in range(s.num_microbatches)
        for st_ in range(s.num_stages)
        for k in (*kinds, *((PassKind.R,) if st_ in marked else ()))
    }
    assert set(seen) == expected
    # dependencies: in the timeline, each pass starts after what it needs ends
    t = compiled.timeline
    last = s.num_stages - 1
    for key, (dev, index) in seen.items():
        start = t.start[dev][index]
        for need in _needs(key[0], key[1], key[2], last, split, marked):
            ndev, nindex = seen[need]
            assert t.end[ndev][nindex] <= start + 1e-9, (key, need, source)
    # memory: the prefix-sum peak on every device is within the file's bound
    mm = s.memory
    for order in s.orders:
        level = peak = 0
        for p in order:
            a, w = mm.activation[p.stage], mm.weight_retained[p.stage]
            kept = mm.kept(p.stage)
            if kept is None:
                change = {PassKind.F: a, PassKind.B: w - a, PassKind.W: -w, PassKind.BW: -a}
            else:  # recomputed: F keeps its input, R restores the rest
                change = {PassKind.F: kept, PassKind.R: a - kept, PassKind.B: w - a,
                          PassKind.W: -w, PassKind.BW: -a}
            level += change[p.kind]
            peak = max(peak, level)
        assert peak <= s.num_stages * s.num_microbatches  # sanity
        bound = next(e for e in s.expects if e.metric == "peak_memory").bound
        assert peak <= bound, source
    # lifespans: a W-less or explicit-W block's run from its F slot to the end of
    # the slot freeing the last activation, within the file's bound; the steady
    # state (derived two ways inside the compiler) never exceeds the ⌈l/T⌉ rule
    found = block_memory(s)
    slots = {(x.kind, x.stage): x for x in s.block.slots}
    for x in found.lifespans:
        if (x.frees, x.stage) in slots:
            last = slots[(x.frees, x.stage)]
            assert x.length == last.start + last.duration - slots[(PassKind.F, x.stage)].start
        for e in s.expects:
            if e.metric == "lifespan":
                assert x.length <= e.bound, source
    if found.steady is not None:
        assert all(a <= b for a, b in zip(found.steady, found.rule, strict=True)), source
    # the lowered programs run to the end under blocking exchanges
    assert brute_force_finishes(compiled.programs, random.Random(seed)), source
    return compiled
