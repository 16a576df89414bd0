"""The whole-device byte model (`ppdsl.analysis.device_bytes`): each component
counted by hand on small schedules, the activation row equal to the proven
peak, and `ppdsl stats --bytes` printing every row (docs/architecture.md,
analysis/device_bytes.py)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from ppdsl.analysis.device_bytes import (
    ALLOCATOR_RESERVE,
    COMPONENTS,
    DeviceOptions,
    ModelBytes,
    StageBytes,
    device_bytes,
)
from ppdsl.cli import main
from ppdsl.compiler import Compiled, compile_source
from ppdsl.ir.schedule import PassKind
from tests.paths import EXAMPLES

PARAMS = 1000
UNIT = 100.0


def _compiled(name: str, d: int = 4, m: int = 8) -> Compiled:
    return compile_source((EXAMPLES / f"{name}.pp").read_text(), f"{name}.pp",
                          {"d": str(d), "m": str(m)})


def _model(c: Compiled, boundary: int = 0, stash: int = 0, working: dict | None = None,
           batch: int = 0) -> ModelBytes:
    n = c.schedule.placement.num_model_stages
    return ModelBytes(tuple(StageBytes(PARAMS, boundary, stash, working or {}) for _ in range(n)),
                      UNIT, batch, batch)


def test_state_bytes_counted_by_hand() -> None:
    """Parameters, gradients and optimizer state per rank: fp32 + Adam is 4+4+8
    bytes a parameter, bf16 + Adam 2+2+12 (two moments and a master copy), SGD
    keeps none; `shard` divides the optimizer state by the replicas, replicate
    not, and a sharded stage's parameters and gradients are whole only while
    it is gathered (its first pass to its reduction), the shard after."""
    c = _compiled("1f1b")
    cases = {
        DeviceOptions(): (4000, 4000, 8000),
        DeviceOptions(param_dtype="bf16"): (2000, 2000, 12000),
        DeviceOptions(optimizer="sgd"): (4000, 4000, 0),
        DeviceOptions(optimizer="adamw", dp=2): (4000, 4000, 8000),
        DeviceOptions(dp=2, dp_mode="shard"): (4000, 4000, 4000),
    }
    for options, (params, grads, optim) in cases.items():
        for r in device_bytes(c.schedule, c.lowered, _model(c), options):
            assert (r.bytes["parameters"], r.bytes["gradients"], r.bytes["optimizer"]) == (
                params, grads, optim), options
    before = device_bytes(c.schedule, c.lowered, _model(c), DeviceOptions(dp=2, dp_mode="shard"))
    # rank 3's peak is at its first backward: its stage whole, gradients being made
    assert before[3].at_peak["parameters"] == 4000


def test_dualpipe_holds_two_copies() -> None:
    """DualPipe places each model stage twice: a rank holds the parameters of
    both copies."""
    c = _compiled("dualpipe")
    for r in device_bytes(c.schedule, c.lowered, _model(c)):
        assert r.bytes["parameters"] == 2 * 4 * PARAMS


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "zb_v", "v_half", "looped_bfs", "dualpipe_v"])
def test_activation_row_is_the_proven_peak(name: str) -> None:
    """The activations row's own peak is the compiler's proven per-device peak
    (in units of M_B) times the bytes of a unit."""
    c = _compiled(name)
    proven = c.timeline.peak_memory
    for r in device_bytes(c.schedule, c.lowered, _model(c)):
        assert r.bytes["activations"] == round(Fraction(proven[r.rank]) * Fraction(UNIT))


def test_receive_buffers_follow_early_receives() -> None:
    """A receive's buffer is held from the exchange that posts it: on looped
    breadth-first's turning ranks early receives hold many at once, as many as
    the lowering reports (`RankArrays.receive_buffers_peaks`)."""
    c = _compiled("looped_bfs", d=4, m=8)
    held = c.lowered.receive_buffers_peaks()
    assert max(held) > 1
    for r in device_bytes(c.schedule, c.lowered, _model(c, boundary=10)):
        assert r.bytes["receive_buffers"] == 10 * held[r.rank]


def test_send_buffers_until_their_exchange() -> None:
    """1F1B's first rank sends one activation at a time, held from its F's end
    until its exchange completes; the last rank sends gradients only."""
    c = _compiled("1f1b")
    ranks = device_bytes(c.schedule, c.lowered, _model(c, boundary=10))
    assert [r.bytes["send_buffers"] for r in ranks] == [10, 10, 10, 10]
    none = device_bytes(c.schedule, c.lowered, _model(c))
    assert all(r.bytes["send_buffers"] == 0 for r in none)


def test_stash_gradients_from_b_to_w() -> None:
    """ZB-H1's W stashes keep output gradients from B to W: rank 0 runs each W
    right after its B (one at once), rank 3 runs B0..B3 before W0 (four: ZB-H1's
    order, zero-bubble paper); a fused backward keeps none."""
    c = _compiled("zb_h1")
    ranks = device_bytes(c.schedule, c.lowered, _model(c, stash=7))
    assert [r.bytes["stash_gradients"] for r in ranks] == [7, 14, 21, 28]
    fused = _compiled("1f1b")
    assert all(r.bytes["stash_gradients"] == 0
               for r in device_bytes(fused.schedule, fused.lowered, _model(fused, stash=7)))


def test_autocast_copies_over_fp32_parameters_only() -> None:
    """bf16 autocast over fp32 parameters keeps a 2-byte copy of each; over bf16
    parameters, or without autocast, none."""
    c = _compiled("1f1b")
    for options, copies in ((DeviceOptions(precision="bf16"), 2 * PARAMS),
                            (DeviceOptions(precision="bf16", param_dtype="bf16"), 0),
                            (DeviceOptions(), 0)):
        for r in device_bytes(c.schedule, c.lowered, _model(c), options):
            assert r.bytes["autocast_copies"] == copies


def test_input_batch_on_the_end_ranks() -> None:
    """The step's input ids sit on the first stage's rank and its targets on the
    last stage's; middle ranks hold neither."""
    c = _compiled("1f1b")
    ranks = device_bytes(c.schedule, c.lowered, _model(c, batch=64))
    assert [r.bytes["input_batch"] for r in ranks] == [64, 0, 0, 64]


