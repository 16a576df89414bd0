"""Code generation: rank programs -> one Python program per rank, a launcher that
picks the rank's program from torchrun's environment, and `manifest.json`.

Python decides, templates lay out. Nothing the user wrote reaches generated code
as code: numbers are formatted from ints checked to be ints, text appears only as
`repr` string literals or inside comments escaped with JSON rules (no newline can
end a comment early), and the manifest is written with `json`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from ppdsl import __version__
from ppdsl._resources import templates_dir
from ppdsl.backend.plan import Plan, plan_from_schedule
from ppdsl.ir.rank import Compute, Exchange, RankProgram, Transfer, TransferKind
from ppdsl.ir.schedule import Schedule

__all__ = ["GeneratedFiles", "generate", "write"]


def _int(x: object) -> str:
    if type(x) is not int:
        raise TypeError(f"codegen: expected an int, got {type(x).__name__} {x!r}")
    return str(x)


def _py(x: object) -> str:
    """A Python literal for a str or int: never code."""
    if isinstance(x, str):
        return repr(x)
    return _int(x)


def _comment(x: object) -> str:
    """Text safe inside a `#` comment: JSON escapes (control characters, quotes,
    non-ASCII) so nothing can start a new line."""
    return json.dumps(str(x), ensure_ascii=True)[1:-1]


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["py"] = _py
    env.filters["comment"] = _comment
    return env


def _transfer(t: Transfer) -> str:
    fn = "act" if t.kind is TransferKind.ACT else "grad"
    args = (t.microbatch, t.src_stage, t.dst_stage, t.src_rank, t.dst_rank)
    return f"{fn}({', '.join(map(_int, args))})"


def _op_lines(program: RankProgram) -> list[dict[str, str | None]]:
    lines: list[dict[str, str | None]] = []
    for op in program.ops:
        if isinstance(op, Compute):
            p = op.pass_
            where = f"{p.span.file}:{p.span.line}" if p.span is not None else None
            code = f"{p.kind.value}({_int(p.microbatch)}, {_int(p.stage)})"
            lines.append({"code": code, "where": where})
        elif isinstance(op, Exchange):
            sends = "".join(_transfer(t) + ", " for t in op.sends)
            recvs = "".join(_transfer(t) + ", " for t in op.recvs)
            code = f"exchange(sends=({sends.rstrip(' ')}), recvs=({recvs.rstrip(' ')}))"
            lines.append({"code": code, "where": None})
        else:  # pragma: no cover - the IR has two op kinds
            raise TypeError(f"codegen: unknown op {op!r}")
    return lines


@dataclass(frozen=True)
class GeneratedFiles:
    """File name -> text of everything `ppdsl compile` writes."""

    files: dict[str, str]
    plan: Plan


def generate(
    schedule: Schedule,
    programs: tuple[RankProgram, ...],
    timeline: Any = None,
    costs_from: str | None = None,
    dp: int = 1,
    dp_mode: str = "replicate",
) -> GeneratedFiles:
    """The files of `schedule` lowered to `programs` (`timeline`, a
    `ppdsl.analysis.simulate.Timeline`, adds the predicted busy shares and
    makespan; `costs_from` names the `--costs-from` file its costs came from;
    `dp`, `dp_mode`: the data-parallel replicas the launcher starts by default)."""
    plan = plan_from_schedule(schedule, programs, timeline, costs_from)
    env = _environment()
    files: dict[str, str] = {}
    common = {
        "version": __version__,
        "source": schedule.file,
        "name": schedule.name,
        "num_ranks": _int(schedule.num_devices),
        "fingerprint": plan.fingerprint,
        "num_microbatches": _int(schedule.num_microbatches),
    }
    rank_template = env.get_template("rank.py.j2")
    for program in programs:
        stages = ", ".join(_int(s) for s in schedule.placement.chunks(program.rank))
        ops = _op_lines(program)
        used = {str(op["code"]).split("(", 1)[0] for op in ops}
        used |= {k for op in ops for k in ("act", "grad") if f"{k}(" in str(op["code"])}
        files[f"rank{_int(program.rank)}.py"] = rank_template.render(
            **common, rank=_int(program.rank), stages=stages, ops=ops,
            vocabulary=", ".join(sorted(used)) or "F",
        )
    files["launch.py"] = env.get_template("launch.py.j2").render(
        **common, dp=_int(dp), num_processes=_int(dp * schedule.num_devices))
    manifest = plan.to_json()
    manifest["generated_by"] = f"ppdsl {__version__}"
    manifest["placement_kind"] = schedule.placement.kind
    manifest["data_parallel"] = {"dp": dp, "mode": dp_mode}
    files["manifest.json"] = json.dumps(manifest, indent=1, ensure_ascii=True) + "\n"
    return GeneratedFiles(files, plan)


def write(generated: GeneratedFiles, out_dir: str | Path) -> list[Path]:
    """Write the files into `out_dir` (created if needed); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in generated.files.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths
