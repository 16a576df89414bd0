"""A schedule checked as a family: every instance of parameter ranges
(`ppdsl check FILE --for d=2..16 --for m=d..4*d`), or a seeded sample of them.

A range is `NAME=LOW..HIGH` (both ends included, unlike the language's `0..n`,
which stops before n) or `NAME=A,B,C`; its ends are expressions in the names of
the ranges before it. Instances are enumerated in order (the first range
slowest), so the first invalid one is the smallest in that order: every
instance before it was checked and found valid. `--samples N` draws N
instances with hypothesis from a seed instead, and shrinks a failure: first by
hypothesis' own shrinker, then by lowering each parameter in turn to the
smallest value in its range that still fails (`shrink`).

An instance a file's `require` statement rules out lies outside the family the
file defines: it is counted as skipped, not as a failure.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ppdsl import limits
from ppdsl.compiler import compile_schedule
from ppdsl.costs_file import CostsFile, schedule_with_costs
from ppdsl.diagnostics import CompileError, Diagnostic, register_source
from ppdsl.frontend import ast
from ppdsl.frontend.elaborate import elaborate
from ppdsl.frontend.expressions import ElaborationError, Scope, compile_exact
from ppdsl.frontend.parse import parse, parse_expression

__all__ = [
    "ParamRange",
    "Outcome",
    "Failure",
    "SweepResult",
    "FamilyFile",
    "parse_range",
    "parse_ranges",
    "instances",
    "count_instances",
    "sweep",
    "shrink",
    "format_params",
    "progress_reporter",
    "unknown_params",
]

Params = dict[str, int]
MAX_ENUMERATED = 100_000
"""More instances than this are refused without `--samples` (they would take hours)."""
_SHRINK_TRIES = 256
"""At most this many smaller values are tried per parameter while shrinking."""


@dataclass(frozen=True)
class ParamRange:
    """One `--for NAME=...`: the values of a param, given the values of the ranges before it."""

    name: str
    """The param it ranges over."""
    text: str
    """The range as written (`d..4*d`)."""
    bounds: tuple[Callable[[dict], object], ...]
    """`(low, high)` for `LOW..HIGH`, or one closure per listed value."""
    inclusive_range: bool
    """True for `LOW..HIGH`, False for a list `A,B,C`."""

    def values(self, env: Params) -> Sequence[int]:
        """The values under the earlier ranges' `env`; a bound that is no integer
        is a ValueError naming this range."""
        ends = [self._integer(bound, env) for bound in self.bounds]
        if self.inclusive_range:
            return range(ends[0], ends[1] + 1)
        return tuple(ends)

    def _integer(self, bound: Callable[[dict], object], env: Params) -> int:
        try:
            value = bound(dict(env))
        except ElaborationError as exc:
            raise ValueError(f"--for {self.name}={self.text}: {exc}") from None
        if isinstance(value, bool) or type(value) is not int:
            where = ", ".join(f"{k}={v}" for k, v in env.items())
            raise ValueError(
                f"--for {self.name}={self.text}: a bound is {value}, not an integer"
                + (f" (at {where})" if where else "")
            )
        return value


def parse_range(text: str, earlier: Sequence[str]) -> ParamRange:
    """`NAME=LOW..HIGH` or `NAME=A,B,...`, its expressions over the names in
    `earlier`; a ValueError with a message for the command line otherwise."""
    name, eq, body = text.partition("=")
    name, body = name.strip(), body.strip()
    if not eq or not name.isidentifier() or not body:
        raise ValueError(f"--for {text!r}: expected NAME=LOW..HIGH (e.g. --for m=d..4*d) or NAME=A,B")
    if name in earlier:
        raise ValueError(f"--for {name} is given twice")
    inclusive = ".." in body
    parts = body.split("..") if inclusive else body.split(",")
    if inclusive and len(parts) != 2:
        raise ValueError(f"--for {text!r}: expected one '..' between LOW and HIGH")
    scope = Scope(earlier)
    bounds = []
    for part in parts:
        try:
            expr = parse_expression(part.strip(), f"--for {name}")
            bounds.append(compile_exact(expr, scope))
        except CompileError as exc:
            why = exc.diagnostics[0].message if exc.diagnostics else "not an expression"
            raise ValueError(f"--for {text!r}: {part.strip()!r}: {why}") from None
        except ElaborationError as exc:
            known = ", ".join(earlier) or "none yet"
            raise ValueError(f"--for {text!r}: {exc} (ranges before it: {known})") from None
    return ParamRange(name, body, tuple(bounds), inclusive)


def parse_ranges(texts: Sequence[str]) -> tuple[ParamRange, ...]:
    """Every `--for`, each over the names of those before it."""
    ranges: list[ParamRange] = []
    for text in texts:
        ranges.append(parse_range(text, [r.name for r in ranges]))
    return tuple(ranges)


def instances(ranges: Sequence[ParamRange]) -> Iterator[Params]:
    """Every instance in order, the first range slowest."""

    def walk(k: int, env: Params) -> Iterator[Params]:
        if k == len(ranges):
            yield dict(env)
            return
        for value in ranges[k].values(env):
            env[ranges[k].name] = value
            yield from walk(k + 1, env)
        env.pop(ranges[k].name, None)

    yield from walk(0, {})


def count_instances(ranges: Sequence[ParamRange], cap: int = MAX_ENUMERATED) -> int:
    """How many instances there are, counted up to just past `cap` (the last
    range counted by its length, not value by value)."""
    if not ranges:
        return 1
    total = 0
    for env in instances(ranges[:-1]):
        total += len(ranges[-1].values(env))
        if total > cap:
            break
    return total


def format_params(params: Params) -> str:
    """`d=12 m=13`."""
    return " ".join(f"{k}={v}" for k, v in params.items())


@dataclass(frozen=True)
class Outcome:
    """What checking one instance found."""

    diagnostics: tuple[Diagnostic, ...] = ()
    """Its errors (empty: valid)."""
    skipped: bool = False
    """A `require` rules it out: outside the family."""

    @property
    def failed(self) -> bool:
        """True when the instance is invalid."""
        return bool(self.diagnostics) and not self.skipped


@dataclass(frozen=True)
class Failure:
    """The smallest invalid instance found, with its located errors."""

    params: Params
    diagnostics: tuple[Diagnostic, ...]
    found: Params
    """The instance that failed first, before shrinking."""


@dataclass
class SweepResult:
    """A family's check: how many instances, how long, and the failure if any."""

    mode: str
    """"enumerate" or "sample"."""
    total: int
    """Instances in the ranges."""
    checked: int = 0
    """Instances checked (shrinking's included), each once."""
    skipped: int = 0
    """Checked instances a `require` rules out."""
    seconds: float = 0.0
    seed: int | None = None
    failure: Failure | None = None
    outcomes: dict[tuple, Outcome] = field(default_factory=dict, repr=False)


