"""tools/submission_size.py: the commits since a base, measured as a submission is (packed bytes,
and diffs added up with a file added and later removed counted twice), refused past a limit."""

import importlib.util
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("submission_size", ROOT / "tools" / "submission_size.py")
size = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(size)
MIB = 2**20


def sh(*args):
    env = os.environ | {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], check=True, capture_output=True, env=env).stdout.decode().strip()


def test_diffs_count_both_sides_and_a_limit_refuses(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sh("init", "-q", "-b", "landed")
    Path("a.txt").write_text("x\n")
    sh("add", "-A"), sh("commit", "-qm", "base")
    sh("checkout", "-q", "-b", "work")  # the reflog's "Created from" is the base
    chunk = Path("chunk.bin")
    chunk.write_bytes(os.urandom(MIB))
    sh("add", "-A"), sh("commit", "-qm", "add")
    chunk.write_bytes(os.urandom(2 * MIB))
    sh("add", "-A"), sh("commit", "-qm", "change")
    chunk.unlink()
    sh("add", "-A"), sh("commit", "-qm", "remove")

    assert size.created_from() == sh("rev-parse", "landed")
    total, rows = size.diff_bytes("landed")
    assert total == MIB + (MIB + 2 * MIB) + 2 * MIB  # added, changed (old and new), removed
    assert [r[2] for r in rows] == ["chunk.bin"] * 3
    assert size.pack_bytes("landed") > 3 * MIB  # random bytes do not compress
    assert size.main([]) == 0
    assert "3 commit(s)" in capsys.readouterr().out
    monkeypatch.setattr(size, "DIFF_LIMIT", 5 * MIB)
    assert size.main([]) == 1
    out = capsys.readouterr().out
    assert "OVER A LIMIT" in out and "chunk.bin" in out
    assert size.main(["--base", "no-such-rev"]) == 2
