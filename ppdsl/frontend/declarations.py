"""The top-level declarations: params (with `-D` overrides), lets, the
placement, costs, the memory model, the stages marked `recompute` and
expectations.

`Declarations` holds what the statements have established so far: the names in
scope and their values, the placement, the per-stage costs and memory. Costs and
memory not given take `semantics`' defaults (unit pass costs, BW = B + W,
M_B = 1, M_W = M_B / 2), kept current after every statement so `T_F`, `M_W`,
... name the values in force.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction

from ppdsl import limits, semantics
from ppdsl.diagnostics import CompileError, Span
from ppdsl.frontend import ast
from ppdsl.frontend.expressions import (
    BUILTINS,
    ElaborationError,
    Env,
    Num,
    Scope,
    Value,
    compile_expr,
    did_you_mean,
    integer,
    norm,
    number,
    show,
)
from ppdsl.ir.schedule import MEMORY_NAMES, Costs, Expect, MemoryModel, Placement
from ppdsl.semantics import KINDS, PassKind

__all__ = [
    "Declarations",
    "METRICS",
    "MAX_PASSES",
    "evaluate_override",
    "declare_param",
    "declare_placement",
    "declare_cost",
    "declare_memory",
    "declare_recompute",
    "ensure_placement",
    "expectation",
    "pass_kind",
    "require",
]

METRICS = ("peak_memory", "bubble", "idle", "makespan", "lifespan")
_EXPECT_OPS = ("<=", "<", "==", ">=", ">")
_COST_NAMES = (tuple(k.value for k in KINDS) + ("overlap",) + semantics.COLLECTIVES
               + semantics.STEP_COSTS + ("recv", "comm"))
_Poly = tuple[Fraction, Fraction, Fraction]
"""(a, b, c): a + b*tokens + c*tokens^2, exact."""
_MEMORY_NAMES = MEMORY_NAMES
_BYTES = "bytes"
"""A transfer's size, bound in `cost comm` (`cost comm = latency + bytes / bandwidth`);
`memory bytes[s]` states what stage s sends on."""
_GRAD_BYTES = "grad_bytes"
"""`memory grad_bytes[s]`: the bytes of stage s's gradients (its data-parallel reduction)."""
_BYTES_PROBES = (2, 7, 1000, 10**6, 10**12)
"""Sizes where `cost comm` must equal its line through bytes = 0 and 1."""
_TOKENS = "tokens"
"""A microbatch's length, bound in `cost` and `memory` (docs/language.md)."""
_FOLLOW_TOKENS = frozenset([k.value for k in KINDS] + list(MEMORY_NAMES))
_TOKEN_PROBES = (3, 7, 1000, 65536, 10**9)
"""Lengths where a value in tokens must equal its quadratic through 0, 1, 2
(a min, max, floor or condition in tokens shows at one of them)."""
# Sizes beyond which a schedule is surely a mistake (and would only exhaust memory).
_MAX_DEVICES = 1 << 16
_MAX_MICROBATCHES = 1 << 20
_MAX_STAGES = 1 << 20
MAX_PASSES = 20_000_000
"""The most passes an order or a repeated block may make."""


