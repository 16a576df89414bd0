"""The schedule cases the distributed tests run: every examples/*.pp at the world
size (its default m, which the examples set to a multiple of d)."""

from __future__ import annotations

import pickle
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _compile(path: Path, defines: dict[str, int]):
    from ppdsl.compiler import compile_file

    return compile_file(path, {k: str(v) for k, v in defines.items()})


def example_files() -> list[Path]:
    return sorted(EXAMPLES.glob("*.pp"))


def build_cases(d: int, workdir: Path, *, check_grads: bool = True,
                only: list[str] | None = None,
                factory: str = "stages",
                release: str = "at-b",
                pipelines: int = 1,
                paths: list[Path] | None = None) -> list[dict]:
    """The cases for world size d * pipelines (each pipeline of d ranks in its own
    process group); each case's schedule is pickled into workdir. An example
    that does not compile at d raises: nothing is skipped. `paths`: other .pp
    files than examples/*.pp."""
    workdir.mkdir(parents=True, exist_ok=True)
    cases: list[dict] = []
    found: list[tuple[str, object, object]] = []
    for path in example_files() if paths is None else paths:
        if only is not None and path.stem not in only:
            continue
        compiled = _compile(path, {"d": d})
        assert compiled.schedule.num_devices == d, (path, compiled.schedule.num_devices)
        found.append((path.stem, compiled.schedule, compiled.programs))
    for name, schedule, programs in found:
        case_id = (f"{name}-d{d}" + ("" if factory == "stages" else f"-{factory}")
                   + ("" if release == "at-b" else f"-release-{release}")
                   + ("" if pipelines == 1 else f"-x{pipelines}"))
        pickle_path = workdir / f"{case_id}.pickle"
        pickle_path.write_bytes(pickle.dumps((schedule, programs, None)))
        cases.append({"id": case_id, "name": name, "d": d, "pickle": str(pickle_path),
                      "split": schedule.split_backward, "check_grads": check_grads,
                      "steps": 3, "m": schedule.num_microbatches, "factory": factory,
                      "release": release, "pipelines": pipelines})
    return cases
