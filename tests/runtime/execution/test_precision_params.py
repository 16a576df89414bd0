"""`--param-dtype bf16` in real runs (ppdsl/runtime/execution/precision.py,
docs/runtime.md "Precision"): `ppdsl run` processes on tiny_llama, each rank's
`--json` saying which dtypes its parameters, the optimizer's parameters and the
optimizer's state have.

The tolerance: bf16 keeps 8 significant bits, so one rounding moves a value by at
most 2^-8 of itself (0.4%). The masters stay fp32, so the rounding does not
accumulate over steps; what the loss sees is the bf16 forward and backward of a
4-layer model, a handful of roundings deep. Each step's loss must be within
2^-6 (1.6%, four unit roundings) of the fp32 run's, relative; the measured worst
over 20 Adam steps on a learnable token pattern (loss 5.6 -> 2.2) is 0.2%."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.dist import hf_models
from tests.paths import ROOT

pytest.importorskip("transformers")

STEPS = 20
TOLERANCE = 2.0**-6


def _run(tmp_path: Path, name: str, model: str, data: Path, *extra: str) -> list[dict]:
    """`ppdsl run` 1F1B at d=2 for STEPS Adam steps; each rank's `--json`."""
    out = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "ppdsl", "run", "examples/1f1b.pp", "-D", "d=2", "-D", "m=4",
         "--model", f"hf:{model}", "--data", str(data), "--seq-len", "16",
         "--steps", str(STEPS), "--json", str(out), *extra],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = sorted(out.glob("rank*.json"))
    return [json.loads(p.read_text()) for p in ranks]


def _losses(ranks: list[dict]) -> list[float]:
    found = [r["losses"] for r in ranks if r["losses"]]
    return [float.fromhex(found[0][str(k)]) for k in range(1, STEPS + 1)]


@pytest.mark.slow
@pytest.mark.distributed
def test_bf16_parameters_track_fp32_with_fp32_optimizer_state(tmp_path: Path) -> None:
    """Over 20 Adam steps on tiny_llama (tied head) each bf16 loss is within 2^-6
    of the fp32 run's, relative (the module's text says why), and differs from it
    somewhere (bf16 did compute); every rank's parameters are bf16 while the
    optimizer holds fp32 masters with fp32 state. Under `--dp 2 --dp-mode shard`
    (an untied Llama: FSDP2 shards no tie) the same holds through FSDP2's
    MixedPrecisionPolicy: each rank's fp32 shards are what the optimizer steps."""
    data = tmp_path / "pattern.bin"
    np.tile((np.arange(23) * 11) % hf_models.VOCAB, 400).astype(np.uint16).tofile(data)
    tiny = ROOT / "examples" / "models" / "tiny_llama"
    fp32 = _run(tmp_path, "fp32", str(tiny), data)
    bf16 = _run(tmp_path, "bf16", str(tiny), data, "--param-dtype", "bf16")
    want, got = _losses(fp32), _losses(bf16)
    assert want[-1] < 0.5 * want[0], want  # the pattern is learnt: the losses say something
    worst = max(abs(g - w) / w for g, w in zip(got, want, strict=True))
    assert worst <= TOLERANCE, (worst, want, got)
    assert got != want
    for r in fp32:
        assert r["parameter_dtypes"] == ["float32"], r["rank"]
    for r in bf16:
        assert r["parameter_dtypes"] == r["compute_parameter_dtypes"] == ["bfloat16"], r["rank"]
        assert r["optimizer_parameter_dtypes"] == ["float32"], r["rank"]
        assert r["optimizer_state_dtypes"] == ["float32"], r["rank"]

    llama = hf_models.write(tmp_path, "llama")
    shard = _run(tmp_path, "shard", str(llama), data, "--param-dtype", "bf16",
                 "--reduce-dtype", "fp32", "--dp", "2", "--dp-mode", "shard")
    assert len(shard) == 4
    learnt = _losses(shard)
    assert learnt[-1] < 0.7 * learnt[0], learnt  # the shards' optimizer does step (4.9 -> 2.5)
    for r in shard:
        # FSDP2 keeps each shard fp32 and gathers the stage as bf16 for the passes
        assert r["optimizer_parameter_dtypes"] == ["float32"], r["rank"]
        assert r["optimizer_state_dtypes"] == ["float32"], r["rank"]
        assert r["compute_parameter_dtypes"] == ["bfloat16"], r["rank"]
