"""Variable-length microbatches (issue 38): the same steps of long-tailed
documents run (a) padded to the step's longest microbatch in the fixed order,
(b) at their true shapes in the fixed order, (c) at their true shapes in the
order `choose_order` picks per step (`ppdsl run --reorder`), each measured
beside the simulator's prediction from per-token costs.

1F1B at d=4, m=8, 4 gloo CPU processes of one thread each. The model: per
stage one transformer block (hidden 64, 4 heads, causal attention, MLP 4x),
an embedding before the first and a head after the last, so a pass's cost
grows with its tokens (attention's square term dominates long documents).
Documents: lengths 128 + 300 x Pareto(1.1), capped at 4096, seed 0 (most
short, a few up to 4,096 tokens). Per-token costs: each rank times its stage's
F and fused backward at 128 .. 4096 tokens (median of 3), fitted as
a + b*t + c*t^2; a transfer costs what a ping-pong of the median document's
hidden states between ranks 0 and 1 measures (half its round trip, median of
20). Measured: a step is barrier to barrier, the slowest rank's; each step
runs RUNS times (the first step once more: it probes the shapes) and the noise
is the largest spread (max - min) / max over a step's runs.

    python -m bench varlen [--write]      # --write: bench/results/varlen.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
D, M, STEPS, RUNS, HIDDEN, HEADS, VOCAB = 4, 8, 8, 3, 64, 4, 256
QUICK = "--quick" in sys.argv or bool(os.environ.get("PPDSL_BENCH_QUICK"))
"""--quick: documents and profile 8 times shorter (a smoke run, not the table)."""
SCALE = 8 if QUICK else 1
PROFILE_LENGTHS = tuple(n // SCALE for n in (128, 512, 1024, 2048, 3072, 4096))


def documents(path: Path, count: int = 64, seed: int = 0) -> list[int]:
    """The long-tailed document file the bench trains on; its lengths."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.clip(128 + (rng.pareto(1.1, count) * 300).astype(np.int64), 128, 4096) // SCALE
    tokens = rng.integers(0, VOCAB, int(lengths.sum()))
    np.savez(path, tokens=tokens, offsets=np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    return [int(x) for x in lengths]


def _stage(index: int, num_stages: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(index)
            self.embed = nn.Embedding(VOCAB, HIDDEN) if index == 0 else None
            self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
            self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
            self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(),
                                     nn.Linear(4 * HIDDEN, HIDDEN))
            self.head = nn.Linear(HIDDEN, VOCAB) if index == num_stages - 1 else None

        def forward(self, x, positions):
            if self.embed is not None:
                x = self.embed(x)
            n = x.shape[1]
            q, k, v = self.qkv(self.norm1(x)).view(1, n, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(1, n, HIDDEN))
            x = x + self.mlp(self.norm2(x))
            return self.head(x) if self.head is not None else (x, positions)

    return Block()


def _loss(logits, targets):
    import torch

    flat = targets.reshape(-1)
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), flat,
                                              ignore_index=-100, reduction="sum")
    return total / (flat != -100).sum().clamp(min=1)


def _padded(pair, width: int):
    """A microbatch's ((ids, positions), targets) padded at the end to `width`
    tokens (targets ignored there): what a runtime with fixed shapes sends."""
    import torch

    (ids, positions), targets = pair
    extra = width - ids.shape[1]
    if extra == 0:
        return pair
    pad = torch.zeros(1, extra, dtype=ids.dtype)
    more = torch.arange(positions.shape[1], width).unsqueeze(0)
    return ((torch.cat([ids, pad], 1), torch.cat([positions, more], 1)),
            torch.cat([targets, torch.full_like(pad, -100)], 1))


def _profile(stage, first: bool, last: bool) -> dict[str, list[float]]:
    """This stage's F and fused backward, median of 3, at PROFILE_LENGTHS (ms)."""
    import torch

    found: dict[str, list[float]] = {"F": [], "BW": []}
    for n in PROFILE_LENGTHS:
        times: dict[str, list[float]] = {"F": [], "BW": []}
        for _ in range(3):
            if first:
                x = torch.randint(0, VOCAB, (1, n))
            else:
                x = torch.randn(1, n, HIDDEN, requires_grad=True)
            positions = torch.arange(n).unsqueeze(0)
            t0 = time.perf_counter()
            out = stage(x, positions)
            t1 = time.perf_counter()
            y = out if last else out[0]
            y.backward(torch.ones_like(y))
            t2 = time.perf_counter()
            times["F"].append((t1 - t0) * 1e3)
            times["BW"].append((t2 - t1) * 1e3)
        for kind in found:
            found[kind].append(sorted(times[kind])[1])
    return found


