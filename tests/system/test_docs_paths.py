"""Every test file the documentation names (docs/*.md, CONTRIBUTING.md, README.md)
exists, and so does each test function it names with `::`: a moved test leaves no
stale reference behind."""

from __future__ import annotations

import re

from tests.paths import ROOT

_NAMED = re.compile(r"tests/[A-Za-z0-9_/]+\.py(?:::[A-Za-z0-9_]+)?")
# A pattern the text explains, not a file (CONTRIBUTING.md: "tests/analysis/checks/test_NAME.py").
_PLACEHOLDER = "NAME"


def _documents() -> list:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "CONTRIBUTING.md", ROOT / "README.md"]


def _stale(text: str) -> list[str]:
    """The test paths (and `::test` names) in `text` that do not exist."""
    stale = []
    for named in _NAMED.findall(text):
        path, _, test = named.partition("::")
        if _PLACEHOLDER in path:
            continue
        file = ROOT / path
        if not file.exists():
            stale.append(named)
        elif test and not re.search(rf"^(async )?def {re.escape(test)}\(", file.read_text(), re.M):
            stale.append(named)
    return stale


def test_every_named_test_path_exists():
    """No document names a test file or test function that is not there."""
    found = {doc.relative_to(ROOT).as_posix(): _stale(doc.read_text()) for doc in _documents()}
    assert {doc: names for doc, names in found.items() if names} == {}


def test_a_moved_test_is_caught():
    """The check itself: a path that does not exist and a test name that is not in
    its file are both reported; a placeholder and a real path are not."""
    text = ("see tests/no_such_test.py, tests/system/test_docs_paths.py::test_nothing, "
            "tests/analysis/checks/test_NAME.py and tests/system/test_docs_paths.py")
    assert _stale(text) == ["tests/no_such_test.py", "tests/system/test_docs_paths.py::test_nothing"]