@dataclass
class Declarations:
    """What the top-level statements have established so far."""

    file: str
    """The `.pp` file, for spans."""
    env: Env = field(default_factory=dict)
    """Every name in scope at the top level and its value."""
    defined: dict[str, Span | None] = field(default_factory=dict)
    """Where each param and let was defined (None: on the command line)."""
    params: list[tuple[str, Value]] = field(default_factory=list)
    """Params and lets in order, for the IR's `params`."""
    placement: Placement | None = None
    """The placement, once `place` (or a statement that needs one) is seen."""
    split_backward: bool = True
    """`backward split` (B and W) or `backward fused` (BW)."""
    costs: dict[PassKind, list[Num]] = field(default_factory=dict)
    """Per pass kind, its cost on each stage (given or by default)."""
    comm: Num = semantics.DEFAULT_COMM
    """The cost of one transfer between devices: its latency when `cost comm`
    names the transfer's `bytes`."""
    comm_per_byte: Num = 0
    """`cost comm = a + b * bytes`: b, a transfer's time per byte (0: a plain number)."""
    stage_bytes: dict[str, list[Num]] = field(default_factory=dict)
    """`memory bytes[s]` (what stage s sends on) and `memory grad_bytes[s]` (its
    gradients, what its data-parallel reduction moves), per stage, where given."""
    recv: Num = semantics.DEFAULT_RECV
    """The receiver's own part of a transfer (`cost recv`)."""
    overlap: Num = semantics.DEFAULT_OVERLAP
    """The share of F + B an overlapped pair takes (`cost overlap`)."""
    collectives: dict[str, list[Num]] = field(default_factory=dict)
    """Per data-parallel collective (reduce, gather) given, its cost on each stage."""
    step: dict[str, list[Num]] = field(default_factory=dict)
    """Per step cost given (`semantics.STEP_COSTS`: overhead, optimizer, norm), its
    value on each stage (norm: one value)."""
    explicit: set[str] = field(default_factory=set)
    """The cost and memory names the file gave (the others follow defaults)."""
    memory: dict[str, list[Num]] = field(default_factory=dict)
    """M_B, M_W and M_I per stage."""
    recompute: list[bool] | None = None
    """Per stage, whether it is marked `recompute` (None: no `recompute` line)."""
    recompute_span: Span | None = None
    """Where the `recompute` line is."""
    per_token: dict[str, list[_Poly]] = field(default_factory=dict)
    """Per pass cost or memory name whose value follows the microbatch's
    `tokens`, (a, b, c) per stage: a + b*tokens + c*tokens^2."""

    @property
    def nominal_tokens(self) -> Fraction:
        """A microbatch's length where no step's lengths are given: the file's
        `param tokens`, else `semantics.DEFAULT_TOKENS`."""
        return Fraction(self.env.get("tokens", semantics.DEFAULT_TOKENS))

    def _token_rows(self, names: list[str], constant: dict[str, list[Num]],
                    default: dict[str, _Poly | tuple[str, ...]]) -> dict[str, list[_Poly]]:
        """Per name, its (a, b, c) per stage: as given in tokens, a given
        constant as (x, 0, 0), else its default (a constant, or the sum of
        earlier names)."""
        rows: dict[str, list[_Poly]] = {}
        for name in names:
            if name in self.per_token:
                rows[name] = self.per_token[name]
            elif name in self.explicit or name not in default:
                rows[name] = [(Fraction(x), Fraction(0), Fraction(0)) for x in constant[name]]
            elif isinstance(default[name], tuple) and isinstance(default[name][0], str):
                parts = [rows[k] for k in default[name]]  # type: ignore[index]
                rows[name] = [(sum((p[s][0] for p in parts), Fraction(0)),
                               sum((p[s][1] for p in parts), Fraction(0)),
                               sum((p[s][2] for p in parts), Fraction(0)))
                              for s in range(len(parts[0]))]
            else:
                rows[name] = [default[name]] * len(constant[name])  # type: ignore[list-item]
        return rows

    def scope(self) -> Scope:
        """The names visible at the top level."""
        return Scope(self.env)

    def define(self, name: str, value: Value, span: Span | None) -> None:
        """Bind a param or let; a builtin or a second definition is an error."""
        if name in BUILTINS:
            raise ElaborationError(
                f"'{name}' is a name the compiler binds; choose another name", span
            )
        if name in self.defined:
            where = self.defined[name]
            at = f" at {where.line}:{where.column}" if where else ""
            raise ElaborationError(f"'{name}' is already defined{at}", span)
        self.defined[name] = span
        self.env[name] = value

    def evaluate(self, expr: ast.Expr) -> Value:
        """The value of a top-level expression, within the integer-bits limit."""
        value = compile_expr(expr, self.scope())(self.env)
        limits.check_integer(value, expr.span, "this value")
        return value

    def cost_model(self) -> Costs:
        """The costs in force, as the IR states them (with the per-token costs
        where some pass's cost follows the tokens)."""
        costs = self._constant_costs()
        if not any(k.value in self.per_token for k in KINDS):
            return costs
        defaults: dict[str, _Poly | tuple[str, ...]] = {}
        for kind in KINDS:
            default = semantics.DEFAULT_DURATION[kind]
            defaults[kind.value] = (tuple(k.value for k in default) if isinstance(default, tuple)
                                    else (Fraction(default), Fraction(0), Fraction(0)))
        rows = self._token_rows([k.value for k in KINDS],
                                {k.value: v for k, v in self.costs.items()}, defaults)
        return costs.with_tokens([rows[k.value] for k in KINDS])  # type: ignore[misc]

    def _constant_costs(self) -> Costs:
        return Costs.by_kind(
            {k: [float(x) for x in values] for k, values in self.costs.items()},
            float(self.comm),
            overlap=float(self.overlap),
        ).with_collectives({n: [float(x) for x in v] for n, v in self.collectives.items()}
        ).with_step_costs(
            [float(x) for x in self.step.get("overhead", ())],
            [float(x) for x in self.step.get("optimizer", ())],
            float(self.step["norm"][0]) if "norm" in self.step else 0.0,
            float(self.step["jitter"][0]) if "jitter" in self.step else 0.0,
        ).with_receive_cost(float(self.recv)).with_bytes(
            float(self.comm_per_byte),
            [float(x) for x in self.stage_bytes.get(_BYTES, ())],
            [float(x) for x in self.stage_bytes.get(_GRAD_BYTES, ())],
        )

    def memory_model(self) -> MemoryModel:
        """The memory model in force, as the IR states it (with M_I of the stages
        marked `recompute`)."""
        marked = self.recompute or []
        kept = tuple(
            Fraction(x) if on else None for x, on in zip(self.memory["M_I"], marked, strict=False)
        )
        model = MemoryModel(
            tuple(Fraction(x) for x in self.memory["M_B"]),
            tuple(Fraction(x) for x in self.memory["M_W"]),
            kept if any(marked) else (),
        )
        if not any(n in self.per_token for n in _MEMORY_NAMES):
            return model
        zero = Fraction(0)
        rows = self._token_rows(list(_MEMORY_NAMES), self.memory,
                                {"M_I": (Fraction(semantics.DEFAULT_KEPT_INPUT), zero, zero)})
        if "M_W" not in self.explicit:  # M_W = M_B / 2 at every length
            fraction = semantics.DEFAULT_WEIGHT_FRACTION
            rows["M_W"] = [(a * fraction, b * fraction, c * fraction) for a, b, c in rows["M_B"]]
        return replace(model, tokens=tuple(tuple(rows[n]) for n in _MEMORY_NAMES))

    @property
    def recomputes(self) -> bool:
        """Whether some stage is marked `recompute` (so R is a pass of the file)."""
        return self.recompute is not None and any(self.recompute)


