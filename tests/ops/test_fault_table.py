"""Every row of the fault table (tests/support/faults.py): one clear line, the documented exit
code, nothing lost on disk; crash rows finish on the re-run. Rows marked xfail there are
known gaps another change is closing: they xfail here while they fail, and pass once fixed."""

import pytest

from support import faults as FC

CASES = {c.name: c for c in FC.cases()}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    w = tmp_path_factory.mktemp("faults")
    FC.build_inputs(w)
    return w


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_fault_row(rows, name):
    w = rows
    row = FC.run_case(CASES[name], w)
    if row.problems and row.xfail:
        pytest.xfail(f"{row.xfail}: {row.problems[0][:200]}")
    assert not row.problems, row.problems
    assert row.exit == CASES[name].expect_exit
    if row.exit not in (0, FC.KILLED):
        assert row.lines == 1 and row.seen.startswith("error: ")
    assert row.left and "CHANGED" not in row.left


def test_table_is_written_atomically_and_marks_problems(tmp_path):
    ok = FC.Row("fine", "python x", 2, "error: bad", 1, "inputs unchanged")
    bad = FC.Row("broken", "python y", 1, "Traceback", 5, "", problems=["exit 1, expected 2"])
    known = FC.Row("known", "python z", 1, "Traceback", 5, "", problems=["p"], xfail="being fixed")
    md = FC.markdown([ok, bad, known])
    assert "| fine | 2 | `error: bad` | inputs unchanged | ok |" in md
    assert "FAIL: exit 1, expected 2" in md and "xfail: being fixed" in md
