"""Install what you use: inference needs no training package, and a training command run without
the [train] extra says so in one line."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ("lightning", "datasets", "peft", "scikit-learn", "jsonargparse", "matplotlib")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


BLOCK = "import sys\nfor m in ('lightning', 'datasets', 'peft', 'sklearn', 'jsonargparse', 'matplotlib'):\n    sys.modules[m] = None\n"
"""What an inference-only install lacks, made unimportable in the child process."""


def test_the_extras_split_inference_from_training():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(meta["dependencies"])
    assert not [p for p in TRAIN if p in base]
    extras = meta["optional-dependencies"]
    assert all(any(d.startswith(p) for d in extras["train"]) for p in TRAIN)
    assert any(d.startswith("matplotlib") for d in extras["bench"])
    assert "dev,train,bench" in (ROOT / "Makefile").read_text()  # make demo / make test install everything


def test_inference_runs_without_the_training_packages():
    r = _run(BLOCK + "import decoding.generate, decoding.serve.app, decoding.api, decoding.round.engine\n"
                     "sys.argv = ['generate', '--help']\nimport runpy\n"
                     "runpy.run_module('decoding.generate', run_name='__main__')")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--round" in r.stdout


def test_a_training_command_names_the_extra_in_one_line():
    r = _run(BLOCK + "sys.argv = ['-m']\nimport runpy\nrunpy.run_module('training.fit', run_name='__main__')")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'specstop[train]'" in lines[0] and "lightning" in lines[0], r.stderr
    r = _run(BLOCK + "import training")  # as a library: an ImportError that says the same
    assert r.returncode != 0 and "specstop[train]" in r.stderr


def test_one_command_runs_every_module():
    from decoding.__main__ import COMMANDS

    r = _run("from decoding.__main__ import main; raise SystemExit(main(['generate', '--help']))")
    assert r.returncode == 0 and r.stdout.startswith("usage:") and "--round" in r.stdout
    r = _run("from decoding.__main__ import main; raise SystemExit(main(['nope']))")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: unknown command 'nope'; choose from {', '.join(COMMANDS)}"]
    r = _run(BLOCK + "from decoding.__main__ import main; raise SystemExit(main(['fit', '--help']))")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "specstop[train]" in r.stderr
    import importlib.util

    assert all(importlib.util.find_spec(m) is not None for m, _ in COMMANDS.values())
