"""A schedule written as a Python generator, property-tested over pp and m
with ppdsl.testing (docs/testing.md).

`one_f_one_b_lagged_w(pp, m, lag)` is 1F1B with the backward split into the
input gradient (torch's `I`) and the weight gradient (`W`), each W run `lag`
input gradients after its own, as zero-bubble schedules defer W to fill
bubbles. The property: for every pp in 2..8, m in pp..4*pp and lag in 0..pp,
the order is valid (every pass once, dependencies, no deadlock under blocking
send/recv) and no rank holds more than pp activations plus lag weight-gradient
stashes (M_W = M_B / 2, ppdsl's default memory model).

    pytest examples/test_my_schedule.py
"""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.testing import assert_valid, param_values


def one_f_one_b_lagged_w(pp: int, m: int, lag: int) -> list[list[str]]:
    """Per rank, actions in torch's notation (`0F1`, `0I1`, `0W1`), stage = rank."""
    rows = []
    for rank in range(pp):
        warm = min(pp - 1 - rank, m)
        row = [f"{rank}F{j}" for j in range(warm)]
        waiting: list[int] = []  # input gradients done, weight gradients not yet
        for j in range(m):
            if warm + j < m:
                row.append(f"{rank}F{warm + j}")
            row.append(f"{rank}I{j}")
            waiting.append(j)
            if len(waiting) > lag:
                row.append(f"{rank}W{waiting.pop(0)}")
        row += [f"{rank}W{j}" for j in waiting]
        rows.append(row)
    return rows


@settings(max_examples=20, deadline=None)
@given(params=param_values("pp=2..8", "m=pp..4*pp"), data=st.data())
def test_lagged_w_is_valid_within_its_memory(params, data):
    """Valid and within pp + lag/2 activations for every drawn pp, m and lag."""
    pp, m = params["pp"], params["m"]
    lag = data.draw(st.integers(0, pp), label="lag")
    bound = pp + Fraction(lag, 2)
    found = assert_valid(one_f_one_b_lagged_w(pp, m, lag), num_microbatches=m,
                         max_peak_memory=bound, name=f"lagged_w(pp={pp}, m={m}, lag={lag})")
    assert max(found.peak_memory) <= bound


def test_lag_zero_is_plain_split_1f1b():
    """With lag 0 every W follows its I at once: rank 0 peaks at pp activations."""
    found = assert_valid(one_f_one_b_lagged_w(4, 8, 0), num_microbatches=8)
    assert found.peak_memory[0] == 4
