"""The pipeline's process-group facts (ppdsl/runtime/execution/group.py, docs/architecture.md
"The runtime's seams"): message tags in disjoint ranges, rank mapping, lane ends
read from the plan, agreement on errors and fingerprints."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch.distributed as dist

from ppdsl.ir.rank import Transfer, TransferKind
from ppdsl.runtime.execution.group import (
    COPY_WIDTH,
    TAG_RANGES,
    LaneEnds,
    agree,
    copy_tag,
    differing,
    global_rank,
    placement_of,
    tie_tag,
    transfer_tag,
)
from ppdsl.runtime.execution.pipeline import load_schedule
from tests.paths import ROOT


def test_tag_ranges_are_disjoint_and_each_allocator_stays_in_its_own() -> None:
    """Transfer, tie and copy tags come from disjoint ranges below 2**31; every tag
    of a small pipeline is distinct, and an index outside a range is refused."""
    ranges = sorted(TAG_RANGES.values(), key=lambda r: r.start)
    assert all(a.stop <= b.start for a, b in itertools.pairwise(ranges))
    assert ranges[0].start >= 0 and ranges[-1].stop <= 1 << 31
    m, n, k = 3, 4, 2
    transfers = [
        transfer_tag(Transfer(kind, mb, max(dst - 1, 0), dst, 0, 1), leaf, m, n, k)
        for kind in TransferKind for mb in range(m) for dst in range(n) for leaf in range(k)
    ]
    ties = [tie_tag(i) for i in range(3)]
    copies = [copy_tag(stage, position) for stage in range(3) for position in (0, 1, COPY_WIDTH - 1)]
    every = transfers + ties + copies
    assert len(set(every)) == len(every)
    assert all(t in TAG_RANGES["transfer"] for t in transfers)
    assert all(t in TAG_RANGES["tie"] for t in ties)
    assert all(t in TAG_RANGES["copy"] for t in copies)
    with pytest.raises(ValueError, match="more than 4096 parameter tensors"):
        copy_tag(0, COPY_WIDTH)
    with pytest.raises(ValueError, match="outside the copy tags"):
        copy_tag(1 << 17, 0)
    with pytest.raises(ValueError, match="outside the transfer tags"):
        transfer_tag(Transfer(TransferKind.GRAD, 1 << 20, 1, 0, 1, 0), 0, 1 << 21, 1 << 8, 1)
    with pytest.raises(ValueError, match="leaf 2 of a transfer of 2 tensors"):
        transfer_tag(Transfer(TransferKind.ACT, 0, 0, 1, 0, 1), 2, m, n, k)


def test_world_rank_is_replica_times_pipeline_ranks_plus_pipeline_rank() -> None:
    """Under --dp, world rank = replica * P + pipeline rank (docs/runtime.md)."""
    assert [placement_of(r, 4) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert global_rank(None, 5) == 5


def test_lane_ends_are_read_from_the_plan() -> None:
    """One lane: stage 0 begins it and the last stage ends it; DualPipe's two lanes
    (S = 8, four stages each) begin at 0 and 4 and end at 3 and 7."""
    plain = load_schedule(ROOT / "examples" / "1f1b.pp", {"d": 4, "m": 4}).plan
    assert LaneEnds.of(plain) == LaneEnds(frozenset({0}), frozenset({3}))
    dual = load_schedule(ROOT / "examples" / "dualpipe.pp", {"d": 4, "m": 8}).plan
    assert dual.lanes == 2
    assert LaneEnds.of(dual) == LaneEnds(frozenset({0, 4}), frozenset({3, 7}))


def test_agreement_on_a_one_rank_group(tmp_path: Path) -> None:
    """On a one-rank gloo group a rank's own error comes back unprefixed and None
    stays None; fingerprints that differ on the rank (program vs manifest) are
    reported with its note, equal ones are not."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert agree("stage 1 is not a module") == "stage 1 is not a module"
        assert agree(None) is None
        assert differing(["abc", "abc"]) is None
        assert differing(["abc", "abd"], note="zb_h1") == [(("abc", "abd"), "zb_h1")]
    finally:
        dist.destroy_process_group()
