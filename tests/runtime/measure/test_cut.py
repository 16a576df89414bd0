"""ppdsl/runtime/measure/cut.py: the per-layer profile of a `hf:DIR` model, stages as
sums of their layers, and the balanced cut (docs/runtime.md, "Hugging Face
models")."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from ppdsl.runtime.measure.cut import LayerProfile, balanced_cut, stage_timings  # noqa: E402
from ppdsl.runtime.measure.records import StageTiming  # noqa: E402
from ppdsl.runtime.models.model import ModelError  # noqa: E402
from tests.dist import hf_models  # noqa: E402


def _timing(ms: float, mb: int) -> StageTiming:
    return StageTiming(forward_ms=ms / 3, input_ms=ms / 3, weight_ms=ms / 3,
                       plain_forward_ms=ms / 3, fused_ms=2 * ms / 3, activation_bytes=mb,
                       plain_activation_bytes=mb, weight_bytes=mb // 2, gradient_bytes=0)


def _profile(times: list[float], mbs: list[int]) -> LayerProfile:
    names = ("embedding", *(f"layer {i}" for i in range(len(times) - 2)), "head")
    return LayerProfile(names, tuple(_timing(t, m) for t, m in zip(times, mbs, strict=True)),
                        64, 2, "thread")


def _cuts(n: int, stages: int):
    for inner in itertools.combinations(range(1, n), stages - 1):
        yield (0, *inner)


def _slowest(profile: LayerProfile, cut) -> float:
    return max(t.forward_ms + t.input_ms + t.weight_ms for t in stage_timings(profile, cut))


def test_balanced_cut_is_the_best_contiguous_cut() -> None:
    """With a head as costly as three layers (a large vocabulary) the balanced
    cut gives the last stage fewer layers, and on random profiles its slowest
    stage equals the best over every contiguous cut, with and without a bound
    on each stage's M_B; stage costs are the sums of their layers'."""
    heavy = _profile([0.5] + [1.0] * 8 + [3.0], [1] * 10)
    assert balanced_cut(heavy, 2) == (0, 5)  # 0.5 + 5 layers | 3 layers + 3: 5.5 | 6
    assert _slowest(heavy, (0, 5)) == pytest.approx(6.0)
    total = stage_timings(heavy, (0, 5))
    assert total[0].activation_bytes == 6 and total[1].activation_bytes == 4
    import random

    rng = random.Random(4)
    for _ in range(40):
        n, stages = rng.randint(2, 9), rng.randint(1, 4)
        if n < stages:
            continue
        times = [rng.uniform(0.1, 3) for _ in range(n + 2)]
        mbs = [rng.randint(1, 9) for _ in range(n + 2)]
        profile = _profile(times, mbs)
        best = min(_slowest(profile, c) for c in _cuts(n, stages))
        assert _slowest(profile, balanced_cut(profile, stages)) == pytest.approx(best)
        limit = [rng.randint(5, 30)] * stages
        fits = [c for c in _cuts(n, stages)
                if all(t.activation_bytes <= lim for t, lim in
                       zip(stage_timings(profile, c), limit, strict=True))]
        if fits:
            got = balanced_cut(profile, stages, limit)
            assert got in fits
            assert _slowest(profile, got) == pytest.approx(min(_slowest(profile, c) for c in fits))
        else:
            with pytest.raises(ModelError, match="no cut"):
                balanced_cut(profile, stages, limit)


@pytest.mark.slow
def test_per_layer_profile_writes_the_cuts_stage_costs(tmp_path: Path, capsys) -> None:
    """`ppdsl profile --model hf:DIR --per-layer --stages 2 --cut 0,3 -o costs.pp`
    measures the embedding, each decoder layer and the head, writes the cut and
    each stage's summed costs, and `ppdsl stats --costs-from costs.pp` uses each
    stage's own costs."""
    from ppdsl.cli import main

    folder = hf_models.write(tmp_path, "llama", weights=False)
    costs = tmp_path / "costs.pp"
    args = ["profile", "--model", f"hf:{folder}", "--per-layer", "--stages", "2", "--cut", "0,3",
            "--seq-len", "8", "--warmup", "1", "--repeats", "2"]
    assert main([*args, "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert [r["layer"] for r in measured["layers"]] == [
        "embedding", "layer 0", "layer 1", "layer 2", "layer 3", "head"]
    assert measured["cut"] == [0, 3]
    layers, stages = measured["layers"], measured["stages"]
    assert stages[0]["activation_bytes"] == sum(r["activation_bytes"] for r in layers[:4])
    assert stages[1]["activation_bytes"] == sum(r["activation_bytes"] for r in layers[4:])
    assert main([*args, "-o", str(costs)]) == 0
    out = capsys.readouterr().out
    assert "cut (0,3) into 2 stages: 0,3 (layers 0-2 | 3)" in out
    text = costs.read_text()
    assert text.startswith("# cut: 0,3\n") and "cost F[s] = s == 0 ?" in text
    assert main(["stats", "examples/1f1b.pp", "-D", "d=2", "--costs-from", str(costs)]) == 0


# `ppdsl run --cut balanced` (the chosen cut printed, handed to the ranks and written
# to the manifest) runs inside tests/runtime/models/test_hf.py's
# test_data_parallel_shard_trains_and_saves, one torchrun fewer.
