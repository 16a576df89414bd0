"""Shared pytest options and fixtures.

`--update-golden` rewrites the files under tests/golden/ from the current
output; without it a missing golden file fails loudly.
"""

from __future__ import annotations

import pytest

from tests.paths import GOLDEN


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite tests/golden/* from the current output instead of comparing",
    )


@pytest.fixture
def golden(request: pytest.FixtureRequest):
    """`golden(name, text)`: compare text with tests/golden/<name> (or rewrite it)."""
    update = request.config.getoption("--update-golden")

    def check(name: str, text: str) -> None:
        path = GOLDEN / name
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return
        if not path.exists():
            pytest.fail(f"golden file {path} is missing; run pytest with --update-golden to create it")
        assert text == path.read_text(), f"output differs from {path} (refresh with --update-golden if intended)"

    return check


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory):
    """A one-rank gloo group in this process, for one test module."""
    import torch.distributed as dist  # the compiler's tests run without torch

    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