def test_working_memory_on_top_of_the_level() -> None:
    """A pass's working memory adds to the peak of the sum while it runs."""
    c = _compiled("1f1b")
    base = device_bytes(c.schedule, c.lowered, _model(c))
    busy = device_bytes(c.schedule, c.lowered, _model(c, working={PassKind.BW: 500}))
    for a, b in zip(base, busy, strict=True):
        assert b.bytes["working"] == 500
        assert b.peak_bytes - b.at_peak["reserve"] == a.peak_bytes - a.at_peak["reserve"] + 500


def test_reduction_buffers_with_replicas() -> None:
    """With replicas each stage's fp32 reduction buffer joins its gradients at
    its reduction point; without, there is none."""
    c = _compiled("1f1b")
    two = device_bytes(c.schedule, c.lowered, _model(c), DeviceOptions(dp=2))
    one = device_bytes(c.schedule, c.lowered, _model(c))
    assert all(r.bytes["reduction_buffers"] == 4 * PARAMS for r in two)
    assert all(r.bytes["reduction_buffers"] == 0 for r in one)


def test_peak_of_the_sum_and_the_reserve() -> None:
    """`peak_bytes` is the components at the peak, reserve included (the stated
    fraction of the rest), and at most the sum of each component's own peak."""
    c = _compiled("zb_v")
    for r in device_bytes(c.schedule, c.lowered, _model(c, boundary=10, stash=7, batch=64),
                          DeviceOptions(precision="bf16", dp=2)):
        assert set(r.at_peak) == set(COMPONENTS)
        assert r.peak_bytes == sum(r.at_peak.values())
        rest = r.peak_bytes - r.at_peak["reserve"]
        assert r.at_peak["reserve"] == -(-rest * 5 // 100) or abs(
            r.at_peak["reserve"] - rest * ALLOCATOR_RESERVE) <= 1
        assert r.peak_bytes <= sum(r.bytes.values())


def test_stats_bytes_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    """`ppdsl stats --bytes` prints a row per component and the peak of the sum,
    and `--json` carries them per rank."""
    file = str(EXAMPLES / "zb_h1.pp")
    flags = ["--bytes", "--params", "4e6", "--unit-bytes", "1e6", "--boundary-bytes", "4096",
             "--param-dtype", "bf16", "--optimizer", "adamw"]
    assert main(["stats", file, *flags]) == 0
    out = capsys.readouterr().out
    for name in COMPONENTS:
        assert name.replace("_", " ") in out
    assert "peak (sum)" in out
    assert main(["stats", file, "--json", *flags]) == 0
    found = json.loads(capsys.readouterr().out)["device_bytes"]
    assert (found["param_dtype"], found["optimizer"]) == ("bf16", "adamw")
    assert [r["rank"] for r in found["ranks"]] == [0, 1, 2, 3]
    assert found["ranks"][0]["bytes"]["parameters"] == 2 * 10**6


def test_stats_bytes_needs_its_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    """`--bytes` without `--unit-bytes` is a usage error (exit 2), not a traceback."""
    assert main(["stats", str(EXAMPLES / "1f1b.pp"), "--bytes", "--params", "10"]) == 2
    assert "--unit-bytes" in capsys.readouterr().err
