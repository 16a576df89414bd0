"""Each rank loads, trains and saves only its own stages (issue 36): a ~0.5B
Qwen2-shaped model (hidden 896, 24 layers, vocabulary 151936, tied head: 494M
parameters) with random weights, written as 4 safetensors shards, under
`ppdsl run examples/1f1b.pp --model hf:DIR -D d=4 --steps 2` on CPU (Adam,
--save-model). Measured in one bench run: the start-up time (from `ppdsl run`'s
start to its line naming the cut, printed when every rank has built its model,
runner and optimizer) of this checkout and of a baseline checkout (`--baseline
PATH`; by default commit `BASELINE_COMMIT` of this repository, exported:
the whole model built on every rank, stopped there), and this
checkout's per-rank host memory by component from its `--json`.

`--write` puts the table in bench/results/real_size.md. Needs about 12 GB of
free memory (the baseline's four ranks each hold the whole model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
D, M, STEPS, SEQ, BATCH = 4, 4, 2, 32, 4


BASELINE_COMMIT = "c51225c"
"""main before the meta build (issue 36): `--model hf:DIR` builds the whole
model in fp32 on every rank, then cuts it."""


def _baseline(tmp: Path) -> Path:
    """The baseline checkout: `--baseline PATH`, or `BASELINE_COMMIT` exported
    into `tmp` with git archive."""
    if "--baseline" in sys.argv:
        return Path(sys.argv[sys.argv.index("--baseline") + 1])
    out = tmp / "baseline-checkout"
    out.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BASELINE_COMMIT],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def _model(folder: Path) -> int:
    """Write the model: random weights from this checkout's seeded rule, 4 shards;
    its parameter count."""
    import torch
    import transformers

    from ppdsl.runtime.models.hf import load_causal_lm

    config = transformers.Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True)
    config.save_pretrained(folder)
    model = load_causal_lm(folder, seed=1)
    count = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        model.save_pretrained(folder, max_shard_size="600MB")
    del model
    return count


def _run(checkout: Path, folder: Path, out: Path, save: bool) -> tuple[float, float | None, str]:
    """`ppdsl run` from `checkout`: seconds to the end of its start-up (its line
    naming the cut, printed once model, runner and optimizer are built on every
    rank), seconds in all (None for the baseline, stopped there: its ranks' Adam
    state beside four whole models would not fit beside other work), its output."""
    argv = [sys.executable, "-m", "ppdsl", "run", "examples/1f1b.pp", "-D", f"d={D}", "-D",
            f"m={M}", "--model", f"hf:{folder}", "--steps", str(STEPS), "--seq-len", str(SEQ),
            "--batch-size", str(BATCH), "--optimizer", "adam", "--json", str(out / "json"),
            "-o", str(out / "build")]
    if save:
        argv += ["--save-model", str(out / "saved")]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=checkout, start_new_session=True)
    first = None
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if first is None and line.startswith("ppdsl: cut"):
            first = time.perf_counter() - start
            if not save:
                os.killpg(proc.pid, signal.SIGTERM)
                break
    code = proc.wait()
    total = time.perf_counter() - start
    text = "".join(lines)
    if first is None or (save and code != 0):
        raise RuntimeError(f"ppdsl run in {checkout} failed ({code}):\n{text[-3000:]}")
    return first, total if save else None, text


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        baseline = _baseline(root)
        baseline_name = (f"commit {BASELINE_COMMIT}" if "--baseline" not in sys.argv
                         else str(baseline))
        folder = root / "qwen2-0.5b"
        count = _model(folder)
        shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
        mine_first, mine_total, mine_text = _run(ROOT, folder, root / "branch", save=True)
        base_first, _, _ = _run(baseline, folder, root / "baseline", save=False)
        ranks = [json.loads((root / "branch" / "json" / f"rank{r}.json").read_text())
                 for r in range(D)]
    load_after = os.getloadavg()[0]
    lines = [
        f"# Real size at run time: {count / 1e6:.0f}M parameters, d={D}, CPU",
        "",
        f"Qwen2-shaped (hidden 896, 24 layers, vocabulary 151936, tied head), random weights "
        f"in {len(shards)} safetensors shards; `ppdsl run examples/1f1b.pp -D d={D} -D m={M} "
        f"--steps {STEPS} --seq-len {SEQ} --batch-size {BATCH} --optimizer adam`, "
        f"this checkout with `--save-model`; `python -m bench real_size` ({os.cpu_count()} cores, "
        f"shared with other work: load average {load_before:.1f} at the start, "
        f"{load_after:.1f} at the end; times are wall clock).",
        "",
        "| checkout | start-up: to the cut line (s) | whole run (s) |",
        "|---|---:|---:|",
        f"| baseline ({baseline_name}, whole model on every rank; stopped after its start-up) "
        f"| {base_first:.1f} | - |",
        f"| this one (own stages only, --save-model) | {mine_first:.1f} | {mine_total:.1f} |",
        "",
        f"start-up ratio this/baseline: {mine_first / base_first:.2f}",
        "",
        "Per rank, host memory above the bare runtime (torch, the process group, "
        "transformers and the model's modeling code imported), GiB: peak resident over the whole run including "
        "--save-model, and the model state (parameters + gradients + Adam's state) "
        "as measured.",
        "",
        "| rank | parameters | gradients | optimizer | activations | rest | peak above bare "
        "| state | peak / state |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in ranks:
        got = r["host_bytes"]
        state = got["parameters"] + got["gradients"] + got["optimizer"]
        above = r["host_peak_above_bare"]
        lines.append(f"| {r['rank']} | {_gib(got['parameters'])} | {_gib(got['gradients'])} "
                     f"| {_gib(got['optimizer'])} | {_gib(got['activations'])} "
                     f"| {_gib(got['rest'])} | {_gib(above)} | {_gib(state)} "
                     f"| {above / state:.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    print(mine_text[-2500:])
    if "--write" in sys.argv:
        (ROOT / "bench" / "results" / "real_size.md").write_text(table)