def _at_most(value: int, limit: int, span: Span | None, what: str, prefix: str = "") -> None:
    if value > limit:
        raise ElaborationError(f"{prefix}{what} is {value}; ppdsl handles at most {limit}", span)


def _positive_int(value: Value, span: Span | None, what: str, prefix: str = "") -> int:
    if isinstance(value, bool) or type(value) is not int or value <= 0:
        raise ElaborationError(
            f"{prefix}{what} must be a positive integer, got {show(value)}", span
        )
    return value


def evaluate_override(name: str, text: str, state: Declarations) -> Value:
    """Evaluate `-D name=text` as an expression over the params defined before it."""
    from ppdsl.frontend.parse import parse_expression

    prefix = f"-D {name}={text}: "
    try:
        expr = parse_expression(text, "<command line>")
        if isinstance(expr, ast.Name) and expr.id not in state.env:
            raise ElaborationError(
                f"{prefix}'{text}' is not a number (give an integer, a rational such as 3/2, "
                "or an expression over earlier params such as 2*d)",
                None,
            )
        return state.evaluate(expr)
    except limits.LimitError as exc:
        raise ElaborationError(prefix + exc.diagnostic.message, None) from None
    except CompileError:
        raise ElaborationError(
            f"{prefix}not a number or an expression over earlier params", None
        ) from None
    except ElaborationError as exc:
        if exc.diagnostic.message.startswith(prefix):
            raise
        raise ElaborationError(prefix + exc.diagnostic.message, None) from None


