"""ppdsl/commands/plan_real.py: `ppdsl plan --gpu` plans a model from its
config.json alone, `--memory` bounding the whole device (docs/architecture.md,
commands/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from ppdsl.analysis.device_bytes import COMPONENTS  # noqa: E402
from ppdsl.cli import main  # noqa: E402
from tests.paths import EXAMPLES  # noqa: E402

TINY = f"hf:{EXAMPLES / 'models' / 'tiny_llama'}"
FLAGS = ["--model", TINY, "--devices", "2", "--microbatches", "4", "--seq-len", "64",
         "--microbatch-size", "2", "--gpu", "h100", "--schedules", "1f1b,zb_h1"]


def test_plan_json_has_every_rank_by_component(capsys: pytest.CaptureFixture[str]) -> None:
    """`--json` without `-o` prints param_dtype, optimizer, schedule and per rank
    its peak and bytes by component; parameters, gradients and optimizer add up
    to the model's parameter count times 2 + 2 + 12 bytes (bf16, Adam)."""
    code = main(["plan", *FLAGS, "--memory", "80GiB", "--json", "--param-dtype", "bf16"])
    assert code == 0
    found = json.loads(capsys.readouterr().out)
    assert (found["param_dtype"], found["optimizer"]) == ("bf16", "adam")
    assert found["schedule"] in ("1f1b", "zb_h1")
    ranks = found["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(set(r["bytes"]) == set(COMPONENTS) for r in ranks)
    # tiny_llama: embedding 16384, 4 layers of 36992, head 16448 parameters
    total = 16384 + 4 * 36992 + 16448
    assert sum(r["bytes"]["parameters"] for r in ranks) == 2 * total
    assert sum(r["bytes"]["gradients"] for r in ranks) == 2 * total
    assert sum(r["bytes"]["optimizer"] for r in ranks) == 12 * total
    for r in ranks:
        assert r["peak_bytes"] == sum(r["at_peak"].values())
        assert r["bytes"]["activations"] > 0


def test_plan_refuses_a_budget_no_rank_fits(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A whole-device budget below the parameters alone fits nothing: exit 1
    with the smallest peak named, no traceback, no plan written."""
    out = tmp_path / "plan.pp"
    assert main(["plan", *FLAGS, "--memory", "100KiB", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "smallest peak" in err and "Traceback" not in err
    assert not out.exists()


def test_plan_writes_the_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With `-o`, the chosen schedule and its costs are written, and the table
    prints every component's row."""
    out = tmp_path / "plan.pp"
    assert main(["plan", *FLAGS, "--memory", "1GiB", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "peak (sum)" in text and "receive buffers" in text
    assert out.read_text().startswith("# planned by")
    assert (tmp_path / "plan.costs.pp").is_file()


def test_plan_bad_gpu_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown `--gpu` is a usage error naming what to give."""
    flags = [f if f != "h100" else "tpu9" for f in FLAGS]
    assert main(["plan", *flags, "--memory", "1GiB", "--json"]) == 2
    assert "h100, h200, a100" in capsys.readouterr().err
