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


def _shares_a_fixture(item: pytest.Item) -> bool:
    """Whether `item` uses a module- or session-scoped fixture of the suite's own
    (a process group started once for its module, say)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope in ("module", "session") and d.func.__module__.startswith("tests")
               for defs in info.name2fixturedefs.values() for d in defs)


def _weight(item: pytest.Item) -> int:
    return 0 if item.get_closest_marker("distributed") else 1 if item.get_closest_marker("slow") else 2


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """For `make test` (pytest-xdist, `--dist loadgroup`): the tests of a module that
    share a fixture of wider scope run on one worker, which starts it once (each
    worker would start the module's process group again), and the modules that
    start processes run first, the slow ones next, so that the short tests fill
    the end of the run instead of one long test keeping a core idle. Modules stay
    contiguous (their module fixtures are set up once) in their collected order."""
    for item in items:
        if _shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__ if item.module else item.nodeid))
    rank: dict[str, int] = {}
    for item in items:
        key = item.nodeid.split("::")[0]
        rank[key] = min(rank.get(key, 2), _weight(item))
    order = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (rank[item.nodeid.split("::")[0]], order[id(item)]))