def declare_param(stmt: ast.Param, state: Declarations, overrides: dict[str, str]) -> None:
    """`param NAME = default`, or its `-D` override; d and m must be positive
    integers within ppdsl's limits."""
    if stmt.name in overrides:
        value = evaluate_override(stmt.name, overrides[stmt.name], state)
        where: Span | None = None
        prefix = f"-D {stmt.name}={overrides[stmt.name]}: "
    elif stmt.default is None:
        raise ElaborationError(
            f"param '{stmt.name}' has no value; give it with -D {stmt.name}=...", stmt.span
        )
    else:
        value = state.evaluate(stmt.default)
        where = stmt.default.span
        prefix = ""
    if isinstance(value, range):
        raise ElaborationError(
            f"{prefix}a param must be a number, got the range {show(value)}", where
        )
    if stmt.name == "d":
        value = _positive_int(value, where, "d (the number of devices)", prefix)
        _at_most(value, _MAX_DEVICES, where, "d (the number of devices)", prefix)
    elif stmt.name == "m":
        value = _positive_int(value, where, "m (the number of microbatches)", prefix)
        _at_most(value, _MAX_MICROBATCHES, where, "m (the number of microbatches)", prefix)
    state.define(stmt.name, value, stmt.span)
    state.params.append((stmt.name, value))


def _placement(stmt: ast.Place, state: Declarations) -> Placement:
    d = state.env["d"]
    assert type(d) is int
    if stmt.kind == "list":
        devices = []
        for expr in stmt.devices:
            dev = integer(state.evaluate(expr), expr.span, "a device index")
            if not 0 <= dev < d:
                raise ElaborationError(
                    f"device {dev} out of range: d = {d}, so devices are 0..{d}", expr.span
                )
            devices.append(dev)
        unused = sorted(set(range(d)) - set(devices))
        if unused:
            raise ElaborationError(
                f"device {unused[0]} holds no stage: the list must use every device 0..{d} "
                f"(d = {d})",
                stmt.span,
            )
        return Placement("list", d, tuple(devices))
    names = tuple(semantics.PLACEMENTS)
    if stmt.kind not in names:
        hint = (
            did_you_mean(stmt.kind, names)
            or "; expected one of " + ", ".join(names) + " or a list [e0, e1, ...]"
        )
        raise ElaborationError(f"unknown placement '{stmt.kind}'{hint}", stmt.kind_span)
    takes_arg = semantics.takes_chunks(stmt.kind)
    if takes_arg and stmt.arg is None:
        raise ElaborationError(
            f"'{stmt.kind}' needs the number of chunks: {stmt.kind}(v)", stmt.span
        )
    if not takes_arg and stmt.arg is not None:
        raise ElaborationError(f"'{stmt.kind}' takes no argument", stmt.arg.span)
    if not takes_arg:
        return Placement.named(stmt.kind, d)
    assert stmt.arg is not None
    v = _positive_int(state.evaluate(stmt.arg), stmt.arg.span, "the number of chunks")
    _at_most(v * d, _MAX_STAGES, stmt.arg.span, "the number of stages v*d")
    return Placement.named(stmt.kind, d, v)


def declare_placement(stmt: ast.Place, state: Declarations) -> None:
    """`place ...`: sets the placement (before any cost or memory statement)."""
    if state.placement is not None:
        raise ElaborationError(
            "'place' must come before the costs and memory that depend on it", stmt.span
        )
    _set_placement(state, replace(_placement(stmt, state), span=stmt.span))


def _set_placement(state: Declarations, placement: Placement) -> None:
    state.placement = placement
    num_stages = placement.num_stages
    state.env["S"] = num_stages
    if "v" not in state.env:
        state.env["v"] = norm(Fraction(num_stages, placement.num_devices))
    state.memory["M_B"] = [semantics.DEFAULT_ACTIVATION] * num_stages
    _refresh_names(state)


