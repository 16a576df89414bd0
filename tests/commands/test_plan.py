"""`ppdsl plan` (ppdsl/commands/plan.py, docs/runtime.md "Hugging Face models"):
profile a hf:DIR model, choose the cut and the schedule together under a memory
budget, write a .pp file that `ppdsl run` trains."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.dist import hf_models  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
def test_plan_chooses_within_the_budget_and_its_output_trains(tmp_path: Path, capsys) -> None:
    """The plan is the fastest printed candidate that fits the budget, its file
    compiles at the planned d and m without -D, a budget no candidate meets is a
    usage error (exit 2), and `ppdsl run` of the printed command trains."""
    from ppdsl.cli import main
    from ppdsl.compiler import compile_file

    folder = hf_models.write(tmp_path, "gpt2", weights=False)
    out = tmp_path / "plan.pp"
    common = ["plan", "--model", f"hf:{folder}", "-d", "2", "-m", "4", "--seq-len", "8",
              "--schedules", "1f1b,zb_h1,zb_v", "--no-transfer", "--warmup", "1",
              "--repeats", "3", "-o", str(out)]
    assert main([*common, "--memory", "10"]) == 2
    assert "no candidate keeps every device within --memory 10" in capsys.readouterr().err
    assert main([*common, "--memory", "1GiB"]) == 0
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines()
            if re.match(r"^(1f1b|zb_h1|zb_v) ", line)]
    assert {r[0] for r in rows} == {"1f1b", "zb_h1", "zb_v"}
    fastest = min(rows, key=lambda r: float(r[2]))
    assert f"plan: {fastest[0]}, cut {fastest[1]} " in text, text
    compiled = compile_file(out)
    assert compiled.schedule.num_devices == 2
    assert (tmp_path / "plan.costs.pp").read_text().startswith(f"# cut: {fastest[1]}\n")
    command = text.strip().splitlines()[-1].split()
    assert command[:2] == ["ppdsl", "run"]
    proc = subprocess.run([sys.executable, "-m", "ppdsl", *command[1:], "--steps", "2"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"cut (first decoder layer of each stage): {fastest[1]}" in proc.stdout
    assert "step    2/2" in proc.stdout and "measured/predicted" in proc.stdout