class _Progress:
    """`ppdsl: FILE: 312/1612 instances (d=12 m=40), 9 s` on stderr every few
    seconds, on a terminal or with PPDSL_PROGRESS=1 (PPDSL_PROGRESS=0 silences it)."""

    def __init__(self, label: str, stream: TextIO, every: float = 2.0):
        forced = os.environ.get("PPDSL_PROGRESS")
        self.enabled = forced not in ("", "0") if forced is not None else stream.isatty()
        self.label, self.stream, self.every = label, stream, every
        self.start = time.monotonic()
        self.last = self.start

    def __call__(self, done: int, total: int, params: Params) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.last < self.every:
            return
        self.last = now
        print(f"ppdsl: {self.label}: {done}/{total} instances ({format_params(params)}), "
              f"{now - self.start:.0f} s", file=self.stream, flush=True)


def sweep(
    check: Callable[[Params], Outcome],
    ranges: Sequence[ParamRange],
    *,
    samples: int | None = None,
    seed: int = 0,
    progress: Callable[[int, int, Params], None] | None = None,
    map_checks: Callable[[Iterable[Params]], Iterator[Outcome]] | None = None,
) -> SweepResult:
    """Check the family: every instance in order, stopping at the first invalid
    one; or, with `samples`, that many drawn by hypothesis from `seed` (every
    instance when there are no more than that), the failure shrunk.
    `map_checks` checks the enumerated instances in order, as `check` would, but
    elsewhere (`FamilyFile.parallel`'s processes)."""
    start = time.monotonic()
    total = count_instances(ranges)
    result = SweepResult("enumerate", total, seed=None)

    def run(params: Params) -> Outcome:
        key = tuple(params.items())
        if key not in result.outcomes:
            outcome = check(params)
            result.outcomes[key] = outcome
            result.checked += 1
            result.skipped += outcome.skipped
            if progress is not None:
                progress(result.checked, total, params)
        return result.outcomes[key]

    if samples is None or total <= samples:
        ordered = instances(ranges)
        if map_checks is not None:
            ordered = _recorded(ordered, map_checks, result, total, progress)
        for params in ordered:
            if run(params).failed:
                result.failure = Failure(params, run(params).diagnostics, params)
                break
    else:
        result.mode, result.seed = "sample", seed
        found = _sample(run, ranges, samples, seed)
        if found is not None:
            smallest = shrink(lambda p: run(p).failed, ranges, found)
            result.failure = Failure(smallest, run(smallest).diagnostics, found)
    result.seconds = time.monotonic() - start
    return result


