"""The training options, declared once (ppdsl/runtime/training/options.py):
`ppdsl run --help` and a generated program's `--help` show the same flags with
the same help, what `ppdsl run` is given reaches the ranks unchanged, and each
limit is checked in one place."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppdsl.cli import main
from ppdsl.runtime.training.options import (
    add_training_options,
    check_training_options,
    training_argv,
    training_default,
)
from ppdsl.runtime.training.train import parse_options
from tests.paths import ROOT


def _flat(text: str) -> str:
    return " ".join(text.split())


def _declared() -> dict[str, str]:
    """Each declared flag and its help text, from a parser they are declared on."""
    parser = argparse.ArgumentParser()
    add_training_options(parser)
    return {a.option_strings[0]: _flat(a.help or "") for a in parser._actions
            if a.option_strings[0] != "-h"}


def test_run_and_the_ranks_show_one_declaration(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every training flag appears with its help text in `ppdsl run --help` and
    in the rank program's `--help`."""
    monkeypatch.setenv("COLUMNS", "1000")  # no line breaks inside a help text
    assert main(["run", "--help"]) == 0
    run_help = _flat(capsys.readouterr().out)
    with pytest.raises(SystemExit) as exit_:
        parse_options(["--help"])
    assert exit_.value.code == 0
    rank_help = _flat(capsys.readouterr().out)
    declared = _declared()
    assert {"--model", "--steps", "--batch-size", "--timeout", "--device", "--release", "--json",
            "--trace", "--optimizer", "--dp-mode"} <= set(declared)
    for flag, text in declared.items():
        assert f"{flag} " in run_help and text in run_help, flag
        assert f"{flag} " in rank_help and text in rank_help, flag


def test_given_options_reach_the_ranks_unchanged() -> None:
    """`ppdsl run` leaves every option unset unless given and passes on only the
    given ones; the rank parses them back to the same values and takes its
    declared default for the rest."""
    run = argparse.ArgumentParser()
    add_training_options(run, forward=True)
    given = ["--model", "m.py:f", "--steps", "3", "--timeout", "7.5", "--device", "cpu",
             "--release", "at-w", "--json", "out", "--optimizer", "sgd", "--momentum", "0.9",
             "--dp", "2", "--share-gpu", "--eval-every", "2"]
    args = run.parse_args(given)
    assert args.batch_size is None and args.precision is None and args.seq_len is None
    argv = training_argv(args)
    rank = parse_options(argv)
    for dest in ("model", "steps", "timeout", "device", "release", "json_out", "optimizer",
                 "momentum", "dp", "share_gpu", "eval_every"):
        assert getattr(rank, dest) == getattr(args, dest), dest
    assert (rank.precision, rank.seq_len, rank.lr) == (
        training_default("precision"), training_default("seq_len"), training_default("lr"))
    assert (rank.steps, rank.timeout, rank.precision) == (3, 7.5, "fp32")
    assert {a for a in argv if a.startswith("--")} == {a for a in given if a.startswith("--")}


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"steps": 0}, "--steps 0: need at least 1 training step"),
        ({"batch_size": 0}, "--batch-size 0: need at least 1 sample"),
        ({"timeout": 0.0}, "--timeout 0: need a positive number of seconds"),
        ({"seq_len": 32, "model": "m.py:f"}, "--seq-len is for --model hf:DIR"),
        ({"dp": 0}, "--dp must be at least 1, not 0"),
    ],
    ids=["steps", "batch-size", "timeout", "hf-only", "dp"],
)
def test_limits_are_checked_once(given: dict, message: str) -> None:
    """`check_training_options` names the out-of-range option; `ppdsl run` and
    the rank program both refuse it with that message."""
    assert (check_training_options(argparse.Namespace(**given)) or "").startswith(message)


def test_rank_refuses_what_run_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    """A limit broken on the rank program's command line is a usage error (exit
    2) with the message `ppdsl run` gives."""
    with pytest.raises(SystemExit) as exit_:
        parse_options(["--model", "m.py:f", "--steps", "0"])
    assert exit_.value.code == 2
    assert "--steps 0: need at least 1 training step" in capsys.readouterr().err


@pytest.mark.slow
def test_generated_launcher_shows_the_options(tmp_path: Path) -> None:
    """The generated launch.py, started as torchrun starts it (RANK set), prints
    the declared options for `--help` and exits 0."""
    assert main(["compile", str(ROOT / "examples" / "1f1b.pp"), "-D", "d=2", "-o",
                 str(tmp_path)]) == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT), RANK="1", WORLD_SIZE="2", COLUMNS="1000")
    proc = subprocess.run([sys.executable, str(tmp_path / "launch.py"), "--help"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    shown = _flat(proc.stdout)
    assert shown.startswith("usage: launch.py")
    for flag, text in _declared().items():
        assert f"{flag} " in shown and text in shown, flag


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"clip_grad_norm": -1.0}, "--clip-grad-norm must be positive"),
        ({"resume": True}, "--resume needs --checkpoint-dir"),
        ({"stop_after": 2}, "--stop-after needs --checkpoint-dir"),
        ({"optimizer": "adamw", "momentum": 0.9}, "--momentum is SGD's"),
        ({"warmup_steps": -1}, "--warmup-steps must not be negative"),
        ({"param_dtype": "bf16", "precision": "fp16"},
         "--param-dtype bf16 with --precision fp16 would compute in fp16"),
    ],
)
def test_training_option_limits(given: dict, message: str) -> None:
    """Each out-of-range option is named, with what to do."""
    assert message in (check_training_options(argparse.Namespace(**given)) or "")
