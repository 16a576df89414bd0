"""`python -m bench [NAME ...]`: run every bench/bench_*.py (or the named ones) and
print their tables. Each module exposes `main() -> None`."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def bench_names(argv: list[str]) -> list[str]:
    """The benches `argv` names: its words that are neither flags (--quick,
    --write: the modules read sys.argv themselves) nor a flag's value (--only
    KEY); none named: every bench/bench_*.py."""
    values = {i + 1 for i, a in enumerate(argv) if a == "--only"}
    names = [a for i, a in enumerate(argv) if not a.startswith("-") and i not in values]
    return names or sorted(p.stem for p in Path(__file__).parent.glob("bench_*.py"))


def main(argv: list[str]) -> int:
    names = bench_names(argv)
    for name in names:
        module = importlib.import_module(f"bench.{name if name.startswith('bench_') else 'bench_' + name}")
        print(f"== {module.__name__} ==", flush=True)
        module.main()
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
