"""What looking for fixes adds to `ppdsl check` (issue 40: at most 1 s): per
example, over its rejected one-edit mutants (`tests/mutations.py`), the time to
compile and report, and the time the fix search adds under its default budget."""

from __future__ import annotations

import statistics
import time

from ppdsl.compiler import compile_source
from ppdsl.diagnostics import CompileError
from ppdsl.fixes import BUDGET_SECONDS, find_fixes
from tests.mutations import corpus


def main() -> None:
    print(f"fix search budget {BUDGET_SECONDS:g} s; times in s, per rejected one-edit mutant")
    print(f"{'example':<18} {'rejected':>8} {'check med':>10} {'search med':>11} "
          f"{'search max':>11} {'with fix':>9}")
    by_example: dict[str, list[tuple[float, float, bool]]] = {}
    for mutant in corpus():
        if mutant.num_edits != 1:
            continue
        file = f"examples/{mutant.example}.pp"
        started = time.perf_counter()
        try:
            compile_source(mutant.text, file)
            continue
        except CompileError as err:
            compiled = time.perf_counter()
            found = find_fixes(err.diagnostics, mutant.text, file)
        searched = time.perf_counter()
        fixed = any(d.fixes for d in found)
        by_example.setdefault(mutant.example, []).append(
            (compiled - started, searched - compiled, fixed)
        )
    for example, rows in sorted(by_example.items()):
        checks, searches = [r[0] for r in rows], [r[1] for r in rows]
        print(f"{example:<18} {len(rows):>8} {statistics.median(checks):>10.3f} "
              f"{statistics.median(searches):>11.3f} {max(searches):>11.3f} "
              f"{sum(r[2] for r in rows):>9}")


if __name__ == "__main__":
    main()
