"""ppdsl/runtime/train.py: the path generated rank programs import `main` from
(codegen/rank.py.j2) is the training loop's own `main`."""

from __future__ import annotations

from tests.paths import ROOT


def test_generated_programs_path_is_the_training_main():
    """`ppdsl.runtime.train.main` is `ppdsl.runtime.training.train.main`, and the
    rank template still imports it by that path."""
    from ppdsl.runtime.train import main
    from ppdsl.runtime.training import train

    assert main is train.main
    assert "from ppdsl.runtime.train import main" in (ROOT / "codegen" / "rank.py.j2").read_text()
