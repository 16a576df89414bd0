"""`ppdsl.json_text.dumps` writes exactly what `json.dumps(obj, indent=N)` writes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.json_text import Deferred, dump, dumps

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=5)
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=4), inner, max_size=4),
    ),
    max_leaves=30,
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(_json, st.integers(0, 3))
def test_equals_the_standard_encoder(obj, indent):
    """Any JSON value (NaN, infinities, non-ASCII text, empty containers, tuples)."""
    assert dumps(obj, indent) == json.dumps(obj, indent=indent)
    pieces: list[str] = []
    dump(obj, pieces.append, indent)
    assert "".join(pieces) == json.dumps(obj, indent=indent)


def test_dump_writes_in_pieces_and_makes_deferred_values_when_reached(monkeypatch):
    """`dump` hands the text over in pieces (here: a small flush size), each
    `Deferred` made once, in document order, as the encoder gets to it."""
    import ppdsl.json_text as jt

    monkeypatch.setattr(jt, "_FLUSH", 100)
    made: list[int] = []

    def device(k: int):
        def make():
            made.append(k)
            return [f"{k}F{j}" for j in range(30)]
        return Deferred(make)

    doc = {"devices": [{"rank": k, "actions": device(k)} for k in range(3)]}
    pieces: list[str] = []
    dump(doc, pieces.append, 2)
    plain = {"devices": [{"rank": k, "actions": [f"{k}F{j}" for j in range(30)]} for k in range(3)]}
    assert "".join(pieces) == json.dumps(plain, indent=2) == dumps(doc, 2)
    assert made == [0, 1, 2, 0, 1, 2] and len(pieces) > 3


def test_other_types_behave_as_the_standard_encoder():
    """Int keys go through json.dumps (same text); an unknown type raises its TypeError."""
    obj = {"a": [{1: "x", "b": [1.5, 2]}]}
    assert dumps(obj, 2) == json.dumps(obj, indent=2)
    with pytest.raises(TypeError):
        dumps({"a": [object()]}, 2)
