"""`python -m bench [NAME ...]`: run every bench/bench_*.py (or the named ones) and
print their tables. Each module exposes `main() -> None`."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    # flags (--quick, --write) are for the modules, which read sys.argv themselves
    values = {i + 1 for i, a in enumerate(argv) if a == "--only"}  # --only KEY: a flag's value
    names = [a for i, a in enumerate(argv) if not a.startswith("-") and i not in values]
    names = names or sorted(p.stem for p in Path(__file__).parent.glob("bench_*.py"))
    for name in names:
        module = importlib.import_module(f"bench.{name if name.startswith('bench_') else 'bench_' + name}")
        print(f"== {module.__name__} ==", flush=True)
        module.main()
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
