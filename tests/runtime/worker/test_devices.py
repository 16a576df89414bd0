"""Devices that fit: `--device auto` uses CUDA only with a GPU per local rank (else
CPU with a one-line note), `--device cuda` with too few GPUs is exit 2 before
anything starts; in `ppdsl run` and in the generated launch.py. On this CPU
machine the GPU count is faked: in-process with monkeypatch, and in real rank
processes by a wrapper that patches torch.cuda before running launch.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ppdsl.backend.codegen import write
from ppdsl.cli import main
from ppdsl.compiler import compile_file, generate
from ppdsl.runtime.worker.devices import choose_device
from tests.dist import harness
from tests.paths import ROOT

MODEL = str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":stages"


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize(
    ("requested", "gpus", "ranks", "kind", "note", "error"),
    [
        ("auto", 0, 2, "cpu", False, False),
        ("auto", 1, 2, "cpu", True, False),
        ("auto", 2, 2, "cuda", False, False),
        ("auto", 8, 4, "cuda", False, False),
        ("cuda", 1, 2, None, False, True),
        ("cuda", 0, 1, None, False, True),
        ("cuda", 2, 2, "cuda", False, False),
        ("cpu", 8, 2, "cpu", False, False),
    ],
)
def test_choose_device(
    monkeypatch: pytest.MonkeyPatch, requested: str, gpus: int, ranks: int,
    kind: str | None, note: bool, error: bool,
) -> None:
    """CUDA only with a GPU per local rank; the note and the error say why."""
    _fake_gpus(monkeypatch, gpus)
    choice = choose_device(requested, ranks)
    assert choice.kind == kind
    assert (choice.note is not None) == note
    assert (choice.error is not None) == error
    if error:
        assert f"{ranks} local rank" in choice.error and "--device cpu" in choice.error


def test_run_device_cuda_with_too_few_gpus_is_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ppdsl run --device cuda` with 1 GPU for 2 ranks: exit 2 before torchrun starts."""
    _fake_gpus(monkeypatch, 1)
    started = []
    monkeypatch.setattr("ppdsl.commands.run.launch", lambda *a, **k: started.append(a) or 0)
    code = main(["run", str(ROOT / "examples" / "1f1b.pp"), "-D", "d=2", "--model", MODEL,
                 "--device", "cuda"])
    assert code == 2 and started == []
    assert "needs one GPU per rank" in capsys.readouterr().err


@pytest.mark.parametrize(("requested", "gpus", "kind", "note"), [
    ("auto", 1, "cuda", True), ("cuda", 1, "cuda", True), ("auto", 4, "cuda", False),
    ("auto", 0, "cpu", False), ("cpu", 1, "cpu", False),
])
def test_share_gpu_lets_ranks_share(
    monkeypatch: pytest.MonkeyPatch, requested: str, gpus: int, kind: str, note: bool
) -> None:
    """--share-gpu with fewer GPUs than local ranks trains on CUDA, and says it is a
    development mode (ranks time-slice the GPU); with enough GPUs it changes
    nothing; without a GPU it is CPU (the staged transfers still run)."""
    _fake_gpus(monkeypatch, gpus)
    choice = choose_device(requested, 4, share_gpu=True)
    assert (choice.kind, choice.note is not None, choice.error) == (kind, note, None)
    if note:
        assert "development mode" in choice.note and "time-slice" in choice.note


def test_run_auto_with_one_gpu_for_two_ranks_picks_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ppdsl run` (auto) with 1 GPU for 2 ranks hands the ranks --device cpu, with a note."""
    _fake_gpus(monkeypatch, 1)
    started = []
    monkeypatch.setattr("ppdsl.commands.run.launch",
                        lambda compiled, rank_args, output=None, **_: started.append(rank_args) or 0)
    code = main(["run", str(ROOT / "examples" / "1f1b.pp"), "-D", "d=2", "--model", MODEL])
    assert code == 0
    (rank_args,) = started
    assert rank_args[rank_args.index("--device") + 1] == "cpu"
    assert "1 GPU for 2 local ranks" in capsys.readouterr().err


_WRAPPER = textwrap.dedent("""
    import runpy, sys
    import torch
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


@pytest.mark.distributed
def test_generated_launch_on_a_one_gpu_node(tmp_path: Path) -> None:
    """Two real ranks of a generated launch.py on a node faking one GPU: `--device
    cuda` makes both exit 2 with one clear message and no traceback; `--device
    auto` trains on CPU with gloo after a one-line note."""
    compiled = compile_file(ROOT / "examples" / "1f1b.pp", {"d": "2", "m": "2"})
    write(generate(compiled), tmp_path)
    launch = str(tmp_path / "launch.py")
    base = ["-c", _WRAPPER, launch, "--model", MODEL, "--steps", "1", "--timeout", "60"]
    results = harness.run([*base, "--device", "cuda"], 2, timeout=120)
    assert [r.returncode for r in results] == [2, 2], [r.stderr for r in results]
    errors = "".join(r.stderr for r in results)
    assert errors.count("needs one GPU per rank") == 1 and "Traceback" not in errors
    results = harness.run(base, 2, timeout=180)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    assert "1 GPU for 2 local ranks" in results[0].stderr
    assert "cpu (gloo)" in results[0].stdout


@pytest.mark.distributed
def test_run_share_gpu_trains_through_staged_transfers(tmp_path: Path) -> None:
    """`ppdsl run --share-gpu` on a CPU machine: two real ranks train with their
    transfers staged through host copies over gloo (the path ranks sharing a GPU
    take), say so at start-up, and end with the parameters of the same run
    without it (bit for bit: the staged copies change no value)."""
    def start(*extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "ppdsl", "run", str(ROOT / "examples" / "zb_h1.pp"),
             "-D", "d=2", "-D", "m=4", "--model", MODEL, "--steps", "2",
             "--json", str(tmp_path / ("shared" if extra else "plain")), "--timeout", "60", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)

    def finish(proc: subprocess.Popen[str], shared: bool) -> str:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        if shared:
            assert "shared GPU: transfers staged through host memory" in out
        folder = tmp_path / ("shared" if shared else "plain")
        return " ".join(json.loads((folder / f"rank{r}.json").read_text())["parameters_sha256"]
                        for r in range(2))

    # the two runs (own folders, own ports) start at once: their start-ups overlap
    procs = [start("--share-gpu"), start()]
    try:
        assert finish(procs[0], shared=True) == finish(procs[1], shared=False)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
