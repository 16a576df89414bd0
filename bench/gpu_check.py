"""`make gpu-check` (`python -m bench.gpu_check`): what the runtime does on a GPU,
in one command and one table, sized to run in under 8 minutes on one H100/H200.

(a) the `gpu`-marked tests (pytest -m gpu);
(b) `ppdsl profile` of a GPT-style stage (bench/gpu_gpt.py) at hidden 2048 and
    4096, sequence 2048, bf16, timed by CUDA events: (T_I + T_W) / T_B (target
    <= 1.10), split F / plain F (<= 1.03), M_W / M_B;
(c) 1F1B, ZB-H1, ZB-V and V-Half at d=4, the four ranks sharing the GPU
    (`--share-gpu`: transfers staged through host memory over gloo): parameters
    after 3 steps vs a non-pipelined run (<= 1e-5 relative, fp32), each rank's
    CUDA peak from its own baseline vs the compiler's prediction in bytes
    (within 5%); a Chrome trace of ZB-V through `ppdsl run --share-gpu --trace`;
(d) a d=1 run on NCCL (`ppdsl run --device cuda`);
(e) `--dp 2` replicate and shard at d=2 on the shared GPU: the replicas end
    with the same parameters, and the run exits cleanly (exit 0);
(f) schedules with every stage on the one rank (interleaved 1F1B v=2, ZB-V,
    DualPipe-V at d=1; V-Half's file requires d >= 2 and is named as skipped):
    the ppdsl step over the plain forward+backward of the same microbatches
    (target <= 1.03), and ppdsl's gradients against the plain step's;
(g) the ppdsl step over torch.distributed.pipelining's for the same stages at
    pp=1 (its Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble; target
    <= 0.95). (f) and (g) run bench/_step_compare.py once per size: bf16, hidden
    2048 and 4096, sequence 2048, 4 layers in 2 stages, 4 microbatches of one
    sample, CUDA events, median of 5 steps after 2 warm-up. Estimate on one
    H100: a step there is about 4 x 2.7 TFLOP at h=4096 (~0.03-0.1 s), 7 steps
    x 2 runs x 6 comparisons ~ 10 s, building the model and starting the process
    ~20 s: under a minute per size, about 1.5 minutes for both.

Without CUDA it runs what it can at a small size (the staged transfers on CPU
tensors for (c) and (e), the profile in fp32 and bf16 autocast on CPU) and names
every part it skipped. `--json PATH` also writes the rows; `--logs DIR` keeps each
command's whole output; `--deadline S` caps the whole check at S seconds. The README's GPU
section quotes the last run on a GPU.

On a machine without lark (the GPU machines have no network): on a networked
machine `make gpu-wheels` puts lark's wheel in .gpu-wheels/ (git-ignored); copy
the tree over, and `make gpu-check` installs it with
``pip install --no-index --target .gpu-deps .gpu-wheels/*.whl`` and puts
.gpu-deps on PYTHONPATH. ortools is not needed (only `ppdsl search --exact`
imports it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "bench" / "gpu_gpt.py") + ":stages"
SCHEDULES = ["1f1b", "zb_h1", "zb_v", "v_half"]


@dataclass
class Row:
    """One line of the table."""

    part: str
    what: str
    measured: str
    target: str
    status: str
    """ok, FAIL, skipped (with why), or info."""


def _cuda() -> tuple[bool, str]:
    import torch

    if not torch.cuda.is_available():
        return False, f"no CUDA (torch {torch.__version__})"
    name = torch.cuda.get_device_name(0)
    return True, f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}"


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), **(extra or {}))


class _Budget:
    """The whole check's time limit (`--deadline S`) and where whole outputs go
    (`--logs DIR`): a GPU is lent for minutes, so a run cut short still says
    which part it reached, and every failure's full stderr comes back."""

    end: float = float("inf")
    logs: Path | None = None

    @classmethod
    def left(cls, wanted: float) -> float:
        return max(1.0, min(wanted, cls.end - time.monotonic() - 5))


