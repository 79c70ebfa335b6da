"""One name per thing: the names retired from the code stay retired, and comments say what the
code does rather than cite a tracker that is not in the repository."""

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("decoding", "training", "tests")
ISSUE_NUMBER = re.compile(r"\bissues? ?#?\d+", re.IGNORECASE)
RETIRED = "feature" + "_bench"  # spelled apart so this file does not name it


def _sources():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def _comments_and_docstrings(source: str):
    """(line, text) of every comment and every string literal (docstrings and the like)."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            yield tok.start[0], tok.string


def test_no_issue_numbers_in_comments():
    found = [f"{path.relative_to(ROOT)}:{line}: {text.strip()[:80]}"
             for path in _sources() for line, text in _comments_and_docstrings(path.read_text())
             if ISSUE_NUMBER.search(text)]
    assert not found, "say what the code does and why, not which issue asked for it:\n" + "\n".join(found)


def test_the_issue_pattern_finds_what_it_should():
    n = "3"  # the sample cites its numbers through a name, so this file's own scan passes
    src = f'"""Speculation (issue {n}4): x."""\n# see Issue #{n}\nx = 1  # issues {n} and 5\ny = "tissue {n}"\n'
    hits = [line for line, text in _comments_and_docstrings(src) if ISSUE_NUMBER.search(text)]
    assert hits == [1, 2, 3]


def test_retired_names_stay_retired():
    assert not (ROOT / "training" / "serve").exists(), \
        "training/serve/ is training/export/ (decoding/serve/ is the HTTP server)"
    for old in ("decoding/proposers.py", "decoding/drafts/proposer.py", "training/cli.py"):
        assert not (ROOT / old).exists(), f"{old} was renamed; a second module by that name confuses"
    modules = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob(f"{RETIRED}*")]
    assert not modules, f"no module named {RETIRED}: {modules}"
    mentions = [f"{p.relative_to(ROOT)}:{n}" for p in _sources()
                for n, line in enumerate(p.read_text().splitlines(), 1) if RETIRED in line]
    assert not mentions, f"{RETIRED} is training.bench.head now: {mentions}"
