"""The README is what a new user tries first: its schedule compiles as printed,
and every `ppdsl` and `torchrun` command line in it runs (in order, in a fresh
folder that holds the examples) and exits 0."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ppdsl.compiler import compile_source

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```\n(.*?)```", README, flags=re.S)


def _command_lines() -> list[str]:
    lines = []
    for block in BLOCKS:
        for line in block.splitlines():
            if line.startswith(("ppdsl ", "torchrun ")):
                lines.append(line.split("  #", 1)[0].strip())
    return lines


def test_readme_schedule_compiles_as_printed():
    """The `.pp` text shown in the README is a valid schedule whose expects hold."""
    (source,) = [b for b in BLOCKS if b.startswith("# ZB-H1")]
    compiled = compile_source(source, "README.md")
    assert compiled.schedule.name == "zb_h1" and compiled.warnings == ()


@pytest.mark.slow
@pytest.mark.distributed
def test_readme_commands_run(tmp_path: Path) -> None:
    """Every command line of the README, run as written, exits 0."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    commands = _command_lines()
    assert len(commands) >= 8, commands
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for line in commands:
        argv = shlex.split(line)
        if argv[0] == "torchrun":  # on loopback, on a port of its own
            from tests.dist.harness import free_port

            argv = [sys.executable, "-m", "torch.distributed.run", "--master-addr",
                    "127.0.0.1", "--master-port", str(free_port()), *argv[1:]]
        else:
            argv = [sys.executable, "-m", "ppdsl", *argv[1:]]
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, (line, proc.stdout[-2000:], proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, (line, proc.stderr[-2000:])