def _run(argv: list[str], timeout: float, extra: dict[str, str] | None = None,
         label: str = "") -> subprocess.CompletedProcess[str]:
    timeout = _Budget.left(timeout)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=_env(extra),
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else str(exc.stdout or "")
        done = subprocess.CompletedProcess(argv, 124, out, f"timed out after {timeout:g} s")
    if _Budget.logs is not None:
        name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", label or Path(argv[2] if len(argv) > 2 else "run").name)
        (_Budget.logs / f"{name}.log").write_text(
            f"$ {' '.join(argv)}\nrc={done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    return done


def _tail(text: str, lines: int = 3) -> str:
    """The last lines naming an error (a warning printed after one must not hide
    it), else the last lines."""
    found = text.strip().splitlines()
    errors = [line for line in found if re.search(r"Error\b|error:|^ppdsl:", line)]
    return " | ".join((errors or found)[-lines:])[:300]


def _lark_missing() -> str | None:
    try:
        import lark  # noqa: F401
    except ImportError:
        return ("lark is not installed: run `make gpu-wheels` on a networked machine and "
                "`make gpu-check` here (it installs .gpu-wheels/ with pip --no-index)")
    return None


# --- (a) ------------------------------------------------------------------------------


def gpu_tests(cuda: bool) -> list[Row]:
    """The gpu-marked tests."""
    done = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                 "-rfE", "tests"], timeout=240, label="a-gpu-tests")
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else _tail(done.stderr)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    if not cuda:
        return [Row("a", "gpu-marked tests", summary, "all pass on a GPU",
                    f"skipped: no CUDA ({counts.get('skipped', 0)} skipped)")]
    ok = done.returncode == 0 and counts.get("passed", 0) > 0 and not counts.get("failed")
    return [Row("a", "gpu-marked tests", summary, "all pass", "ok" if ok else "FAIL")]


# --- (b) ------------------------------------------------------------------------------


def profile(cuda: bool) -> list[Row]:
    """`ppdsl profile` of one GPT block per stage; stage 0 (a middle-like stage)."""
    if (why := _lark_missing()) is not None:
        return [Row("b", "profile", "-", "-", f"FAIL: {why}")]
    rows = []
    sizes = [(2048, 2048), (4096, 2048)] if cuda else [(256, 128)]
    precisions = ["bf16"] if cuda else ["fp32", "bf16"]
    for hidden, seq in sizes:
        for precision in precisions:
            extra = {"PPDSL_GPT_HIDDEN": str(hidden), "PPDSL_GPT_SEQ": str(seq),
                     "PPDSL_GPT_LAYERS": "2"}
            argv = [sys.executable, "-m", "ppdsl", "profile", "--model", GPT, "--stages", "2",
                    "--microbatch-size", "1", "--precision", precision, "--json", "--no-transfer",
                    "--warmup", "3" if cuda else "1", "--repeats", "10" if cuda else "3",
                    "--device", "cuda" if cuda else "cpu"]
            what = f"h={hidden} s={seq} {precision}"
            done = _run(argv, timeout=300, extra=extra, label=f"b-profile-{hidden}-{seq}-{precision}")
            if done.returncode != 0:
                rows.append(Row("b", f"profile {what}", _tail(done.stderr), "-", "FAIL"))
                continue
            report = json.loads(done.stdout)
            st = report["stages"][0]
            realistic = cuda and hidden >= 2048 and precision == "bf16"
            checks = [("(T_I+T_W)/T_B", st["backward_ratio"], 1.10),
                      ("split F / plain F", st["forward_ratio"], 1.03)]
            for name, value, bound in checks:
                status = ("ok" if value <= bound else "FAIL") if realistic else \
                    "info (target applies at h>=2048 bf16 on a GPU)"
                rows.append(Row("b", f"{name}, {what}", f"{value:.3f}", f"<= {bound}", status))
            rows.append(Row("b", f"M_W/M_B, {what}", f"{st['mw_over_mb']:.3f}",
                            "-", "info"))
            rows.append(Row("b", f"T_F T_B T_I T_W ms, {what}",
                            f"{st['forward_ms']:.2f} {st['fused_ms']:.2f} {st['input_ms']:.2f} "
                            f"{st['weight_ms']:.2f} ({report['clock']}; TF32 {report['tf32']})",
                            "-", "info"))
    return rows