def _refresh_names(state: Declarations) -> None:
    """Keep the defaults of what the file did not give (`semantics`' defaults)
    and the T_*/M_* names current."""
    num_stages = len(state.memory["M_B"])
    given = {k: v for k, v in state.costs.items() if k.value in state.explicit}
    state.costs = {
        k: [norm(x) for x in values]
        for k, values in semantics.with_default_durations(given, num_stages).items()
    }
    if "M_W" not in state.explicit:
        fraction = semantics.DEFAULT_WEIGHT_FRACTION
        state.memory["M_W"] = [norm(Fraction(x) * fraction) for x in state.memory["M_B"]]
    if "M_I" not in state.explicit:
        state.memory["M_I"] = [semantics.DEFAULT_KEPT_INPUT] * num_stages
    for kind in KINDS:
        state.env[f"T_{kind.value}"] = state.costs[kind][0]
    state.env["T_comm"] = state.comm
    state.env["T_overlap"] = state.overlap
    for name in _MEMORY_NAMES:
        state.env[name] = state.memory[name][0]


def ensure_placement(state: Declarations) -> Placement:
    """The placement in force: `parallel` when the file has not said yet."""
    if state.placement is None:
        d = state.env["d"]
        assert type(d) is int
        _set_placement(state, Placement.named("parallel", d))
    assert state.placement is not None
    return state.placement


def _per_stage_values(
    stmt: ast.Cost | ast.Memory | ast.Recompute, state: Declarations, what: str
) -> list[Num]:
    num_stages = ensure_placement(state).num_stages
    expr = stmt.value
    assert expr is not None  # a bare `recompute` has no value to evaluate
    if not isinstance(stmt, ast.Recompute):
        state.per_token.pop(stmt.name, None)  # a later line replaces an earlier one
        if _TOKENS in _names(expr):
            return _per_token_values(stmt, state, num_stages)
    if stmt.index is None:
        value = state.evaluate(expr)
        values = [value] * num_stages
    else:
        if stmt.index in state.env:
            raise ElaborationError(
                f"'{stmt.index}' is already defined; name the stage index something else",
                stmt.span,
            )
        fn = compile_expr(expr, Scope([stmt.index], state.scope()))
        env = dict(state.env)
        values = []
        for s in range(num_stages):
            env[stmt.index] = s
            values.append(fn(env))
            limits.check_integer(values[-1], expr.span, f"at stage {s}, the value")
    nums: list[Num] = []
    for value in values:
        if isinstance(value, range) or value < 0:
            raise ElaborationError(
                f"{what} must be a number >= 0, got {show(value)}", expr.span
            )
        nums.append(int(value) if isinstance(value, bool) else value)
    return nums


def _per_token_values(stmt: ast.Cost | ast.Memory, state: Declarations,
                      num_stages: int) -> list[Num]:
    """A cost or memory amount in the microbatch's `tokens`: its (a, b, c) per
    stage kept in `state.per_token`, its values at the nominal length returned.
    It must be a + b*tokens + c*tokens^2 (checked exactly at more lengths than
    fix it) and at least 0 for every length from 1 token."""
    expr = stmt.value
    if stmt.name not in _FOLLOW_TOKENS:
        raise ElaborationError(
            f"'{stmt.name}' is one value for every microbatch; only the pass costs "
            f"({', '.join(k.value for k in KINDS)}) and the memory amounts "
            f"({', '.join(_MEMORY_NAMES)}) may follow a microbatch's 'tokens'", expr.span)
    nominal = state.nominal_tokens
    if nominal.denominator != 1 or nominal < 1:
        raise ElaborationError(f"'tokens' is a microbatch's length, a whole number >= 1, "
                               f"got {show(norm(nominal))}", state.defined.get(_TOKENS))
    if stmt.index is not None and stmt.index in state.env:
        raise ElaborationError(
            f"'{stmt.index}' is already defined; name the stage index something else", stmt.span)
    fn = compile_expr(expr, Scope([n for n in (stmt.index, _TOKENS) if n], state.scope()))
    env = dict(state.env)
    polys: list[_Poly] = []
    for s in range(num_stages):
        if stmt.index is not None:
            env[stmt.index] = s

        def at(t: int) -> Fraction:
            env[_TOKENS] = t
            return Fraction(number(fn(env), expr.span, "a cost in tokens"))

        f0, f1, f2 = at(0), at(1), at(2)
        c = (f2 - 2 * f1 + f0) / 2
        b = f1 - f0 - c
        for t in _TOKEN_PROBES:
            got = at(t)
            if got != f0 + b * t + c * t * t:
                where = f" at stage {s}" if stmt.index is not None else ""
                raise ElaborationError(
                    f"a value in tokens is a + b*tokens + c*tokens^2, and this one is not{where}: "
                    f"at tokens = {t} it is {show(norm(got))}, where the quadratic through "
                    f"tokens = 0, 1, 2 gives {show(norm(f0 + b * t + c * t * t))}", expr.span)
        lowest = _lowest_from_one(f0, b, c)
        if lowest is not None:
            raise ElaborationError(
                f"{'a cost' if isinstance(stmt, ast.Cost) else 'a memory amount'} must be "
                f">= 0 for every length from 1 token; "
                + (f"at tokens = {lowest} this one is {show(norm(f0 + b * lowest + c * lowest * lowest))}"
                   if lowest else "this one falls below 0 for long microbatches"), expr.span)
        polys.append((f0, b, c))
    state.per_token[stmt.name] = polys
    return [norm(a + b * nominal + c * nominal * nominal) for a, b, c in polys]


