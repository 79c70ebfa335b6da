"""How big the commits since a base are, as a submission is measured: their packed bytes and
their diffs added up (a file added and later removed counts twice). A training chunk is ~118 MB;
two in one submission (or one changed and one added) pass the diffs' limit, and the whole
submission is refused. Run it before stopping:

    python tools/submission_size.py                 # since the commit this branch was created from
    python tools/submission_size.py --base REV      # since REV

Exit 1 where a limit is passed (the largest files are listed), 2 on bad input.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

MIB = 2**20
PACK_LIMIT, DIFF_LIMIT = 512 * MIB, 256 * MIB
"""A submission's packed commits, and their diffs added up (the workplace's limits)."""
ZERO = "0" * 40


def git(*args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(["git", *args], input=stdin, capture_output=True, check=True).stdout


def created_from(branch: str = "HEAD") -> str:
    """The commit the branch was created from (its reflog's first entry), else its upstream."""
    name = git("rev-parse", "--abbrev-ref", branch).decode().strip()
    lines = git("reflog", "show", "--format=%H %gs", name).decode().splitlines()
    for line in reversed(lines):
        sha, _, what = line.partition(" ")
        if what.startswith("branch: Created from"):
            return sha
    return git("rev-parse", "@{upstream}").decode().strip()


def blob_sizes(shas: set[str]) -> dict[str, int]:
    shas = sorted(s for s in shas if s != ZERO)
    out = git("cat-file", "--batch-check=%(objectname) %(objectsize)", stdin="\n".join(shas).encode() + b"\n")
    return {sha: int(n) for sha, n in (line.split() for line in out.decode().splitlines())}


def diff_bytes(base: str, head: str = "HEAD") -> tuple[int, list[tuple[int, str, str]]]:
    """Each commit's changed files, the old and the new side both counted (a removal counts its
    old bytes, an addition its new): total bytes and (bytes, commit, path) per change."""
    changes = []
    for commit in git("rev-list", "--reverse", f"{base}..{head}").decode().split():
        raw = git("diff-tree", "-r", "--root", "--no-commit-id", "--no-renames", "-z", commit).decode()
        parts = raw.split("\0")
        for meta, path in zip(parts[0::2], parts[1::2]):
            if meta.startswith(":"):
                _, _, old, new, _ = meta[1:].split(" ")
                changes.append((commit, path, old, new))
    sizes = blob_sizes({c[2] for c in changes} | {c[3] for c in changes})
    rows = [(sizes.get(old, 0) + sizes.get(new, 0), commit[:10], path) for commit, path, old, new in changes]
    return sum(r[0] for r in rows), rows


def pack_bytes(base: str, head: str = "HEAD") -> int:
    out = subprocess.run(["git", "pack-objects", "--revs", "--stdout", "-q"], input=f"{head}\n^{base}\n".encode(),
                         capture_output=True, check=True).stdout
    return len(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the landed commit (default: the one this branch was created from)")
    ap.add_argument("--top", type=int, default=5, help="largest changes listed")
    a = ap.parse_args(argv)
    try:
        base = a.base or created_from()
        git("rev-parse", "--verify", f"{base}^{{commit}}")
        diffs, rows = diff_bytes(base)
        packed = pack_bytes(base)
    except subprocess.CalledProcessError as e:
        print(f"error: git {' '.join(e.cmd[1:3])}: {e.stderr.decode().strip().splitlines()[-1] if e.stderr else e}",
              file=sys.stderr)
        return 2
    n = len(git("rev-list", f"{base}..HEAD").split())
    over = packed > PACK_LIMIT or diffs > DIFF_LIMIT
    print(f"{n} commit(s) since {base[:10]}: packed {packed / MIB:.1f} MiB (limit {PACK_LIMIT // MIB}), "
          f"diffs {diffs / MIB:.1f} MiB (limit {DIFF_LIMIT // MIB})" + ("  OVER A LIMIT" if over else ""))
    for size, commit, path in sorted(rows, reverse=True)[: a.top if not over else max(a.top, 20)]:
        if size >= MIB:
            print(f"  {size / MIB:8.1f} MiB  {commit}  {path}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
