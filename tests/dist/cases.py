"""The schedule cases the distributed tests run: every examples/*.pp that compiles
at the world size (its default m, which the examples set to a multiple of d), and
until the front end exists, schedules built in Python (tests/dist/orders.py)."""

from __future__ import annotations

import pickle
from pathlib import Path

from ppdsl.lower import lower
from tests.dist.orders import python_schedules

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _compile(path: Path, defines: dict[str, int]):
    from ppdsl.compiler import compile_file

    return compile_file(path, {k: str(v) for k, v in defines.items()})


def example_files() -> list[Path]:
    return sorted(EXAMPLES.glob("*.pp"))


def front_end_ready() -> bool:
    try:
        import ppdsl.compiler  # noqa: F401
        import ppdsl.parse  # noqa: F401
    except ImportError:
        return False
    return bool(example_files())


def build_cases(d: int, workdir: Path, *, check_grads: bool = True,
                only: list[str] | None = None,
                factory: str = "stages",
                release: str = "b") -> tuple[list[dict], dict[str, str]]:
    """(cases, skipped {name: reason}); each case's schedule is pickled into workdir."""
    workdir.mkdir(parents=True, exist_ok=True)
    cases: list[dict] = []
    skipped: dict[str, str] = {}
    found: list[tuple[str, object, object]] = []
    if front_end_ready():
        for path in example_files():
            if only is not None and path.stem not in only:
                continue
            try:
                compiled = _compile(path, {"d": d})
            except Exception as exc:  # an example not defined at this d
                skipped[path.stem] = f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            if compiled.schedule.num_devices != d:
                skipped[path.stem] = f"compiles to {compiled.schedule.num_devices} devices at d={d}"
                continue
            found.append((path.stem, compiled.schedule, compiled.programs))
    else:
        for s in python_schedules(d, 2 * d):
            if only is None or s.name in only:
                found.append((s.name, s, lower(s)))
    for name, schedule, programs in found:
        case_id = (f"{name}-d{d}" + ("" if factory == "stages" else f"-{factory}")
                   + ("" if release == "b" else f"-release-{release}"))
        pickle_path = workdir / f"{case_id}.pickle"
        pickle_path.write_bytes(pickle.dumps((schedule, programs, None)))
        cases.append({"id": case_id, "name": name, "d": d, "pickle": str(pickle_path),
                      "split": schedule.split_backward, "check_grads": check_grads,
                      "steps": 3, "m": schedule.num_microbatches, "factory": factory,
                      "release": release})
    return cases, skipped
