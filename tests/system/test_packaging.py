"""The built wheel carries grammar/ and codegen/ and works when installed
without the checkout (a non-editable install into a fresh folder).

Neither test needs the network: the wheel is built without build isolation when
setuptools is importable, and installed with `--no-deps --target`, so the
interpreter running the suite (system, venv or conda) supplies torch, lark and
numba. (A `venv --system-site-packages` would inherit the *base* interpreter's
packages, not those of a venv the suite runs in.)"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _builders() -> list[str]:
    """Interpreters that may build the wheel: the suite's own, then (in a venv,
    whose own setuptools may be too old to build wheels, as Python 3.11's seeded
    65.5 without `wheel` is) the base interpreter it was made from."""
    found = [sys.executable]
    base = getattr(sys, "_base_executable", None)
    if base and sys.prefix != sys.base_prefix:  # a venv (its python may link to the base's)
        found.append(base)
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    failures = []
    for python in _builders():
        has_setuptools = subprocess.run(
            [python, "-c", "import setuptools"], capture_output=True
        ).returncode == 0
        isolation = ["--no-build-isolation"] if has_setuptools else []
        done = subprocess.run(
            [python, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
             "-w", str(out), str(ROOT)],
            capture_output=True, text=True,
        )
        if done.returncode == 0:
            break
        failures.append(f"{python}: {done.stderr[-2000:]}")
    else:
        pytest.fail("no interpreter could build the wheel:\n" + "\n".join(failures))
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
def test_wheel_ships_every_module_and_py_typed(wheel: Path) -> None:
    """Every module of the checkout's ppdsl/ is in the wheel (its packages are
    found, not listed by hand), and so is the py.typed marker."""
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "ppdsl").rglob("*.py")}
    assert modules and modules <= names, sorted(modules - names)
    assert "ppdsl/py.typed" in names


@pytest.mark.slow
def test_installed_wheel_checks_an_example(wheel: Path, tmp_path: Path) -> None:
    """The installed wheel's `ppdsl check`, run outside the checkout by the suite's own
    interpreter, imports the installed ppdsl (not the checkout) and accepts an example."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--target", str(target), str(wheel)],
        check=True, capture_output=True, text=True,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    where = subprocess.run(
        [sys.executable, "-c",
         "import ppdsl, ppdsl._resources as r; print(ppdsl.__file__); print(r.templates_dir())"],
        cwd=tmp_path, env=env, check=True, capture_output=True, text=True,
    ).stdout.split()
    assert all(str(target) in w for w in where), where
    example = tmp_path / "zb_h1.pp"
    example.write_text((ROOT / "examples" / "zb_h1.pp").read_text())
    done = subprocess.run(
        [sys.executable, "-m", "ppdsl", "check", str(example), "-D", "d=4", "-D", "m=8"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "ok" in done.stdout
    script = target / "bin" / "ppdsl"
    assert script.is_file(), "the wheel installs no ppdsl console script"


@pytest.mark.slow
def test_installed_wheel_plans_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    """The wheel installed into a fresh venv (system site packages for torch and
    transformers) plans a config-only model outside the checkout: its candidate
    schedules ship in the package (`ppdsl._schedules`), not beside it."""
    pytest.importorskip("transformers")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, capture_output=True)
    python = venv / "bin" / "python"
    target = tmp_path / "site"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(target), str(wheel)], check=True, capture_output=True)
    names = zipfile.ZipFile(wheel).namelist()
    assert "ppdsl/_schedules/1f1b.pp" in names
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        (ROOT / "examples" / "models" / "tiny_llama" / "config.json").read_text())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)  # the suite's own site packages come from the venv's base
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    done = subprocess.run(
        [str(python), "-m", "ppdsl", "plan", "--model", f"hf:{model}", "--devices", "2",
         "--microbatches", "4", "--seq-len", "32", "--microbatch-size", "1", "--memory",
         "1GiB", "--gpu", "a100", "--schedules", "1f1b,zb_h1", "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"schedule"' in done.stdout and '"peak_bytes"' in done.stdout
    where = subprocess.run([str(python), "-c", "import ppdsl; print(ppdsl.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True).stdout
    assert str(target) in where
