"""docs/testing.md runs as written: each `ppdsl` line of its ```sh blocks exits
0 (1 where its comment says `exit 1`) through `ppdsl.cli.main`, and its
```python blocks run in order in one namespace."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ppdsl.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "testing.md").read_text()
# each body led by blank lines to its place in the page, so that its line numbers
# (tracebacks, hypothesis reading a test's source) are the page's
BLOCKS = [(found.group(1), "\n" * DOC.count("\n", 0, found.start(2)) + found.group(2))
          for found in re.finditer(r"^```(\w*)\n(.*?)^```", DOC, flags=re.S | re.M)]
COMMANDS = [line for lang, body in BLOCKS if lang == "sh" for line in body.splitlines()
            if line.startswith("ppdsl ")]


def test_the_page_has_commands_and_code():
    """The page shows at least three commands and two Python blocks."""
    assert len(COMMANDS) >= 3 and sum(lang == "python" for lang, _ in BLOCKS) >= 2


@pytest.mark.parametrize("line", COMMANDS)
def test_each_command_runs(line, monkeypatch, capsys):
    """Each command exits as the page says (0 unless marked `exit 1`)."""
    monkeypatch.chdir(ROOT)
    command, _, comment = line.partition("  #")
    code = main(shlex.split(command)[1:])
    out, err = capsys.readouterr()
    assert code == (1 if "exit 1" in comment else 0), out + err


def test_python_blocks_run():
    """The Python blocks run in order, sharing one namespace, without error."""
    namespace: dict = {}
    for lang, body in BLOCKS:
        if lang == "python":
            exec(compile(body, "docs/testing.md", "exec"), namespace)  # noqa: S102