def _lowest_from_one(a: Fraction, b: Fraction, c: Fraction) -> int | None:
    """None when a + b*t + c*t^2 >= 0 for every t >= 1; else a length where it
    is below 0 (0: only for long enough lengths, c < 0 or c = 0 > b)."""
    if c < 0 or (c == 0 and b < 0):
        return 1 if a + b + c < 0 else 0
    t = max(Fraction(1), -b / (2 * c)) if c > 0 else Fraction(1)
    for whole in {int(t), int(t) + 1}:  # the vertex lies between two whole lengths
        if whole >= 1 and a + b * whole + c * whole * whole < 0:
            return whole
    return None


def declare_cost(stmt: ast.Cost, state: Declarations) -> None:
    """`cost KIND = x`, `cost KIND[s] = f(s)`, `cost comm = x`, `cost recv = x`,
    `cost overlap = r`,
    or a step cost: `cost overhead[s] = f(s)`, `cost optimizer[s] = f(s)`,
    `cost norm = x`, `cost jitter = x`."""
    if stmt.name not in _COST_NAMES:
        listed = ", ".join(_COST_NAMES[:-1]) + " and comm"
        hint = did_you_mean(stmt.name, _COST_NAMES) or f"; costs are {listed}"
        raise ElaborationError(f"unknown cost '{stmt.name}'{hint}", stmt.name_span)
    if stmt.name == "comm":
        if stmt.index is not None:
            raise ElaborationError("the transfer cost 'comm' is one value, not per stage", stmt.span)
        if _BYTES in _names(stmt.value):
            ensure_placement(state)
            state.comm, state.comm_per_byte = _latency_and_per_byte(stmt, state)
        else:
            state.comm, state.comm_per_byte = _per_stage_values(stmt, state, "a cost")[0], 0
    elif stmt.name == "recv":
        if stmt.index is not None:
            raise ElaborationError(
                "'recv' (the receiver's part of a transfer) is one value, not per stage",
                stmt.span)
        state.recv = _per_stage_values(stmt, state, "a cost")[0]
    elif stmt.name in semantics.COLLECTIVES:
        state.collectives[stmt.name] = _per_stage_values(stmt, state, "a cost")
    elif stmt.name == "norm":
        if stmt.index is not None:
            raise ElaborationError(
                "'norm' (the step's gradient-norm all-reduce) is one value, not per stage",
                stmt.span)
        state.step["norm"] = _per_stage_values(stmt, state, "a cost")[:1]
    elif stmt.name == "jitter":
        if stmt.index is not None:
            raise ElaborationError(
                "'jitter' (how much a pass's duration varies run to run) is one value, "
                "not per stage", stmt.span)
        state.step["jitter"] = _per_stage_values(stmt, state, "a cost")[:1]
    elif stmt.name in semantics.STEP_COSTS:
        state.step[stmt.name] = _per_stage_values(stmt, state, "a cost")
    elif stmt.name == "overlap":
        if stmt.index is not None:
            raise ElaborationError("'overlap' is one factor, not per stage", stmt.span)
        factor = _per_stage_values(stmt, state, "a cost")[0]
        if not 0 < factor <= 1:
            raise ElaborationError(
                f"'overlap' is the share of F + B an overlapped pair takes: more than 0 and "
                f"at most 1 (1: one after the other), got {show(factor)}",
                stmt.value.span,
            )
        state.overlap = factor
    else:
        state.costs[PassKind(stmt.name)] = _per_stage_values(stmt, state, "a cost")
    state.explicit.add(stmt.name)
    _refresh_names(state)


