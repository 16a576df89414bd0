"""Write found orders as an ordinary `.pp` file in the order form.

Each device's order becomes one `if i == k { ... }` branch. Runs that repeat
with the microbatch index going up by one become loops, so a steady state reads
as `for j in 4..20 { F(j + 4); B(j); W(j) }`; what is left is written a line of
passes at a time. The file states its costs, memory model and the metrics the
search measured as `expect` clauses (rounded up, so `ppdsl check` passes), and
opens with the command that produced it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from ppdsl.ir.schedule import Costs, Pass
from ppdsl.search.problem import SearchProblem

__all__ = ["emit_pp", "compress"]

_MAX_GROUP = 8
_LINE_PASSES = 10

# (kind letter, microbatch, chunk)
Item = tuple[str, int, int]


def _item_text(item: Item, offset_from: int | None, v: int) -> str:
    kind, mb, chunk = item
    if offset_from is None:
        index = str(mb)
    else:
        delta = mb - offset_from
        index = "j" if delta == 0 else (f"j + {delta}" if delta > 0 else f"j - {-delta}")
    return f"{kind}({index})" if v == 1 else f"{kind}({index}, {chunk})"


def compress(items: Sequence[Item]) -> list[tuple[int, int, int]]:
    """Cover `items` with (start, group, repeats): items[start:start+group]
    repeated `repeats` times, each repetition the previous one with every
    microbatch + 1. Singles have group 1, repeats 1."""
    out = []
    p, n = 0, len(items)
    while p < n:
        best = (1, 1)
        for g in range(1, min(_MAX_GROUP, n - p) + 1):
            r = 1
            while p + (r + 1) * g <= n and all(
                items[p + r * g + k][0] == items[p + k][0]
                and items[p + r * g + k][2] == items[p + k][2]
                and items[p + r * g + k][1] == items[p + k][1] + r
                for k in range(g)
            ):
                r += 1
            if r >= 3 and g * r > best[0] * best[1]:
                best = (g, r)
        out.append((p, best[0], best[1]))
        p += best[0] * best[1]
    return out


def _device_lines(items: Sequence[Item], v: int, indent: str) -> list[str]:
    lines: list[str] = []
    singles: list[str] = []

    def flush() -> None:
        for k in range(0, len(singles), _LINE_PASSES):
            lines.append(indent + "; ".join(singles[k : k + _LINE_PASSES]))
        singles.clear()

    for start, group, repeats in compress(items):
        if repeats == 1:
            singles.append(_item_text(items[start], None, v))
            continue
        flush()
        head = items[start : start + group]
        base = min(mb for _, mb, _ in head)
        body = "; ".join(_item_text(x, base, v) for x in head)
        lines.append(f"{indent}for j in {base}..{base + repeats} {{ {body} }}")
    flush()
    return lines


def _num(x: float | Fraction) -> str:
    if isinstance(x, Fraction):
        return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"
    if float(x).is_integer():
        return str(int(x))
    return repr(float(x))


def _per_stage(values: Sequence) -> str:
    if len(set(values)) == 1:
        return _num(values[0])
    text = _num(values[-1])
    for s in range(len(values) - 2, -1, -1):
        text = f"s == {s} ? {_num(values[s])} : {text}"
    return text


def _cost_lines(costs: Costs) -> list[str]:
    lines = []
    for key, values in (
        ("F", costs.forward),
        ("B", costs.backward_input),
        ("W", costs.backward_weight),
    ):
        per = len(set(values)) > 1
        lines.append(f"cost {key}{'[s]' if per else ''} = {_per_stage(values)}")
    lines.append(f"cost comm = {_num(costs.comm)}")
    return lines


def _round_up(x: float, digits: int) -> str:
    scale = 10**digits
    value = math.ceil(x * scale - 1e-9) / scale
    if value < x:
        value += 1 / scale
    return f"{value:.{digits}f}"


def emit_pp(
    problem: SearchProblem,
    orders: Sequence[Sequence[Pass]],
    *,
    name: str,
    command: str,
    method: str,
    bubble: float,
    makespan: float,
    peak: Fraction,
    beats: str | None = None,
    notes: tuple[str, ...] = (),
) -> str:
    """The `.pp` text of `orders` (per device, in execution order); `notes` are
    more comment lines for the header."""
    pl = problem.placement
    v = problem.chunks_per_device
    chunk_of = {}
    for dev in range(pl.num_devices):
        for c, s in enumerate(pl.chunks(dev)):
            chunk_of[s] = c
    place = {"parallel": "parallel", "vshape": "vshape"}.get(pl.kind, f"looped({v})")
    mb = problem.memory.activation[0]
    mw = problem.memory.weight_retained[0]
    head = [
        f"# Found by: {command}",
        f"# Method: {method}.",
        f"# Measured: bubble {bubble:.4f}, makespan {makespan:g}, peak memory {_num(peak)} M_B"
        f" per device (budget {_num(problem.budget)}).",
        "# Memory is in units of one 1F1B stage's activation (M_B = 1/v for v chunks per device).",
    ]
    if beats:
        head.append(f"# {beats}")
    head += list(notes)
    body = [
        f"param d = {pl.num_devices}",
        f"param m = {problem.num_microbatches}",
        f"place {place}",
        "backward split",
        *_cost_lines(problem.costs),
        f"memory M_B = {_num(mb)}",
        f"memory M_W = {_num(mw)}",
        "order {",
    ]
    ind = "    "
    for dev, order in enumerate(orders):
        items = [(p.kind.value, p.microbatch, chunk_of[p.stage]) for p in order]
        if dev == 0:
            body.append(f"{ind}if i == 0 {{")
        elif dev < len(orders) - 1:
            body.append(f"{ind}}} else if i == {dev} {{")
        else:
            body.append(f"{ind}}} else {{")
        body += _device_lines(items, v, ind * 2)
    body.append(f"{ind}}}")
    body += [
        "}",
        f"expect peak_memory <= {_num(problem.budget)}",
        f"expect bubble <= {_round_up(bubble, 4)}",
        f"expect makespan <= {_round_up(makespan, 3)}",
    ]
    lines = head + [f"schedule {name} {{"] + [ind + x if x else x for x in body] + ["}"]
    return "\n".join(lines) + "\n"
