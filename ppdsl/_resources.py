"""Where the grammar, the codegen templates and the example schedules are,
installed or in a checkout."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["grammar_text", "schedules_dir", "templates_dir"]

_REPO = Path(__file__).resolve().parent.parent


def _find(installed_dir: str, checkout_dir: str) -> Path:
    # In a wheel the folders sit inside the package (ppdsl/_grammar, ppdsl/_templates);
    # in a checkout (editable install) they sit at the top of the repository.
    path = Path(str(resources.files("ppdsl"))) / installed_dir
    if path.is_dir():
        return path
    return _REPO / checkout_dir


def grammar_text() -> str:
    """The text of grammar/ppdsl.lark."""
    return (_find("_grammar", "grammar") / "ppdsl.lark").read_text()


def templates_dir() -> Path:
    """The folder holding the jinja2 templates of codegen/."""
    return _find("_templates", "codegen")


def schedules_dir() -> Path:
    """The folder holding the example schedules (examples/*.pp), the candidates
    `ppdsl plan` tries."""
    return _find("_schedules", "examples")
