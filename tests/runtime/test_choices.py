"""ppdsl/runtime/choices.py: each option's values are declared once, and the
command line takes exactly those values."""

from __future__ import annotations

import argparse

from ppdsl.runtime import choices
from ppdsl.runtime.training.options import add_training_options


def test_each_choice_list_is_a_tuple_of_distinct_values():
    """Every named list is a non-empty tuple with no value twice."""
    for name in choices.__all__:
        values = getattr(choices, name)
        assert isinstance(values, tuple) and values and len(set(values)) == len(values), name


def test_the_training_flags_take_exactly_the_declared_values():
    """`--device`, `--optimizer`, `--precision`, `--param-dtype`, `--reduce-dtype`,
    `--lr-schedule`, `--release` and `--optimizer-validation` offer the tuples of
    choices.py, no other list."""
    parser = argparse.ArgumentParser()
    add_training_options(parser)
    offered = {a.option_strings[0]: tuple(a.choices) for a in parser._actions
               if a.choices is not None and a.option_strings}
    assert offered["--device"] == choices.DEVICES
    assert offered["--optimizer"] == choices.OPTIMIZERS
    assert offered["--precision"] == choices.PRECISIONS
    assert offered["--param-dtype"] == choices.PARAM_DTYPES
    assert offered["--reduce-dtype"] == choices.REDUCE_DTYPES
    assert offered["--lr-schedule"] == choices.LR_SCHEDULES
    assert offered["--release"] == choices.RELEASES
    assert offered["--optimizer-validation"] == choices.VALIDATIONS
