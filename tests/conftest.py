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