def _recorded(
    ordered: Iterator[Params],
    map_checks: Callable[[Iterable[Params]], Iterator[Outcome]],
    result: SweepResult,
    total: int,
    progress: Callable[[int, int, Params], None] | None,
) -> Iterator[Params]:
    """The instances in order, each outcome computed by `map_checks` and recorded
    in `result` before the instance is yielded."""
    pending: list[Params] = []

    def remember(params_iter: Iterator[Params]) -> Iterator[Params]:
        for params in params_iter:
            pending.append(params)
            yield params

    for outcome in map_checks(remember(ordered)):
        params = pending.pop(0)
        result.outcomes[tuple(params.items())] = outcome
        result.checked += 1
        result.skipped += outcome.skipped
        if progress is not None:
            progress(result.checked, total, params)
        yield params


def _sample(
    run: Callable[[Params], Outcome], ranges: Sequence[ParamRange], samples: int, seed: int
) -> Params | None:
    """Up to `samples` instances drawn by hypothesis from `seed`; the first
    invalid one as hypothesis shrinks it, or None."""
    import random

    from hypothesis import HealthCheck, Phase, find, reject, settings
    from hypothesis import strategies as st
    from hypothesis.errors import NoSuchExample

    @st.composite
    def draw_params(draw) -> Params:
        params: Params = {}
        for r in ranges:
            values = r.values(params)
            if not values:
                reject()
            params[r.name] = draw(st.sampled_from(values)) if not isinstance(values, range) \
                else draw(st.integers(values.start, values.stop - 1))
        return params

    config = settings(
        max_examples=samples, database=None, deadline=None, derandomize=False,
        suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink],
    )
    try:
        return find(draw_params(), lambda p: run(p).failed, settings=config,
                    random=random.Random(seed))
    except NoSuchExample:
        return None


def shrink(
    fails: Callable[[Params], bool], ranges: Sequence[ParamRange], params: Params
) -> Params:
    """A failing instance made smaller one parameter at a time: each takes the
    smallest value of its range (under the earlier ones) that still fails, the
    later ones kept where their ranges allow and moved to the nearest end
    where not; repeated until no parameter can go lower."""
    current = dict(params)
    improved = True
    while improved:
        improved = False
        for k, r in enumerate(ranges):
            earlier = {x.name: current[x.name] for x in ranges[:k]}
            smaller = [v for v in r.values(earlier) if v < current[r.name]][:_SHRINK_TRIES]
            for value in smaller:
                candidate = _refit(ranges, {**current, r.name: value}, k)
                if candidate is not None and fails(candidate):
                    current, improved = candidate, True
                    break
            if improved:
                break
    return current