def declare_memory(stmt: ast.Memory, state: Declarations) -> None:
    """`memory M_B = x`, `memory M_W[s] = f(s)`, and the sizes in bytes:
    `memory bytes[s] = ...` (what stage s sends on), `memory grad_bytes[s] = ...`."""
    if stmt.name in (_BYTES, _GRAD_BYTES):
        state.stage_bytes[stmt.name] = _per_stage_values(stmt, state, "a size in bytes")
        return
    if stmt.name not in _MEMORY_NAMES:
        names = (*_MEMORY_NAMES, _BYTES, _GRAD_BYTES)
        hint = did_you_mean(stmt.name, names) or (
            "; the memory model has M_B and M_W, and sizes in bytes are 'bytes' (what a "
            "stage sends on) and 'grad_bytes' (its gradients)")
        raise ElaborationError(f"unknown memory quantity '{stmt.name}'{hint}", stmt.name_span)
    state.memory[stmt.name] = _per_stage_values(stmt, state, "a memory amount")
    state.explicit.add(stmt.name)
    _refresh_names(state)


def _latency_and_per_byte(stmt: ast.Cost, state: Declarations) -> tuple[Num, Num]:
    """`cost comm = a + b * bytes`: (a, b), the latency every transfer pays and its
    time per byte. It must be a line in `bytes` (checked exactly at more sizes than
    fix it) with a >= 0 and b >= 0."""
    expr = stmt.value
    if _BYTES in state.env:
        raise ElaborationError(
            f"'{_BYTES}' is already defined; in `cost comm` it is the transfer's size, so "
            "name the definition something else", state.defined.get(_BYTES) or stmt.span)
    fn = compile_expr(expr, Scope([_BYTES], state.scope()))
    env = dict(state.env)

    def at(size: int) -> Fraction:
        env[_BYTES] = size
        return Fraction(number(fn(env), expr.span, "a transfer's cost in bytes"))

    latency = at(0)
    per_byte = at(1) - latency
    for size in _BYTES_PROBES:
        got = at(size)
        if got != latency + per_byte * size:
            raise ElaborationError(
                f"a transfer's cost is latency + bytes / bandwidth, a line in 'bytes', and this "
                f"one is not: at bytes = {size} it is {show(norm(got))}, where the line through "
                f"bytes = 0 and 1 gives {show(norm(latency + per_byte * size))}", expr.span)
    if latency < 0 or per_byte < 0:
        raise ElaborationError(
            f"a transfer's latency and time per byte must be >= 0, got latency "
            f"{show(norm(latency))} and {show(norm(per_byte))} per byte", expr.span)
    return norm(latency), norm(per_byte)


def declare_recompute(stmt: ast.Recompute, state: Declarations) -> None:
    """`recompute` (every stage), `recompute = cond` or `recompute[s] = cond(s)`:
    the stages marked for recomputation (a condition is true when not 0)."""
    if state.recompute is not None:
        where = state.recompute_span
        at = f" (also at {where.line}:{where.column})" if where else ""
        raise ElaborationError(
            f"'recompute' is given twice{at}; mark every stage in one line, e.g. "
            "`recompute[s] = s < 2 or s == S - 1`",
            stmt.span,
        )
    num_stages = ensure_placement(state).num_stages
    if stmt.value is None:
        if stmt.index is not None:
            raise ElaborationError(
                f"`recompute[{stmt.index}]` needs its condition: `recompute[{stmt.index}] = ...` "
                f"(true for the stages {stmt.index} to recompute)",
                stmt.span,
            )
        marked = [True] * num_stages
    else:
        values = _per_stage_values(stmt, state, "a recompute condition")
        marked = [value != 0 for value in values]
    state.recompute = marked
    state.recompute_span = stmt.span


