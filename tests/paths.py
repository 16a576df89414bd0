"""Where the checkout's files are, for the tests (one definition, imported as
`from tests.paths import ...`)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
EXAMPLES = ROOT / "examples"
