"""Where the grammar and the codegen templates are, installed or in a checkout."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["grammar_text", "templates_dir"]

_REPO = Path(__file__).resolve().parent.parent


def _find(package: str, checkout_dir: str) -> Path:
    try:
        path = Path(str(resources.files(package)))
        if path.is_dir():
            return path
    except ModuleNotFoundError:
        pass
    return _REPO / checkout_dir


def grammar_text() -> str:
    """The text of grammar/ppdsl.lark."""
    return (_find("ppdsl._grammar", "grammar") / "ppdsl.lark").read_text()


def templates_dir() -> Path:
    """The folder holding the jinja2 templates of codegen/."""
    return _find("ppdsl._templates", "codegen")