def require(stmt: ast.Require, state: Declarations) -> None:
    """`require COND, "message"`: an error at the statement when COND is false,
    quoting the message and the values of the names COND uses."""
    if number(state.evaluate(stmt.cond), stmt.cond.span, "a requirement"):
        return
    names = sorted(_names(stmt.cond), key=lambda n: (n not in ("d", "m"), n))
    values = ", ".join(f"{n} = {show(state.env[n])}" for n in names if n in state.env)
    got = f" (here {values})" if values else ""
    text = ast.format_expr(stmt.cond)
    why = f"{stmt.message}: " if stmt.message else ""
    raise ElaborationError(f"{why}this schedule requires {text}{got}", stmt.span)


def _names(expr: ast.Expr) -> set[str]:
    if isinstance(expr, ast.Name):
        return {expr.id}
    found: set[str] = set()
    for child in (getattr(expr, f, None) for f in ("operand", "left", "right", "cond", "then", "else_")):
        if child is not None:
            found |= _names(child)
    for arg in getattr(expr, "args", ()):
        found |= _names(arg)
    return found


def pass_kind(
    name: str, span: Span, split_backward: bool, recompute: bool = False
) -> PassKind:
    """The pass kind a block slot or an order's pass call names, checked
    against the schedule's backward form and (for R) its `recompute` line."""
    kinds = semantics.pass_kinds(split_backward, recompute)
    words = tuple(k.value for k in kinds)
    if name not in {k.value for k in KINDS}:
        hint = did_you_mean(name, words) or "; passes are " + ", ".join(words)
        raise ElaborationError(f"unknown pass '{name}'{hint}", span)
    kind = PassKind(name)
    if kind is PassKind.R and not recompute:
        raise ElaborationError(
            "R is the recompute pass of a stage marked `recompute`, and this schedule marks "
            "none; add `recompute` (every stage) or `recompute[s] = ...` above",
            span,
        )
    if kind not in kinds:
        if split_backward:
            raise ElaborationError(
                "this schedule's backward is split: write "
                + " and ".join(k.value for k in semantics.backward_kinds(True))
                + " (or `backward fused`)",
                span,
                involves="backward",
            )
        fused = " and ".join(k.value for k in semantics.backward_kinds(False))
        raise ElaborationError(
            f"this schedule's backward is fused: write {fused}, not {name}", span,
            involves="backward",
        )
    return kind


def expectation(decl: ast.ExpectDecl, state: Declarations, num_devices: int) -> Expect:
    """`expect METRIC[device] OP bound`, its metric and device checked."""
    if decl.metric not in METRICS:
        hint = did_you_mean(decl.metric, METRICS) or "; metrics are " + ", ".join(METRICS)
        raise ElaborationError(f"unknown metric '{decl.metric}'{hint}", decl.metric_span)
    if decl.op not in _EXPECT_OPS:
        raise ElaborationError(
            f"expect takes one of {' '.join(_EXPECT_OPS)}, not '{decl.op}'", decl.span
        )
    device = None
    if decl.device is not None and decl.metric == "lifespan":
        num_stages = ensure_placement(state).num_stages
        device = integer(state.evaluate(decl.device), decl.device.span, "a stage index")
        if not 0 <= device < num_stages:
            raise ElaborationError(
                f"stage {device} out of range: S = {num_stages}, so lifespan[0..{num_stages}]",
                decl.device.span,
            )
    elif decl.device is not None:
        if decl.metric != "peak_memory":
            raise ElaborationError(
                f"'{decl.metric}' is one value for the schedule; only peak_memory takes "
                "a device [k] (and lifespan a stage [s])",
                decl.device.span,
            )
        device = integer(state.evaluate(decl.device), decl.device.span, "a device index")
        if not 0 <= device < num_devices:
            raise ElaborationError(
                f"device {device} out of range: d = {num_devices}, so 0..{num_devices}",
                decl.device.span,
            )
    bound = number(state.evaluate(decl.bound), decl.bound.span, "the bound")
    return Expect(decl.metric, decl.op, Fraction(bound), device, decl.span, decl.text)
