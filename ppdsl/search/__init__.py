"""`ppdsl search`: find building blocks and orders under a memory budget.

`problem` states a search, `blockspace` and `listsched` generate candidates
(building blocks; order-level heuristics), `evaluate` times and measures them
(numba), `driver` runs the search, `references` are the hand-made schedules it
is compared with, `emit` writes the result as a `.pp` file, `progress` draws the
progress bar.
"""

from ppdsl.search.driver import SearchResult, search
from ppdsl.search.emit import emit_pp
from ppdsl.search.problem import SearchInputError, SearchProblem
from ppdsl.search.references import Reference, references

__all__ = [
    "SearchProblem",
    "SearchInputError",
    "SearchResult",
    "Reference",
    "search",
    "references",
    "emit_pp",
]
