"""House rules for reports/ and the docs: evidence, not a notebook.

- reports/ holds measured runs, not scripts (a measurement worth keeping is a benchmark suite);
- reports/README.md indexes exactly the folders that are there;
- every reports/ link in the README and docs/ resolves;
- the README and docs/ name no absolute path of a development machine.
"""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "reports"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _tracked(pattern: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "--", pattern], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout (an sdist): fall back to the file system
        return [str(p.relative_to(ROOT)) for p in ROOT.glob(pattern)]
    return out.stdout.split()


def test_no_scripts_under_reports():
    scripts = [p for p in _tracked("reports") if p.endswith(".py")]
    scripts += [str(p.relative_to(ROOT)) for p in REPORTS.rglob("*.py")]
    assert not sorted(set(scripts)), f"scripts under reports/ (make them a bench suite): {sorted(set(scripts))}"


def test_reports_index_lists_exactly_the_folders():
    folders = {p.name for p in REPORTS.iterdir() if p.is_dir()}
    index = (REPORTS / "README.md").read_text()
    rows = [line for line in index.splitlines() if line.startswith("| [")]
    listed = {m.group(1).split("/")[0] for line in rows if (m := re.match(r"\| \[[^\]]+\]\(([^)]+)\)", line))}
    assert folders - listed == set(), f"folders missing from reports/README.md: {sorted(folders - listed)}"
    assert listed - folders == set(), f"reports/README.md lists folders that are gone: {sorted(listed - folders)}"


def test_report_links_in_readme_and_docs_resolve():
    missing = []
    for doc in DOCS:
        for m in re.finditer(r"\]\(((?:\.\./)?reports/[^)#\s]+)\)", doc.read_text()):
            target = (doc.parent / m.group(1)).resolve()
            if not target.exists():
                missing.append(f"{doc.relative_to(ROOT)}: {m.group(1)}")
    assert not missing, "links to reports that are not there:\n" + "\n".join(missing)


def test_no_development_machine_paths_in_readme_and_docs():
    hits = []
    for doc in DOCS:
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            if re.search(r"(?<![\w.~])/(?:work|root)/", line):
                hits.append(f"{doc.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "absolute paths of a development machine:\n" + "\n".join(hits)
