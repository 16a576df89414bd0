"""The frontier as an SVG figure: bubble (or step time) against peak memory per
device, one colour per placement, the frontier as a staircase, every searched
level as a dot, the papers' named schedules as labelled diamonds.

Plain text, numbers to two decimals: the same frontier writes the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from ppdsl.search.frontier import Frontier, NamedPoint
from ppdsl.semantics import format_short

__all__ = ["frontier_svg"]

_WIDTH, _HEIGHT = 760, 460
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 190, 40, 60
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _nice_top(value: float) -> float:
    """The axis' top: `value` rounded up to 1, 2 or 5 times a power of ten."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    for k in (1, 2, 5, 10):
        if k * power >= value - 1e-12:
            return k * power
    return 10 * power  # pragma: no cover - 10 covers every value


def frontier_svg(frontier: Frontier, named: Sequence[NamedPoint] = (), *, title: str = "") -> str:
    """The standalone SVG document of `frontier` and the `named` schedules."""
    # step: the makespan, plus the exposed data-parallel reductions under --dp
    y_of_point = (lambda p: p.step) if frontier.objective == "makespan" else (lambda p: p.bubble)
    y_label = "step time" if frontier.objective == "makespan" else "bubble"
    points = list(frontier.searched)
    xs = [float(p.memory) for p in points] + [float(n.memory) for n in named]
    ys = [y_of_point(p) for p in points] + [y_of_point(n) for n in named]
    x_top = _nice_top(max(xs, default=1.0) * 1.05)
    y_top = _nice_top(max(ys, default=1.0) * 1.1)
    plot_w = _WIDTH - _LEFT - _RIGHT
    plot_h = _HEIGHT - _TOP - _BOTTOM

    def sx(x: float) -> float:
        return _LEFT + plot_w * x / x_top

    def sy(y: float) -> float:
        return _TOP + plot_h * (1 - y / y_top)

    placements = list(dict.fromkeys(p.placement for p in points))
    placements += [n.placement for n in named if n.placement not in placements]
    colour = {name: _COLOURS[k % len(_COLOURS)] for k, name in enumerate(placements)}
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
        f'viewBox="0 0 {_WIDTH} {_HEIGHT}" font-family="sans-serif" font-size="11">',
        f'<rect width="{_WIDTH}" height="{_HEIGHT}" fill="white"/>',
    ]
    if title:
        out.append(f'<text x="{_LEFT}" y="22" font-size="13">{escape(title)}</text>')
    # axes and ticks
    out.append(
        f'<path d="M{_LEFT},{_TOP} V{_TOP + plot_h} H{_LEFT + plot_w}" fill="none" stroke="black"/>'
    )
    for k in range(6):
        x = x_top * k / 5
        y = y_top * k / 5
        out.append(
            f'<text x="{sx(x):.2f}" y="{_TOP + plot_h + 16}" text-anchor="middle">'
            f"{format_short(round(x, 6), 4)}</text>"
        )
        out.append(
            f'<text x="{_LEFT - 6}" y="{sy(y) + 4:.2f}" text-anchor="end">'
            f"{format_short(round(y, 6), 4)}</text>"
        )
        out.append(
            f'<line x1="{_LEFT}" y1="{sy(y):.2f}" x2="{_LEFT + plot_w}" y2="{sy(y):.2f}" '
            'stroke="#e6e6e6"/>'
        )
    out.append(
        f'<text x="{_LEFT + plot_w / 2:.2f}" y="{_HEIGHT - 18}" text-anchor="middle">'
        "peak activation memory per device (M_B of one 1F1B stage)</text>"
    )
    out.append(
        f'<text transform="translate(18,{_TOP + plot_h / 2:.2f}) rotate(-90)" '
        f'text-anchor="middle">{y_label}</text>'
    )
    # the frontier: a staircase (each point holds until the next one's memory)
    front = frontier.points
    if front:
        path = [f"M{sx(float(front[0].memory)):.2f},{sy(y_of_point(front[0])):.2f}"]
        for nxt in front[1:]:
            path.append(f"H{sx(float(nxt.memory)):.2f}")
            path.append(f"V{sy(y_of_point(nxt)):.2f}")
        path.append(f"H{sx(x_top):.2f}")
        out.append(f'<path d="{" ".join(path)}" fill="none" stroke="black" stroke-width="1.5"/>')
    for p in points:
        on = p in front
        ring = ' stroke="black"' if on else ""
        out.append(
            f'<circle cx="{sx(float(p.memory)):.2f}" cy="{sy(y_of_point(p)):.2f}" '
            f'r="{4 if on else 2.5}" fill="{colour[p.placement]}"{ring}>'
            f"<title>{escape(p.placement)}: memory "
            f"{format_short(p.memory)}, bubble {p.bubble:.4f}, makespan {p.makespan:g}"
            f"{', optimal' if p.optimal else ''}</title></circle>"
        )
    for k, n in enumerate(named):
        x, y = sx(float(n.memory)), sy(y_of_point(n))
        c = colour[n.placement]
        out.append(
            f'<path d="M{x:.2f},{y - 6:.2f} L{x + 6:.2f},{y:.2f} L{x:.2f},{y + 6:.2f} '
            f'L{x - 6:.2f},{y:.2f} Z" fill="none" stroke="{c}" stroke-width="1.5"/>'
        )
        out.append(
            f'<text x="{x + 8:.2f}" y="{y - 6 - 9 * (k % 2):.2f}" fill="{c}">{escape(n.name)}</text>'
        )
    # legend
    lx = _LEFT + plot_w + 20
    for k, name in enumerate(placements):
        y = _TOP + 10 + 18 * k
        out.append(f'<circle cx="{lx}" cy="{y}" r="4" fill="{colour[name]}"/>')
        out.append(f'<text x="{lx + 10}" y="{y + 4}">{escape(name)}</text>')
    y = _TOP + 10 + 18 * len(placements)
    out.append(f'<line x1="{lx - 6}" y1="{y}" x2="{lx + 6}" y2="{y}" stroke="black" stroke-width="1.5"/>')
    out.append(f'<text x="{lx + 10}" y="{y + 4}">frontier</text>')
    if named:
        y += 18
        out.append(
            f'<path d="M{lx},{y - 5} L{lx + 5},{y} L{lx},{y + 5} L{lx - 5},{y} Z" fill="none" '
            'stroke="black"/>'
        )
        out.append(f'<text x="{lx + 10}" y="{y + 4}">named schedule</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
