"""`--lengths` and `--lengths-from` on `stats` and `show`
(ppdsl/commands/common.py, docs/language.md "Costs in tokens"): the step's
lengths time each pass and bound each microbatch's memory; bad values are
usage errors (exit 2) that say what to give instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppdsl import lengths as documents
from ppdsl.cli import main
from tests.paths import EXAMPLES

COSTS = """schedule costs {
    cost F = 0.1 + 0.001*tokens + 1/10000000*tokens^2
    cost B = 0.1 + 0.001*tokens + 1/10000000*tokens^2
    cost W = 0.05 + 0.001*tokens
    memory M_B = 2*tokens
}
"""


def _stats(capsys: pytest.CaptureFixture[str], tmp_path: Path, *extra: str) -> tuple[int, str, str]:
    costs = tmp_path / "costs.pp"
    costs.write_text(COSTS)
    code = main(["stats", str(EXAMPLES / "zb_v.pp"), "--costs-from", str(costs), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys: pytest.CaptureFixture[str], tmp_path: Path, *extra: str) -> dict:
    code, out, _ = _stats(capsys, tmp_path, "--json", *extra)
    assert code == 0
    return json.loads(out)


def test_lengths_time_each_pass_and_bound_each_microbatch(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """One 4,096-token microbatch among 128-token ones: a longer makespan than
    all at 128 (and, the long one crossing every stage, than all at the
    nominal 1,024), and each rank's peak above that of all 128 and not that of
    all 1,024."""
    mixed = _json(capsys, tmp_path, "--lengths", "4096,128,128,128,128,128,128,128")
    short = _json(capsys, tmp_path, "--lengths", ",".join(["128"] * 8))
    nominal = _json(capsys, tmp_path)
    assert short["makespan"] < nominal["makespan"] < mixed["makespan"]
    for at in zip(short["devices"], mixed["devices"], nominal["devices"], strict=True):
        low, peak, high = (float(d["peak_memory"]) for d in at)
        assert low < peak != high


def test_lengths_from_a_file_or_documents(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    """A file of one length a line equals the same --lengths; a document file
    cut with --max-seq-len gives the lengths ppdsl.lengths computes."""
    listed = tmp_path / "lengths.txt"
    listed.write_text("# step 0\n4096\n128\n128\n128\n\n512\n128\n128\n128\n")
    by_list = _json(capsys, tmp_path, "--lengths", "4096,128,128,128,512,128,128,128")
    assert _json(capsys, tmp_path, "--lengths-from", str(listed)) == by_list
    docs = tmp_path / "docs.npz"
    doc_lengths = [4000, 200, 130, 900, 3000, 128, 129, 640, 128, 5000]
    documents.document_file(docs, doc_lengths, vocab_size=100)
    cut = documents.step_lengths(doc_lengths, 1, 8, max_seq_len=2048)
    assert cut == [128, 2048, 2048, 200, 130, 900, 2048, 128]
    assert (_json(capsys, tmp_path, "--lengths-from", str(docs), "--max-seq-len", "2048",
                  "--step", "1")
            == _json(capsys, tmp_path, "--lengths", ",".join(map(str, cut))))


@pytest.mark.parametrize("extra, message", [
    (("--lengths", "128,256"), "2 lengths for the schedule's 8 microbatches"),
    (("--lengths", "128,x,1,1,1,1,1,1"), "not 'x'"),
    (("--lengths", "0,1,1,1,1,1,1,1"), "not '0'"),
    (("--pack", "512"), "cut a .npz document file"),
    (("--lengths", "1,1,1,1,1,1,1,1", "--lengths-from", "x.txt"), "not both"),
])
def test_bad_lengths_are_usage_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                      extra: tuple[str, ...], message: str) -> None:
    """A count that is not m, a length that is not a whole number >= 1, cutting
    flags without a document file, or both sources: exit 2, no traceback."""
    code, _, err = _stats(capsys, tmp_path, *extra)
    assert code == 2 and message in err and "Traceback" not in err


def test_show_draws_the_step_under_its_lengths(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    """`show --lengths` ends its timeline where `stats --lengths` says (to its
    band's column width), not where the nominal lengths end."""
    given = ("--lengths", "4096,128,128,128,128,128,128,128")
    makespan = _json(capsys, tmp_path, *given)["makespan"]
    costs = tmp_path / "costs.pp"
    assert main(["show", str(EXAMPLES / "zb_v.pp"), "--costs-from", str(costs), "--width", "60",
                 "--color", "never", *given]) == 0
    out = capsys.readouterr().out
    last = float(out.split(" .. ")[-1].split()[0])
    assert abs(last - makespan) < 0.01 * makespan
    assert abs(last - _json(capsys, tmp_path)["makespan"]) > 0.1 * makespan