# --- (c) ------------------------------------------------------------------------------


def shared_schedules(cuda: bool, work: Path) -> list[Row]:
    """The four schedules at d=4, ranks sharing the GPU; and ZB-V's trace."""
    if (why := _lark_missing()) is not None:
        return [Row("c", "d=4 on one shared GPU", "-", "-", f"FAIL: {why}")]
    from tests.dist import harness
    from tests.dist.cases import build_cases

    sizes = {"PPDSL_GPT_HIDDEN": "1024", "PPDSL_GPT_SEQ": "512"} if cuda else \
        {"PPDSL_GPT_HIDDEN": "64", "PPDSL_GPT_SEQ": "32"}
    sizes["PPDSL_GPT_LAYERS"] = "8"
    os.environ.update(sizes, PPDSL_TEST_BACKEND="shared")
    if _Budget.logs is not None and cuda:  # what the allocator held at each rank's peak
        os.environ["PPDSL_CUDA_SNAPSHOTS"] = str(_Budget.logs / "snapshots")
    cases = build_cases(4, work / "cases", only=SCHEDULES)
    for case in cases:
        case.update(model=GPT, cuda_peak=True, batch_per_mb=1)
    results = harness.run_cases(cases, 4, work / "cases", timeout=_Budget.left(420))
    rows = []
    for case in cases:
        per_rank = results[case["id"]]
        errors = [r["error"] for r in per_rank if "error" in r]
        if errors and _Budget.logs is not None:
            (_Budget.logs / f"c-{case['name']}.log").write_text("\n\n".join(errors))
        if errors:
            rows.append(Row("c", f"{case['name']} d=4 shared", _tail(errors[0], 2), "-", "FAIL"))
            continue
        err = max(r["param_rel_err"] for r in per_rank)
        rows.append(Row("c", f"{case['name']} d=4: params after 3 steps vs one process",
                        f"{err:.1e}", "<= 1e-5", "ok" if err <= 1e-5 else "FAIL"))
        if cuda or per_rank[0].get("predicted_cuda_peak_bytes"):
            # The compiler's model counts what passes keep (activations); the
            # allocator also holds the W stashes' output gradients and each pass's
            # working memory, which predicted_device_peak adds (docs/runtime.md).
            raw = [r["cuda_peak_bytes"] / r["predicted_peak_bytes"] for r in per_rank]
            ratios = [r["cuda_peak_bytes"] / r["predicted_cuda_peak_bytes"] for r in per_rank]
            worst = max(abs(x - 1) for x in ratios)
            where = "CUDA peak" if cuda else "imitated allocator's peak (CPU)"
            rows.append(Row("c", f"{case['name']} d=4: {where} / predicted with working memory, "
                            "per rank (/ activations alone)",
                            " ".join(f"{x:.3f}" for x in ratios) + " ("
                            + " ".join(f"{x:.3f}" for x in raw) + ")", "within 5%",
                            ("ok" if worst <= 0.05 else "FAIL") if cuda else
                            "info (the target applies on a GPU; staged host buffers count here)"))
            if _Budget.logs is not None:
                (_Budget.logs / f"c-{case['name']}-memory.json").write_text(json.dumps(
                    [{k: r.get(k) for k in ("rank", "stages", "cuda_peak_bytes",
                                            "predicted_cuda_peak_bytes", "predicted_peak_bytes",
                                            "stash_gradient_bytes", "stage_bytes", "working_bytes")}
                     for r in per_rank], indent=1))
    snapshots = _Budget.logs / "snapshots" if _Budget.logs is not None else None
    if cuda and snapshots is not None and snapshots.is_dir():
        # the pickles are large; what explains row (c)'s misses fits in a small JSON
        summary = summarise_snapshots(snapshots, _Budget.logs / "c-snapshots.json")  # type: ignore[operator]
        rows.append(Row("c", "allocator snapshots at each rank's peak", str(summary), "-", "info"))
    trace = work / "zb_v_trace.json"
    done = _run([sys.executable, "-m", "ppdsl", "run", str(ROOT / "examples" / "zb_v.pp"), "-D", "d=4",
                 "--model", GPT, "--share-gpu", "--steps", "2", "--trace", str(trace),
                 "--timeout", "120", "--batch-size", "8"], timeout=300, extra=sizes,
                label="c-zb_v-trace")
    ok = done.returncode == 0 and trace.exists()
    rows.append(Row("c", "ZB-V d=4 ppdsl run --share-gpu --trace",
                    f"{trace.stat().st_size} B trace" if ok else _tail(done.stderr),
                    "a trace", "ok" if ok else "FAIL"))
    if ok:  # the trace checked against the proof, and the run's own costs from it
        own = work / "zb_v_own.pp"
        done = _run([sys.executable, "-m", "ppdsl", "trace", str(trace), "-o", str(own)],
                    timeout=120, label="c-zb_v-own-costs")
        costs = [line.strip() for line in own.read_text().splitlines()
                 if line.strip().startswith(("cost F", "cost B", "cost W", "cost overhead"))
                 ] if done.returncode == 0 and own.exists() else []
        rows.append(Row("c", "ppdsl trace -o: conforms, the run's own costs (ms)",
                        "; ".join(costs) if costs else _tail(done.stderr + done.stdout),
                        "conforms, a costs file", "ok" if costs else "FAIL"))
    return rows


