"""tools/gpu_pack.py: what the device needs travels in parts that fit a call and comes back
whole (every sha256 checked), and the prepared device commands fit the device tool's limits."""

import hashlib
import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# a tool beside the packages, not in them: loaded by its path
_spec = importlib.util.spec_from_file_location("gpu_pack", ROOT / "tools" / "gpu_pack.py")
gpu_pack = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_pack)


def _files(tmp_path):
    gguf, wheel = tmp_path / "t.gguf", tmp_path / "whl" / "transformers-5.23.0-py3-none-any.whl"
    wheel.parent.mkdir()
    gguf.write_bytes(os.urandom(3_000_001))
    wheel.write_bytes(os.urandom(700_000))
    return gguf, wheel


def test_split_and_join_round_trip(tmp_path):
    gguf, wheel = _files(tmp_path)
    files = gpu_pack.payload(gguf, "head")  # the GGUF and the shipped head's files
    assert files[0] == ("target.gguf", gguf) and any(n.endswith("model.safetensors") for n, _ in files)
    m = gpu_pack.pack(files, [wheel], tmp_path / "carry", room=12_000_000)
    sizes = list(m["part_bytes"].values())
    assert m["parts"] == len(sizes) >= 2 and max(sizes) <= 12_000_000 and max(sizes) - min(sizes) < 1_000_000
    assert (tmp_path / "carry" / "part1" / wheel.name).read_bytes() == wheel.read_bytes()  # whole, in part 1
    out = gpu_pack.join(tmp_path / "carry")
    for name, path in files:
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert gpu_pack.main(["--join", str(tmp_path / "carry")]) == 0  # again: the payload is replaced


def test_a_stale_or_missing_part_is_refused(tmp_path):
    gguf, _ = _files(tmp_path)
    gpu_pack.pack(gpu_pack.payload(gguf, "none"), [], tmp_path / "carry", room=1_000_000)
    half = tmp_path / "carry" / "part2" / "stream.1"
    half.write_bytes(half.read_bytes()[:-1] + b"x")
    with pytest.raises(ValueError, match="sha256"):
        gpu_pack.join(tmp_path / "carry")
    assert not (tmp_path / "carry" / "payload").exists() and not list((tmp_path / "carry").glob(".payload-*"))
    (tmp_path / "carry" / "part1" / "stream.0").rename(tmp_path / "gone")
    (tmp_path / "carry" / "part1").rmdir()
    with pytest.raises(ValueError, match="parts"):
        gpu_pack.join(tmp_path / "carry")


@pytest.mark.parametrize("parts,drafts", [(1, "none"), (2, "head"), (3, "both")])
def test_device_commands_fit_the_tool(parts, drafts):
    calls = gpu_pack.commands(parts, drafts)
    assert [c["carry"] for c in calls] == [[f".gpu-carry/part{i + 1}"] for i in range(parts)]
    for c in calls:
        assert len(c["command"]) < 2000 and 1 <= c["timeout_s"] <= 600
    assert "-m cuda" in calls[0]["command"] and ".whl" in calls[0]["command"]
    assert sum("test_graph_on_cuda" in c["command"] for c in calls) == 1
    last = calls[-1]["command"]
    assert "--join .gpu-carry" in last and "--suite gpu" in last and "--out $OUT" in last
    assert ("--draft none" in last) == (drafts == "head") and ("cp -r" in last) == (drafts != "none")


def test_the_tree_that_travels_is_measured():
    whole, slim = gpu_pack.tree_bytes(ROOT), gpu_pack.tree_bytes(ROOT, without=gpu_pack.SLIM)
    assert whole > slim > 100_000  # the drafts, corpora and reports are most of it
