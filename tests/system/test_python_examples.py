"""The Python examples (docs/testing.md) run as their users run them: pytest on
examples/test_my_schedule.py and examples/test_torch_schedules.py passes, and
the torch table of docs/testing.md is what the example finds, row by row at
its first invalid instance and at sampled sizes."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_examples_pass_under_pytest():
    """`pytest examples/test_my_schedule.py examples/test_torch_schedules.py` exits 0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "examples/test_my_schedule.py", "examples/test_torch_schedules.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"\b[5-9]\d* passed|\b\d{2,} passed", result.stdout), result.stdout[-500:]


def test_docs_torch_table_matches_the_example():
    """Each class's row in docs/testing.md: its first invalid instance is invalid
    with that message, and a class listed with no invalid instance is valid or
    refused at pp=3, m=6 and pp=5, m=10."""
    pytest.importorskip("torch.distributed.pipelining.schedules")
    torch_example = _example("test_torch_schedules")
    doc = (ROOT / "docs" / "testing.md").read_text()
    rows = re.findall(r"^\| `(Schedule\w+)` \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (.*) \|$",
                      doc, flags=re.M)
    assert {r[0] for r in rows} == set(torch_example.CLASSES)
    for name, total, _valid, _refused, invalid, first in rows:
        assert int(total) == sum(3 * pp + 1 for pp in torch_example.PP_RANGE)
        if int(invalid):
            pp, m, why = re.match(r"pp=(\d+), m=(\d+): (.*)", first).groups()
            assert torch_example.find(name, int(pp), int(m)).verdict == why
        else:
            for pp, m in ((3, 6), (5, 10)):
                assert torch_example.find(name, pp, m).verdict in ("valid", "refused")