def snapshot_summary(snapshot: dict, top: int = 12) -> dict:
    """One rank's allocator snapshot (`torch.cuda.memory._snapshot()`, as
    `_dump_snapshot` pickles it) reduced to what explains a peak: the trace
    replayed (an alloc adds its block, a completed free removes it) to its
    largest allocated total, the blocks live then grouped by where they were
    made (the innermost ppdsl frame, else the innermost frame), and the
    segments' reserved and allocated bytes at the dump."""
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for trace in snapshot.get("device_traces", []):
        for event in trace:
            action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
            if action == "alloc":
                live[addr] = (size, _where(event.get("frames", [])))
                now += size
                if now > peak:
                    peak, at_peak = now, dict(live)
            elif action == "free_completed" and addr in live:
                now -= live.pop(addr)[0]
    groups: dict[str, list[int]] = {}
    for size, where in at_peak.values():
        group = groups.setdefault(where, [0, 0])
        group[0] += size
        group[1] += 1
    segments = snapshot.get("segments", [])
    return {
        "peak_allocated": peak,
        "reserved": sum(int(seg.get("total_size", 0)) for seg in segments),
        "allocated_at_dump": sum(int(seg.get("allocated_size", 0)) for seg in segments),
        "segments": len(segments),
        "at_peak": [{"where": where, "bytes": b, "blocks": n} for where, (b, n) in
                    sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def _where(frames: list[dict]) -> str:
    """The innermost frame in ppdsl (or the model, or the test worker), else the
    innermost frame: `file:line name`."""
    for frame in frames:
        name = str(frame.get("filename", ""))
        if "ppdsl" in name or "gpu_gpt" in name or "tests/dist" in name:
            return f"{Path(name).name}:{frame.get('line')} {frame.get('name')}"
    if frames:
        return f"{Path(str(frames[0].get('filename'))).name}:{frames[0].get('line')} " \
               f"{frames[0].get('name')}"
    return "(no stack)"


def summarise_snapshots(folder: Path, out: Path) -> Path | None:
    """Every `*.pickle` snapshot in `folder` reduced (`snapshot_summary`) into
    one small JSON at `out`, keyed by file name; None when there is none."""
    import pickle

    found = {}
    for path in sorted(folder.glob("*.pickle")):
        with path.open("rb") as f:
            found[path.stem] = snapshot_summary(pickle.load(f))
    if not found:
        return None
    out.write_text(json.dumps(found, indent=1))
    return out


# --- (d) ------------------------------------------------------------------------------


def nccl_one_rank(cuda: bool, work: Path) -> list[Row]:
    """d=1 on NCCL."""
    if not cuda:
        return [Row("d", "d=1 on NCCL", "-", "runs", "skipped: no CUDA")]
    if (why := _lark_missing()) is not None:
        return [Row("d", "d=1 on NCCL", "-", "-", f"FAIL: {why}")]
    done = _run([sys.executable, "-m", "ppdsl", "run", str(ROOT / "examples" / "1f1b.pp"), "-D", "d=1",
                 "--model", GPT, "--device", "cuda", "--steps", "3", "--timeout", "120"],
                timeout=240, extra={"PPDSL_GPT_HIDDEN": "1024", "PPDSL_GPT_SEQ": "512"}, label="d-nccl")
    ok = done.returncode == 0 and "(nccl)" in done.stdout
    return [Row("d", "d=1 ppdsl run --device cuda (nccl)",
                "trained 3 steps" if ok else _tail(done.stderr + done.stdout), "runs",
                "ok" if ok else "FAIL")]


# --- (e) ------------------------------------------------------------------------------


def data_parallel(cuda: bool, work: Path) -> list[Row]:
    """--dp 2 replicate and shard at d=2, all four ranks on the shared GPU."""
    if (why := _lark_missing()) is not None:
        return [Row("e", "--dp 2 on a shared GPU", "-", "-", f"FAIL: {why}")]
    sizes = {"PPDSL_GPT_HIDDEN": "1024" if cuda else "64", "PPDSL_GPT_SEQ": "512" if cuda else "32"}
    rows = []
    for mode in ("replicate", "shard"):
        out = work / f"dp-{mode}"
        done = _run([sys.executable, "-m", "ppdsl", "run", str(ROOT / "examples" / "zb_h1.pp"),
                     "-D", "d=2", "--dp", "2", "--dp-mode", mode, "--model", GPT, "--share-gpu",
                     "--steps", "3", "--json", str(out), "--timeout", "120", "--batch-size", "8"],
                    timeout=300, extra=sizes, label=f"e-dp-{mode}")
        if done.returncode != 0:  # a crash (shard mode's old SIGSEGV: exit -11) is named by its code
            rows.append(Row("e", f"--dp 2 {mode} d=2", f"exit {done.returncode}: {_tail(done.stderr)}",
                            "exits 0", "FAIL"))
            continue
        found = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
        digests = {}
        for r in found:  # replicas of one pipeline rank hold the same whole parameters
            digests.setdefault(r["pp_rank"], set()).add(r["whole_parameters_sha256"])
        same = all(len(d) == 1 for d in digests.values())
        rows.append(Row("e", f"--dp 2 {mode} d=2 ({'cuda' if cuda else 'cpu'}, shared)",
                        ("replicas equal" if same else "replicas differ") + ", exit 0",
                        "replicas equal, exits 0",
                        "ok" if same else "FAIL"))
    return rows


# --- (f), (g) --------------------------------------------------------------------------


def step_limits(cuda: bool, work: Path) -> list[Row]:
    """Rows (f) and (g): bench/_step_compare.py at each size."""
    if (why := _lark_missing()) is not None:
        return [Row("f", "d=1 ppdsl / plain step", "-", "-", f"FAIL: {why}")]
    if cuda:
        sizes = [(2048, 2048), (4096, 2048)]
        precision, timing = "bf16", ["--warmup", "2", "--steps", "5"]
    else:
        sizes = [(64, 32)]
        precision, timing = "fp32", ["--warmup", "1", "--steps", "5"]
    rows = []
    if not cuda:
        rows.append(Row("f", "bf16, hidden 2048 and 4096, sequence 2048", "-", "on a GPU",
                        "skipped: no CUDA (ran hidden 64, sequence 32, fp32 instead)"))
    for hidden, seq in sizes:
        what = f"h={hidden} s={seq} {precision}"
        done = _run([sys.executable, "-m", "bench._step_compare", "--device", "cuda" if cuda else "cpu",
                     "--precision", precision, *timing], timeout=240,
                    extra={"PPDSL_GPT_HIDDEN": str(hidden), "PPDSL_GPT_SEQ": str(seq),
                           "PPDSL_GPT_LAYERS": "4"}, label=f"fg-{hidden}-{seq}-{precision}")
        if done.returncode != 0:
            rows.append(Row("f", f"d=1 step comparison {what}", _tail(done.stderr), "-", "FAIL"))
            continue
        found = json.loads(done.stdout.strip().splitlines()[-1])
        for part, key, bound in (("f", "plain_ms", 1.03), ("g", "torch_ms", 0.95)):
            for name, r in found[part].items():
                against = "plain" if part == "f" else r["torch_class"]
                status = ("ok" if r["ratio"] <= bound else "FAIL") if cuda else \
                    "info (the target applies on a GPU in bf16)"
                rows.append(Row(part, f"{name} d=1 ppdsl / {against} step, {what}",
                                f"{r['ratio']:.3f} ({r['ppdsl_ms']:.2f} / {r[key]:.2f} ms)",
                                f"<= {bound}", status))
        for name, r in found["f"].items():
            bound = 1e-5 if precision == "fp32" else 2e-2
            rows.append(Row("f", f"{name} d=1 gradients vs the plain step, {what}",
                            f"{r['gradient_error']:.1e}", f"<= {bound:g} relative",
                            "ok" if r["gradient_error"] <= bound else "FAIL"))
        for name, why in found["skipped"].items():
            rows.append(Row(name[1], f"{name[4:]} {what}", "-", "-", f"skipped: {why}"))
    return rows


def table(rows: list[Row], device: str, seconds: float) -> str:
    """The one table."""
    widths = [max(len(getattr(r, k)) for r in rows) for k in ("part", "what", "measured", "target")]
    lines = [f"gpu-check on {device}, {time.strftime('%Y-%m-%d', time.gmtime())}, {seconds:.0f} s"]
    for r in rows:
        lines.append(f"{r.part:<{widths[0]}}  {r.what:<{widths[1]}}  {r.measured:<{widths[2]}}  "
                     f"{r.target:<{widths[3]}}  {r.status}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    json_path = argv[argv.index("--json") + 1] if "--json" in argv else None
    start = time.monotonic()
    if "--deadline" in argv:
        _Budget.end = start + float(argv[argv.index("--deadline") + 1])
    if "--logs" in argv:
        _Budget.logs = Path(argv[argv.index("--logs") + 1])
        _Budget.logs.mkdir(parents=True, exist_ok=True)
    cuda, device = _cuda()
    print(f"[gpu-check] {device}", file=sys.stderr)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        parts = [lambda: gpu_tests(cuda), lambda: profile(cuda)] + \
            [lambda step=step: step(cuda, work)
             for step in (shared_schedules, nccl_one_rank, data_parallel, step_limits)]
        for part in parts:
            try:
                new = part()
            except Exception as exc:  # one part's crash must not hide the others' rows
                new = [Row("?", "a part crashed", f"{type(exc).__name__}: {exc}"[:300], "-", "FAIL")]
            rows += new
            for r in new:  # as they come: a run cut short still shows what it reached
                print(f"[gpu-check] {r.part} {r.what}: {r.measured} ({r.target}) {r.status}",
                      file=sys.stderr, flush=True)
            print(f"[gpu-check] {rows[-1].part} done, {time.monotonic() - start:.0f} s", file=sys.stderr)
    seconds = time.monotonic() - start
    print(table(rows, device, seconds))
    if json_path:
        Path(json_path).write_text(json.dumps({"device": device, "seconds": seconds,
                                               "rows": [asdict(r) for r in rows]}, indent=1))
    failed = [r for r in rows if r.status.startswith("FAIL")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