def _refit(ranges: Sequence[ParamRange], params: Params, changed: int) -> Params | None:
    """`params` with every range after `changed` moved into its range (to the
    nearest value), or None when a range is empty there."""
    out = dict(params)
    for r in ranges[changed + 1:]:
        values = r.values({x.name: out[x.name] for x in ranges[: ranges.index(r)]})
        if not values:
            return None
        if out[r.name] not in values:
            out[r.name] = min(values, key=lambda v: (abs(v - out[r.name]), v))
    return out


class FamilyFile:
    """A `.pp` file read and parsed once, compiled per instance (`check`)."""

    def __init__(
        self,
        path: str | Path,
        fixed: dict[str, str] | None = None,
        *,
        early_receives: bool = True,
        costs: CostsFile | None = None,
        comm_model: str = "rendezvous",
    ):
        self.file = str(path)
        text = Path(path).read_text(encoding="utf-8")
        limits.check_source(len(text.encode("utf-8", "surrogatepass")), self.file)
        text = text.removeprefix("\ufeff")
        register_source(self.file, text)
        self.module = parse(text, self.file)
        self.fixed = dict(fixed or {})
        self.early_receives = early_receives
        self.costs = costs
        self.comm_model = comm_model
        self._requires = {s.span for s in self.module.stmts if isinstance(s, ast.Require)}

    def parallel(self, jobs: int) -> Callable[[Iterable[Params]], Iterator[Outcome]]:
        """`sweep`'s `map_checks` over `jobs` forked processes, each holding this
        file: outcomes in the instances' order; the processes end when the
        caller stops reading (the first invalid instance)."""
        import multiprocessing

        def map_checks(ordered: Iterable[Params]) -> Iterator[Outcome]:
            context = multiprocessing.get_context("fork")
            with context.Pool(jobs, initializer=_adopt, initargs=(self,)) as pool:
                yield from pool.imap(_check_adopted, ordered, chunksize=2)

        return map_checks

    @property
    def param_names(self) -> list[str]:
        """The file's params, in order."""
        return [s.name for s in self.module.stmts if isinstance(s, ast.Param)]

    def check(self, params: Params) -> Outcome:
        """Compile one instance: its errors, or skipped when a `require` fails."""
        overrides = {**self.fixed, **{k: str(v) for k, v in params.items()}}
        try:
            with limits.using(limits.active()):
                if self.costs is None:
                    schedule = elaborate(self.module, overrides)
                    compile_schedule(schedule, early_receives=self.early_receives,
                                     comm_model=self.comm_model)
                else:
                    schedule, expects = schedule_with_costs(self.module, overrides, self.costs)
                    compile_schedule(schedule, early_receives=self.early_receives,
                                     warn_unbounded=False, comm_model=self.comm_model)
        except CompileError as err:
            errors = tuple(d for d in err.diagnostics if d.severity == "error")
            outside = len(errors) == 1 and errors[0].span in self._requires
            return Outcome(errors, skipped=outside)
        return Outcome()


_ADOPTED: list[FamilyFile] = []


def _adopt(family: FamilyFile) -> None:
    _ADOPTED.append(family)


def _check_adopted(params: Params) -> Outcome:
    return _ADOPTED[0].check(params)


def progress_reporter(label: str, stream: TextIO | None = None) -> _Progress:
    """The progress line of a long sweep (see `_Progress`)."""
    return _Progress(label, stream or sys.stderr)


def unknown_params(family: FamilyFile, ranges: Sequence[ParamRange]) -> list[str]:
    """Messages for ranges over names that are not params of the file, or that `-D` also sets."""
    names = family.param_names
    found = []
    for r in ranges:
        if r.name in family.fixed:
            found.append(f"--for {r.name}: -D {r.name} also sets it; give one")
        elif r.name not in names:
            found.append(f"--for {r.name}: no param '{r.name}' in {family.file} "
                         f"(params: {', '.join(names) or 'none'})")
    return found

