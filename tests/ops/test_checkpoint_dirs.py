"""Checkpoint directories never vanish: deciders are write-once, drafts are swapped atomically."""

import json
import os

import pytest

from decoding.decider import policy as D
from decoding.models import ModelError
from training import swap


def _save(root, name="run1", threshold=0.4):
    cfg = D.DeciderConfig(kind="logistic", threshold=threshold)
    return D.save_decider(root / name, D.DeciderNet(cfg), cfg, {"m": 1})


def test_decider_dirs_are_write_once(tmp_path):
    out = _save(tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(FileExistsError, match="write-once"):
        _save(tmp_path, threshold=0.9)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run1"]  # no temp dir left behind
    assert D.load_decider(out)[1].threshold == 0.4


def test_decider_dir_is_readable_by_others_under_a_strict_umask(tmp_path):
    old = os.umask(0o077)  # a user's strict umask must not make a shared checkpoint private
    try:
        out = _save(tmp_path)
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}


def test_concurrent_writer_is_refused_not_merged(tmp_path, monkeypatch):
    """A writer that finds the name free but loses the rename race gets FileExistsError."""
    other = tmp_path / "run1"
    real_mkdtemp = D.tempfile.mkdtemp

    def racing_mkdtemp(**kw):  # the other writer lands its dir right after our existence check
        other.mkdir()
        (other / "model.safetensors").write_text("theirs")
        return real_mkdtemp(**kw)

    monkeypatch.setattr(D.tempfile, "mkdtemp", racing_mkdtemp)
    with pytest.raises(FileExistsError, match="concurrently"):
        _save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run1"]
    assert (other / "model.safetensors").read_text() == "theirs"


@pytest.mark.parametrize("latest", [None, "", 3, "../x", ".run1.tmp-1"])
def test_registry_without_a_usable_latest_is_one_clear_error(tmp_path, monkeypatch, latest):
    monkeypatch.setattr(D, "DECIDERS_DIR", tmp_path)
    (tmp_path / "registry.json").write_text(json.dumps({"latest": latest, "runs": []}))
    with pytest.raises(ModelError, match="names no latest decider"):
        D.load_decider("latest")


def _tree(path, marker):
    path.mkdir(parents=True)
    (path / "config.json").write_text(marker)
    (path / "sub").mkdir()
    (path / "sub" / "w").write_text(marker)


@pytest.mark.parametrize("atomic", [True, False])
def test_replace_dir(tmp_path, monkeypatch, atomic):
    out, new = tmp_path / "draft", tmp_path / ".draft.tmp"
    _tree(out, "old")
    _tree(new, "new")
    if not atomic:
        monkeypatch.setattr(swap, "_renameat2", lambda: None)
    seen = []  # is `out` a whole draft after every filesystem step replace_dir takes?
    for name in ("rename", "replace"):
        real = getattr(os, name)

        def spy(a, b, _real=real):
            _real(a, b)
            seen.append((out / "config.json").is_file())

        monkeypatch.setattr(swap.os, name, spy)
    swap.replace_dir(new, out)
    assert (out / "config.json").read_text() == "new" and (out / "sub" / "w").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
    if atomic:
        assert all(seen)  # no step ever left `out` without a whole draft
    else:
        assert not all(seen)  # the documented fallback: two renames with a gap between them


def test_replace_dir_into_a_free_path(tmp_path):
    _tree(tmp_path / "n", "x")
    swap.replace_dir(tmp_path / "n", tmp_path / "out")
    assert (tmp_path / "out" / "sub" / "w").read_text() == "x" and not (tmp_path / "n").exists()


def test_fit_refuses_an_existing_run_id_before_training(tmp_path, capsys):
    from support.traces import write_traces
    from support.decider import fit_config
    from training.decider import fit

    traces = write_traces(tmp_path / "t", n_prompts=12)
    taken = tmp_path / "deciders" / "run-a"
    taken.mkdir(parents=True)
    (taken / "config.json").write_text("theirs")
    assert fit.main(["--config", str(fit_config(tmp_path, traces)), "--export.run_id", "run-a"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "write-once" in err[-1]
    assert [p.name for p in taken.iterdir()] == ["config.json"] and (taken / "config.json").read_text() == "theirs"
    assert not list(tmp_path.glob("work/**/*.ckpt"))  # refused before any training
