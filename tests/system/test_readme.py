"""The README and the tutorial are what a new user tries first: the README's
schedule compiles as printed, every `ppdsl` and `torchrun` command line in the
README runs (after the lines it reads from, in a fresh folder that holds the
examples) and exits 0, and every command of docs/tutorial.md exits as the
tutorial says (0, or 1 where it is marked `# exit 1`), its tutorial files
matching what the text shows.

`ppdsl run` and `torchrun` lines run as processes of their own, one at a time,
beside the other `ppdsl` lines, which run in this process through
`ppdsl.cli.main`, the function the console script and `python -m ppdsl` call
and whose return value is their exit code (tests/system/test_packaging.py runs
the installed console script itself): that spares each line a Python start and
the imports of torch, numba and ortools, which the suite has already paid for.
A line starts after every earlier line that writes a file it names (`-o`,
`--svg`, `--trace`, `--save-model`, `--checkpoint-dir`), so each reads what the
lines before it left, as when typed in order."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from ppdsl.cli import main
from ppdsl.compiler import compile_source

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# the README's plain ``` blocks (a ```python or ```sh block is not one: the
# data-parallel ```sh lines are run by tests/runtime/execution/test_data_parallel.py)
BLOCKS = [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", README, flags=re.S | re.M)
          if not lang]


def _command_lines(blocks: list[str] = BLOCKS) -> list[str]:
    lines = []
    for block in blocks:
        for line in block.splitlines():
            if line.startswith(("ppdsl ", "torchrun ")):
                lines.append(line)
    return lines


# the options whose value is a file or folder the line writes
_WRITES = ("-o", "--svg", "--trace", "--save-model", "--checkpoint-dir")


def _argv(line: str) -> list[str]:
    return shlex.split(line.split("  #", 1)[0])


def _in_process(argv: list[str]) -> bool:
    return argv[0] == "ppdsl" and argv[1] != "run"


def _process(argv: list[str], folder: Path) -> tuple[int, str, str]:
    """A `ppdsl run` or `torchrun` line as a process (torchrun on loopback, on a port
    of its own): (exit code, stdout, stderr)."""
    if argv[0] == "torchrun":
        from tests.dist.harness import free_port

        argv = [sys.executable, "-m", "torch.distributed.run", "--master-addr",
                "127.0.0.1", "--master-port", str(free_port()), *argv[1:]]
    else:
        argv = [sys.executable, "-m", "ppdsl", *argv[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def _run_lines(lines: list[str], folder: Path, capsys: pytest.CaptureFixture[str],
               monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str, str]]:
    """Run each line as written from `folder`, after the earlier lines that write a
    file it names: (exit code, stdout, stderr) per line, in the lines' order. The
    processes run one after another on a thread beside the in-process lines."""
    monkeypatch.chdir(folder)
    written: list[tuple[int, list[str]]] = []
    results: dict[int, Future[tuple[int, str, str]]] = {}
    with ThreadPoolExecutor(max_workers=1) as processes:
        for index, line in enumerate(lines):
            argv = _argv(line)
            needs = [j for j, paths in written for token in argv for path in paths
                     if token == path or token.startswith(path.rstrip("/") + "/")]
            written.append((index, [argv[k + 1] for k in range(1, len(argv) - 1)
                                    if argv[k] in _WRITES]))
            if not _in_process(argv):  # the earlier in-process lines are done; processes run in order
                results[index] = processes.submit(_process, argv, folder)
                continue
            for j in needs:
                results[j].result()
            capsys.readouterr()
            code = main(argv[1:])
            out, err = capsys.readouterr()
            done: Future[tuple[int, str, str]] = Future()
            done.set_result((code, out, err))
            results[index] = done
        return [results[index].result() for index in range(len(lines))]


def test_readme_schedule_compiles_as_printed():
    """The `.pp` text shown in the README is a valid schedule whose expects hold."""
    (source,) = [b for b in BLOCKS if b.startswith("# ZB-H1")]
    compiled = compile_source(source, "README.md")
    assert compiled.schedule.name == "zb_h1" and compiled.warnings == ()


def _assert_trains(stdout: str) -> None:
    """`ppdsl run` on tiny_gpt as a user sees it: per-step lines with the loss
    going down, the closing table, and throughput in samples/s and, tiny_gpt's
    inputs being tokens, tokens/s = 16 x samples/s."""
    steps = [line for line in stdout.splitlines() if line.startswith("step ")]
    losses = [float(line.split("loss")[1].split()[0]) for line in steps]
    assert len(losses) >= 8 and losses[-1] < losses[0], stdout
    assert "peak predicted" in stdout
    for line in steps:
        words = line.split()  # tiny_gpt's inputs are tokens, 16 a sample
        samples = float(words[words.index("samples/s") - 1])
        tokens = float(words[words.index("tokens/s") - 1])
        assert abs(tokens - 16 * samples) <= 16 * 0.05 + 1, line


def _assert_own_loop_trains(stdout: str, folder: Path) -> None:
    """examples/train_loop.py, a user's own loop (DataLoader on the data ranks only,
    AdamW, a LambdaLR, post-validated clipping, a checkpoint), under torchrun with
    2 CPU ranks: 8 steps, the loss falls, the checkpoint is written."""
    losses = [float(line.split("loss")[1].split()[0]) for line in stdout.splitlines()
              if "step " in line and "loss" in line]
    assert len(losses) == 8 and losses[-1] < losses[0], stdout
    assert (folder / "loop_ckpt" / "step-00000008" / ".metadata").is_file()


# Two README lines are also the tests of what they show, with no run of their own:
# the `ppdsl run` of ZB-V on tiny_gpt (a plain run trains as a user sees it) and
# examples/train_loop.py under torchrun (a user's own loop).
TRAINS = "ppdsl run examples/zb_v.pp -D d=4 -D m=8 --model examples/models/tiny_gpt.py:stages"
OWN_LOOP = "torchrun --nproc-per-node 2 examples/train_loop.py"


@pytest.mark.slow
@pytest.mark.distributed
def test_readme_commands_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command line of the README, run as written, exits 0; its `ppdsl run`
    of ZB-V on tiny_gpt prints falling losses, the table and its throughput, and
    examples/train_loop.py's loss falls and its checkpoint is written."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    commands = _command_lines()
    assert len(commands) >= 8, commands
    try:
        import transformers  # noqa: F401
    except ImportError:  # the hf extra is not installed: its line cannot run
        commands = [c for c in commands if " hf:" not in c]
    checked = set()
    for line, (code, out, err) in zip(commands, _run_lines(commands, tmp_path, capsys, monkeypatch),
                                      strict=True):
        assert code == 0, (line, out[-2000:], err[-2000:])
        assert "Traceback" not in err, (line, err[-2000:])
        if line.startswith(TRAINS):
            _assert_trains(out)
            checked.add(TRAINS)
        if line.startswith(OWN_LOOP):
            _assert_own_loop_trains(out, tmp_path)
            checked.add(OWN_LOOP)
    assert checked == {TRAINS, OWN_LOOP}, checked


@pytest.mark.slow
@pytest.mark.distributed
def test_tutorial_commands_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command of the tutorial, run from a copy of the repository's examples
    and tutorial files, exits 0 (1 where marked), and the schedules it shows in
    full are the files' own."""
    text = (ROOT / "docs" / "tutorial.md").read_text()
    blocks = re.findall(r"```\n(.*?)```", text, flags=re.S)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "tutorial").symlink_to(ROOT / "docs" / "tutorial")
    step1 = next(b for b in blocks if b.startswith("schedule step1"))
    assert step1 in (ROOT / "docs" / "tutorial" / "step1_1f1b.pp").read_text()
    commands = _command_lines(blocks)
    assert len(commands) >= 10, commands
    for line, (code, out, err) in zip(commands, _run_lines(commands, tmp_path, capsys, monkeypatch),
                                      strict=True):
        expected = 1 if "# exit 1" in line else 0
        assert code == expected, (line, out[-2000:], err[-2000:])
        assert "Traceback" not in err, (line, err[-2000:])
        if line.split()[1] in ("compare", "show", "export"):  # the output the text shows is current
            shown = [ln.rstrip() for ln in out.splitlines()
                     if ln.startswith(("step", "zb_v", "schedule ", "rank ", "0F0", "1F0"))]
            assert shown and all(ln in text for ln in shown), (line, shown)