def _ping(tokens: int) -> float:
    """Half the round trip of `tokens` tokens' hidden states between ranks 0
    and 1 (ms, median of 20; the other ranks idle)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    x = torch.zeros(1, tokens, HIDDEN)
    times = []
    for _ in range(20):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
        times.append((time.perf_counter() - t0) * 1e3 / 2)
    return sorted(times)[len(times) // 2]


def _worker(work: Path) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from ppdsl.analysis.reorder import simulate
    from ppdsl.lengths import open_documents
    from ppdsl.runtime import load_schedule
    from ppdsl.runtime.execution.group import gather
    from ppdsl.runtime.execution.pipeline import PipelineRunner
    from ppdsl.runtime.models.documents import DocumentBatches
    from ppdsl.runtime.training.reorder import agreed_order
    from ppdsl.semantics import KINDS

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    compiled = load_schedule(ROOT / "examples" / "1f1b.pp", {"d": D, "m": M})
    runner = PipelineRunner(compiled, lambda s: _stage(s, D), _loss, timeout=600, device="cpu")
    batches = DocumentBatches.of(open_documents(work / "docs.npz"))
    profiled = gather(_profile(runner.stages[rank], rank == 0, rank == D - 1))
    rows = [[(0.0, 0.0, 0.0)] * D for _ in KINDS]
    fits = []
    for s, kinds in enumerate(profiled):
        for kind, ms in kinds.items():
            c, b, a = np.polyfit(PROFILE_LENGTHS, ms, 2)
            rows[[k.name for k in KINDS].index(kind)][s] = (float(a), float(b), float(c))
            fits.append((s, kind, float(a), float(b), float(c)))
    schedule = compiled.plan.schedule()
    lengths_all = sorted(int(n) for n in batches.documents.lengths)
    comm = gather(_ping(lengths_all[len(lengths_all) // 2]))[0]
    priced = replace(schedule, costs=replace(schedule.costs.with_tokens(rows), comm=comm))
    optimizer = torch.optim.SGD(runner.parameters(), lr=1e-3)
    rows_out = []
    first = True
    # the search's first call prepares the program and compiles its kernel
    # (once per machine): not a step's cost
    agreed_order(priced, batches.lengths(batches.step(0, M)), None)
    for label in ("a", "b", "c"):
        for step in range(STEPS):
            microbatches = batches.step(step, M)
            chosen = None
            if label == "c":
                chosen = agreed_order(priced, batches.lengths(microbatches), None)
                microbatches = [microbatches[j] for j in chosen.slots]
            lengths = batches.lengths(microbatches)
            pairs = [batches.tensors(mb) for mb in microbatches]
            if label == "a":
                width = max(lengths)
                pairs = [_padded(p, width) for p in pairs]
                lengths = [width] * M
            predicted = simulate(priced, lengths)
            runs = []
            for _ in range(RUNS + 1 if first else RUNS):
                optimizer.zero_grad(set_to_none=True)
                dist.barrier()
                t0 = time.perf_counter()
                runner.step([p[0] for p in pairs] if runner.is_first else None,
                            [p[1] for p in pairs] if runner.is_last else None,
                            lengths=lengths, weights=batches.weights(microbatches))
                dist.barrier()
                runs.append((time.perf_counter() - t0) * 1e3)
            if first:  # the first step also probes the shapes: left out
                runs, first = runs[1:], False
            rows_out.append({"config": label, "step": step, "lengths": lengths,
                             "measured": runs, "predicted": predicted,
                             "choose_ms": None if chosen is None or chosen.seconds is None
                             else chosen.seconds * 1e3})
    if rank == 0:
        (work / "result.json").write_text(json.dumps({"rows": rows_out, "fits": fits,
                                                      "comm_ms": comm}))
    dist.destroy_process_group()


def _launch(work: Path) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(D):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(D), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PPDSL_BENCH_QUICK="1" if QUICK else "",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.bench_varlen", "--worker",
                                       str(work)], env=env, cwd=ROOT))
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"bench varlen: a rank failed ({p.returncode})")
    return json.loads((work / "result.json").read_text())


def table(result: dict, lengths: list[int]) -> str:
    """The markdown table of a run's result."""
    rows = result["rows"]
    lines = ["| config | steps | measured ms/step | predicted ms/step | measured/predicted "
             f"| noise ({RUNS} runs) | vs (a) |", "|---|---|---|---|---|---|---|"]
    means = {}
    for label, name in (("a", "(a) pad to max, fixed order"), ("b", "(b) true shapes, fixed order"),
                        ("c", "(c) true shapes, --reorder")):
        mine = [r for r in rows if r["config"] == label]
        measured = sum(sum(r["measured"]) / len(r["measured"]) for r in mine) / len(mine)
        predicted = sum(r["predicted"] for r in mine) / len(mine)
        noise = max((max(r["measured"]) - min(r["measured"])) / max(r["measured"]) for r in mine)
        means[label] = measured
        lines.append(f"| {name} | {len(mine)} | {measured:.1f} | {predicted:.1f} | "
                     f"{measured / predicted:.3f} | {noise:.1%} | {measured / means['a']:.3f} |")
    chose = [r["choose_ms"] for r in rows if r["choose_ms"] is not None]
    lines.append("")
    lines.append(f"choose_order per step: {max(chose):.1f} ms max, "
                 f"{sum(chose) / len(chose):.1f} ms mean (budget 50 ms). Documents: "
                 f"{len(lengths)}, {min(lengths)}..{max(lengths)} tokens, median "
                 f"{sorted(lengths)[len(lengths) // 2]}. Transfer cost (ping-pong): "
                 f"{result['comm_ms']:.3f} ms. Fitted per-token costs (ms; stage, pass, a, b, c): "
                 + "; ".join(f"{s} {k} {a:.3g} {b:.3g} {c:.3g}" for s, k, a, b, c in result["fits"])
                 + ".")
    return "\n".join(lines)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        lengths = documents(work / "docs.npz")
        result = _launch(work)
    text = table(result, lengths)
    print(text)
    if "--write" in sys.argv and not QUICK:
        out = ROOT / "bench" / "results" / "varlen.md"
        out.write_text(__doc__.split("\n\n")[0] + "\n\n" + text + "\n\nper step:\n\n"
                       + "\n".join(json.dumps(r) for r in result["rows"]) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(Path(sys.argv[2]))
    else:
        main()
