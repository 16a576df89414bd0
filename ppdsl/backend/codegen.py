"""Code generation: rank programs -> one Python program per rank, a launcher that
picks the rank's program from torchrun's environment, and `manifest.json`.

Python decides, templates lay out. Nothing the user wrote reaches generated code
as code: numbers are formatted from ints checked to be ints, text appears only as
`repr` string literals or inside comments escaped with JSON rules (no newline can
end a comment early), and the manifest is written with `json`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from ppdsl import __version__, json_text
from ppdsl._resources import templates_dir
from ppdsl.backend.plan import Plan, plan_from_schedule
from ppdsl.ir.rank import (
    RankArrays,
    RankProgram,
    TransferKind,
    entry_groups,
)
from ppdsl.ir.schedule import PassOrder, Schedule
from ppdsl.semantics import KINDS

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


@lru_cache(maxsize=4096)
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


def _line(code: str, where: str | None) -> str:
    """One line of OPS: the op's call and, where known, its source line."""
    return f"    {code},  # {_comment(where)}\n" if where else f"    {code},\n"


def _ops_texts(programs: RankArrays) -> Iterator[tuple[str, set[str]]]:
    """Per rank, the body of its program's OPS tuple (made here, not by the
    template: 700k lines at scale) and the program vocabulary it calls, from
    the arrays (no op objects made), rank by rank: a rank's lines are made from
    its slice of the arrays only."""
    call = {t.code: t.value for t in TransferKind}
    first = entry_groups(programs)
    # an exchange's entries are its sends, then its receives
    sends_of = np.bincount(programs.where[programs.sending], minlength=programs.total)
    offsets = programs.offsets.tolist()
    columns = PassOrder.of(programs.passes)  # its ints checked where made of Pass objects
    letters = [k.value for k in KINDS]  # by code
    # a pass line's end, per span: its source line as a comment (`_line`)
    ends = [_line("", f"{span.file}:{span.line}")[4:] if span is not None else ",\n"
            for span in columns.spans]
    op_rank = np.repeat(np.arange(programs.num_ranks), np.diff(programs.offsets))
    exchanges = np.bincount(op_rank[programs.op_pass < 0], minlength=programs.num_ranks).tolist()
    carried: list[set[int]] = [set() for _ in range(programs.num_ranks)]
    width = int(programs.transfer.max(initial=0)) + 1
    for pair in np.unique(op_rank[programs.where] * width + programs.transfer).tolist():
        carried[pair // width].add(pair % width)
    del op_rank
    for r in range(programs.num_ranks):
        a, b = offsets[r], offsets[r + 1]
        # this rank's entry groups, relative to its first entry
        groups = first[a : b + 1].tolist()
        lo, hi = groups[0], groups[-1]
        groups = [x - lo for x in groups]
        texts = [
            f"{call[k]}({j}, {s}, {d}, {ra}, {rb}), "
            for k, j, s, d, ra, rb in zip(
                programs.transfer[lo:hi].tolist(),
                programs.microbatch[lo:hi].tolist(),
                programs.src_stage[lo:hi].tolist(),
                programs.dst_stage[lo:hi].tolist(),
                programs.src_rank[lo:hi].tolist(),
                programs.dst_rank[lo:hi].tolist(),
                strict=True,
            )
        ]
        sends = sends_of[a:b].tolist()
        # this rank's pass lines, from its passes' columns only
        op_pass = programs.op_pass[a:b]
        chosen = op_pass[op_pass >= 0]
        kinds = columns.kind[chosen]
        used = {letters[code] for code in np.unique(kinds).tolist()}
        pass_lines = iter([
            f"    {k}({j}, {s}){e}"
            for k, j, s, e in zip(
                map(letters.__getitem__, kinds.tolist()),
                columns.microbatch[chosen].tolist(),
                columns.stage[chosen].tolist(),
                map(ends.__getitem__, columns.span_index[chosen].tolist()),
                strict=True,
            )
        ])
        lines: list[str] = []
        for g, k in enumerate(op_pass.tolist()):
            if k >= 0:
                lines.append(next(pass_lines))
            else:
                x, y = groups[g], groups[g + 1]
                m = x + sends[g]
                lines.append(
                    f"    exchange(sends=({''.join(texts[x:m]).rstrip(' ')}), "
                    f"recvs=({''.join(texts[m:y]).rstrip(' ')})),\n"
                )
        if exchanges[r]:
            used.add("exchange")
        used.update(call[code] for code in carried[r])
        yield "".join(lines), used


class GeneratedFiles:
    """What `ppdsl compile` writes: file name -> text. The texts are made one file
    at a time as `items` is iterated (at scale the rank programs are hundreds of
    MB: `write` never holds them all); `files` makes and keeps them all."""

    def __init__(self, names: tuple[str, ...], render: Callable[[], Iterator[tuple[str, str]]],
                 plan: Plan):
        self.names = names
        """The files, in the order `items` makes them."""
        self.plan = plan
        self._render = render
        self._files: dict[str, str] | None = None

    def items(self) -> Iterator[tuple[str, str]]:
        """(name, text) of every file, each made as it is reached."""
        if self._files is not None:
            yield from self._files.items()
            return
        yield from self._render()

    @property
    def files(self) -> dict[str, str]:
        """Every file's text (made once, then kept)."""
        if self._files is None:
            self._files = dict(self._render())
        return self._files


def generate(
    schedule: Schedule,
    programs: tuple[RankProgram, ...] | RankArrays,
    timeline: Any = None,
    costs_from: str | None = None,
    dp: int = 1,
    dp_mode: str = "replicate",
) -> GeneratedFiles:
    """The files of `schedule` lowered to `programs` (`timeline`, a
    `ppdsl.analysis.simulate.Timeline`, adds the predicted busy shares and
    makespan; `costs_from` names the `--costs-from` file its costs came from;
    `dp`, `dp_mode`: the data-parallel replicas the launcher starts by default)."""
    arrays = programs if isinstance(programs, RankArrays) else RankArrays.of_programs(programs)
    plan = plan_from_schedule(schedule, arrays, timeline, costs_from)
    env = _environment()
    common = {
        "version": __version__,
        "source": schedule.file,
        "name": schedule.name,
        "num_ranks": _int(schedule.num_devices),
        "fingerprint": plan.fingerprint,
        "num_microbatches": _int(schedule.num_microbatches),
    }

    def render() -> Iterator[tuple[str, str]]:
        rank_template = env.get_template("rank.py.j2")
        per_rank = enumerate(_ops_texts(arrays))
        for rank, (ops, used) in per_rank:
            stages = ", ".join(_int(s) for s in schedule.placement.chunks(rank))
            yield f"rank{_int(rank)}.py", rank_template.render(
                **common, rank=_int(rank), stages=stages, ops=ops,
                vocabulary=", ".join(sorted(used)) or "F",
            )
            del ops
        yield "launch.py", env.get_template("launch.py.j2").render(
            **common, dp=_int(dp), num_processes=_int(dp * schedule.num_devices))
        manifest = plan.to_json(deferred=True)
        manifest["generated_by"] = f"ppdsl {__version__}"
        manifest["placement_kind"] = schedule.placement.kind
        manifest["data_parallel"] = {"dp": dp, "mode": dp_mode}
        yield "manifest.json", json_text.dumps(manifest, 1) + "\n"

    names = (*(f"rank{r}.py" for r in range(arrays.num_ranks)), "launch.py", "manifest.json")
    return GeneratedFiles(names, render, plan)


def write(
    generated: GeneratedFiles,
    out_dir: str | Path,
    phase: Callable[[str], None] = lambda name: None,
) -> list[Path]:
    """Write the files into `out_dir` (created if needed); returns their paths.
    `phase` is told how many are written as they are (the progress of a long
    compile)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    total = len(generated.names)
    phase(f"codegen: 0 of {total} files written")
    for name, text in generated.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
        phase(f"codegen: {len(paths)} of {total} files written")
    return paths
