"""Does cutting where the time is pay? A Llama-shaped transformers model with a
large vocabulary (32000 ids, hidden 256, 12 layers, 64 tokens: the LM head alone
costs about as much as ten decoder layers), trained through `ppdsl run --model
hf:DIR` on 2 gloo CPU ranks, m = 4, microbatch 2: the median step time of the
balanced cut (chosen by `--cut balanced` from a per-layer profile) against the
equal cut, same schedule, in one bench run; then `ppdsl plan`'s choice (cut and
schedule, budget 1 GiB) against the fastest of the example schedules (1F1B,
ZB-H1, ZB-V, V-Half) with the equal cut, each measured the same way.

`--quick`: 6 layers, vocabulary 16000, 3 steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICK = "--quick" in sys.argv
LAYERS, VOCAB, HIDDEN, SEQ = (6, 16000, 256, 64) if QUICK else (12, 32000, 256, 64)
STEPS = 3 if QUICK else 6
D, M = 2, 4
EXAMPLES = ("1f1b", "zb_h1", "zb_v", "v_half")


def _ppdsl(*argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "ppdsl", *argv], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"ppdsl {' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return proc


def _model(folder: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN,
                                      intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=SEQ)
    config.save_pretrained(folder)  # no weights: every run starts from --seed 0


def _train(schedule: str, folder: Path, cut: str, out: Path, extra: tuple[str, ...] = ()) -> dict:
    proc = _ppdsl("run", schedule, "-D", f"d={D}", "-D", f"m={M}", "--model", f"hf:{folder}",
                  "--seq-len", str(SEQ), "--cut", cut, "--steps", str(STEPS),
                  "--batch-size", str(2 * M), "--optimizer", "sgd", "--lr", "0.01",
                  "--json", str(out), *extra)
    rank0 = json.loads((out / "rank0.json").read_text())
    manifest_cut = next((line.rsplit(":", 1)[1].strip() for line in proc.stdout.splitlines()
                         if line.startswith("ppdsl: cut")), "?")
    return {"ms": rank0["median_step_time_ms"], "cut": manifest_cut,
            "resimulated": rank0["resimulated_step_time_ms"]}


def _table(planned: str) -> dict[tuple[str, str], tuple[str, float]]:
    """{(schedule, rule): (cut, predicted ms)} from `ppdsl plan`'s candidate table."""
    rows = {}
    for line in planned.splitlines():
        parts = line.split(None, 4)
        if len(parts) == 5 and parts[0] in EXAMPLES:
            rows.setdefault((parts[0], parts[4].split(" (over")[0]), (parts[1], float(parts[2])))
    return rows


def main() -> None:
    print(f"Llama-shaped, vocabulary {VOCAB}, hidden {HIDDEN}, {LAYERS} layers, {SEQ} tokens; "
          f"d={D}, m={M}, microbatch 2, gloo CPU ranks (one thread each); median step of "
          f"{STEPS - 1} after the first, ms; each 1F1B run twice, alternating, the lower kept")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        _model(folder)
        plan_pp = Path(tmp) / "plan.pp"
        planned = _ppdsl("plan", "--model", f"hf:{folder}", "-d", str(D), "-m", str(M),
                         "--memory", "1GiB", "--seq-len", str(SEQ), "--schedules",
                         ",".join(EXAMPLES), "--no-transfer", "-o", str(plan_pp)).stdout
        table = _table(planned)
        cuts = {"equal": table[("1f1b", "equal")],
                "balanced": table.get(("1f1b", "balanced"), table[("1f1b", "equal")])}
        results: dict[str, dict] = {}
        for attempt in range(2):
            for rule, (cut, _) in cuts.items():
                r = _train(str(ROOT / "examples" / "1f1b.pp"), folder, cut,
                           Path(tmp) / f"1f1b-{rule}-{attempt}")
                if rule not in results or r["ms"] < results[rule]["ms"]:
                    results[rule] = r
        print(f"{'schedule':<10} {'cut rule':<10} {'cut':<8} {'step ms':>9} {'predicted':>10} "
              f"{'run passes':>10}")
        for rule, r in results.items():
            print(f"{'1F1B':<10} {rule:<10} {r['cut']:<8} {r['ms']:9.1f} {cuts[rule][1]:10.1f} "
                  f"{r['resimulated']:10.1f}")
        print(f"equal / balanced step time: measured "
              f"{results['equal']['ms'] / results['balanced']['ms']:.3f}, predicted "
              f"{cuts['equal'][1] / cuts['balanced'][1]:.3f}, from the runs' own pass times "
              f"{results['equal']['resimulated'] / results['balanced']['resimulated']:.3f}")
        print()
        chosen = next(line for line in planned.splitlines() if line.startswith("plan: "))
        predicted = next(line for line in planned.splitlines() if "predicted step time" in line)
        cut = chosen.split(" cut ", 1)[1].split()[0]
        plan = _train(str(plan_pp), folder, cut, Path(tmp) / "plan",
                      ("--costs-from", str(plan_pp.with_name("plan.costs.pp"))))
        equal = {}
        for stem in EXAMPLES:
            equal[stem] = _train(str(ROOT / "examples" / f"{stem}.pp"), folder, "equal",
                                 Path(tmp) / f"{stem}-equal")
        print(f"{'schedule':<22} {'cut':<12} {'step ms':>9} {'predicted':>10} {'run passes':>10}")
        for stem, r in equal.items():
            print(f"{stem + ' (equal cut)':<22} {r['cut']:<12} {r['ms']:9.1f} "
                  f"{table[(stem, 'equal')][1]:10.1f} {r['resimulated']:10.1f}")
        print(f"{'ppdsl plan':<22} {plan['cut']:<12} {plan['ms']:9.1f} "
              f"{float(predicted.split()[3]):10.1f} {plan['resimulated']:10.1f}   ({chosen[6:]})")
        best = min(equal, key=lambda k: equal[k]["ms"])
        again = min(equal, key=lambda k: equal[k]["resimulated"])
        print(f"best example with the equal cut / plan: measured {equal[best]['ms'] / plan['ms']:.3f} "
              f"({best}), from the runs' own pass times "
              f"{equal[again]['resimulated'] / plan['resimulated']:.3f} ({again})")
        print("predicted: simulated under the per-layer profile's costs; run passes: simulated "
              "under the run's own median pass times (less sensitive to other work on the "
              "machine than the wall-clock step)")


if __name__ == "__main__":
    main()
