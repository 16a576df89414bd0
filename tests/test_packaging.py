"""The built wheel carries grammar/ and codegen/ and works when installed
without the checkout (a non-editable install into a fresh virtual environment)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
         "-w", str(out), str(ROOT)],
        check=True, capture_output=True, text=True,
    )
    (path,) = out.glob("ppdsl-*.whl")
    return path


@pytest.mark.slow
def test_wheel_ships_grammar_and_templates(wheel: Path) -> None:
    """The wheel contains the grammar file and every codegen template."""
    names = zipfile.ZipFile(wheel).namelist()
    assert "ppdsl/_grammar/ppdsl.lark" in names
    templates = sorted(p.name for p in (ROOT / "codegen").glob("*.j2"))
    assert templates, "codegen/ has no templates"
    for name in templates:
        assert f"ppdsl/_templates/{name}" in names


@pytest.mark.slow
def test_installed_wheel_checks_an_example(wheel: Path, tmp_path: Path) -> None:
    """`ppdsl check` from a fresh venv, run outside the checkout, accepts an example."""
    venv = tmp_path / "venv"
    # System site packages provide torch/lark/numba without a download; the wheel's
    # own ppdsl is installed into the venv and must be the one imported.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    where = subprocess.run(
        [str(py), "-c", "import ppdsl, ppdsl._resources as r; print(ppdsl.__file__); print(r.templates_dir())"],
        cwd=tmp_path, check=True, capture_output=True, text=True,
    ).stdout.split()
    assert all(str(venv) in w for w in where), where
    example = tmp_path / "zb_h1.pp"
    example.write_text((ROOT / "examples" / "zb_h1.pp").read_text())
    done = subprocess.run(
        [str(venv / "bin" / "ppdsl"), "check", str(example), "-D", "d=4", "-D", "m=8"],
        cwd=tmp_path, capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "ok" in done.stdout
