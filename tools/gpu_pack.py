"""Carry what the GPU suite needs onto a device machine that has no hub and takes at most 64 MiB
a call, the working tree included: `python tools/gpu_pack.py --out .gpu-carry` packs the
embedded target's GGUF (98 MB, Q4_1: already its smallest lossless form, gzip saves 6%), with
`--drafts head|both` the shipped head (and the stand-alone draft), into one uncompressed tar stream cut into
as many parts as the per-call room (64 MiB less the tree that travels) needs, each part a folder
.gpu-carry/partN; the wheels in .whl/ (the pinned transformers and gguf: the device has another
transformers and no gguf) ride whole in part 1. A manifest holds every file's sha256.

`--commands` prints the device `run` calls: call 1 carries part 1, installs the wheels and runs
the CUDA tests; each later call, within the ~30 s the machine stays warm and keeps ignored files,
carries the next part; the last one joins the stream, checks every sha256, puts the drafts back
where the suite reads them, and runs `python -m decoding.bench --suite gpu --out $OUT`.
`--join DIR` reassembles into DIR/payload (atomic, sha256-checked). docs/gpu.md says how the
tree is kept small enough for two calls.

A maintainer's tool for a leased machine, so it lives beside the packages, not in the wheel.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from decoding.options import add_option

LIMIT = 64 * 2**20
"""Bytes one device call carries: tracked and untracked-not-ignored files plus carried paths."""
CHUNK = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _copy_range(src: Path, dst: Path, start: int, length: int) -> None:
    with open(src, "rb") as f, open(dst, "wb") as g:
        f.seek(start)
        while length > 0:
            block = f.read(min(CHUNK, length))
            if not block:
                raise ValueError(f"{src} is shorter than expected")
            g.write(block)
            length -= len(block)


DRAFTS = ("checkpoints/drafts/smollm2-135m-eagle3", "checkpoints/drafts/smollm2-135m-draft")
"""The tracked checkpoints the suite reads (--drafts carries them instead of the tree)."""


SLIM = ("checkpoints/drafts", "data/corpus", "reports")
"""Tracked folders (prefixes) a device session leaves out of the tree for its calls (a throwaway
branch: docs/gpu.md): 60 of the tree's 71 MiB, none read on the device except the drafts, carried then."""


def payload(gguf: Path, drafts: str) -> list[tuple[str, Path]]:
    """(name in the stream, file): the GGUF, then every file of the head (`head`) or of both
    drafts (`both`)."""
    files = [("target.gguf", gguf)]
    pick = {"none": (), "head": DRAFTS[:1], "both": DRAFTS}[drafts]
    return files + [(str(f), f) for d in pick for f in sorted(Path(d).rglob("*")) if f.is_file()]


def pack(files: list[tuple[str, Path]], wheels: list[Path], out: Path, room: int) -> dict:
    """The files as one tar stream in parts of at most `room` bytes (part 1 also holds the wheels,
    whole), of equal size; returns the manifest (also written into the last part)."""
    import tarfile

    for old in out.glob("part*"):
        shutil.rmtree(old)
    out.mkdir(parents=True, exist_ok=True)
    stream = out / ".stream.tar"
    with tarfile.open(stream, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in files:
            info = tar.gettarinfo(str(path), arcname=name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(path, "rb") as f:
                tar.addfile(info, f)
    size, wheel_bytes = stream.stat().st_size, sum(w.stat().st_size for w in wheels)
    n = max(1, math.ceil((size + wheel_bytes) / room))
    first = max(0, min(size, (size + wheel_bytes) // n - wheel_bytes))
    rest = math.ceil((size - first) / max(1, n - 1)) if n > 1 else 0
    cuts = [0, first] + [min(size, first + rest * i) for i in range(1, n)]
    cuts[-1] = size
    for i in range(n):
        d = out / f"part{i + 1}"
        d.mkdir()
        _copy_range(stream, d / f"stream.{i}", cuts[i], cuts[i + 1] - cuts[i])
    for w in wheels:
        shutil.copyfile(w, out / "part1" / w.name)
    manifest = {"stream_sha256": sha256(stream), "bytes": size, "parts": n, "wheels": [w.name for w in wheels],
                "files": {name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for name, p in files},
                "part_bytes": {f"part{i + 1}": sum(f.stat().st_size for f in (out / f"part{i + 1}").iterdir())
                               for i in range(n)}}
    stream.unlink()
    (out / f"part{n}" / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def join(carry: Path) -> Path:
    """carry/payload from the parts: the stream's and every file's sha256 checked (atomic)."""
    import tarfile

    parts = sorted(carry.glob("part*"), key=lambda p: int(p.name[4:]))
    m = json.loads((parts[-1] / "manifest.json").read_text()) if parts else None
    if m is None or len(parts) != m["parts"]:
        raise ValueError(f"{carry}: {len(parts)} parts, the manifest wants {m and m['parts']}: a call was missed")
    tmp = Path(tempfile.mkdtemp(dir=carry, prefix=".payload-"))
    try:
        with open(tmp / "stream.tar", "wb") as g:
            for i, p in enumerate(parts):
                with open(p / f"stream.{i}", "rb") as f:
                    shutil.copyfileobj(f, g, CHUNK)
        if sha256(tmp / "stream.tar") != m["stream_sha256"]:
            raise ValueError("the joined stream's sha256 differs from the manifest's: a part is stale")
        with tarfile.open(tmp / "stream.tar") as tar:
            tar.extractall(tmp / "files", filter="data")
        (tmp / "stream.tar").unlink()
        for name, want in m["files"].items():
            if sha256(tmp / "files" / name) != want["sha256"]:
                raise ValueError(f"{name}: sha256 differs from the manifest's")
        dst = carry / "payload"
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp / "files", dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def tree_bytes(root: Path = Path("."), without: tuple[str, ...] = ()) -> int:
    """What travels with every call: tracked files and untracked files git does not ignore
    (less the paths starting with `without`, moved out for the calls)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout.split(b"\0")
    names = [p.decode() for p in out if p and not p.decode().startswith(without or ("\0",))]
    return sum((root / p).stat().st_size for p in names if (root / p).is_file())


CARRY = ".gpu-carry"
SITE = f"{CARRY}/site"
ENV = f"export PYTHONPATH=$PWD/{SITE} SPECSTOP_CACHE=$PWD/{CARRY}/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false; "
INSTALL = (f"if ls {CARRY}/part1/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps "
           f"--no-compile --no-cache-dir --upgrade --target {SITE} {CARRY}/part1/*.whl || exit 1; fi; ")
PYTEST = "python3 -m pytest -q -p no:cacheprovider -m cuda --durations=6 "
TESTS = {"graph": f"timeout 200 {PYTEST}-n 6 tests/forward/test_graph_on_cuda.py tests/round/test_device_round_on_cuda.py "
                  f"2>&1 | tee $OUT/pytest-graph.log | tail -12; ",
         "lossless": f"timeout 110 {PYTEST}-n 6 tests/decoding/test_lossless_on_cuda.py 2>&1 | tee $OUT/pytest-lossless.log | tail -12; "}
"""On 2026-11-27 (one H100): the graph tests 94 s with 4 workers, the eager ones 110 s with 6 (the
exact-sampling cases are most of it); the timeouts keep the suite's time whatever happens."""
RESTORE = (f"for d in {CARRY}/payload/checkpoints/drafts/*; do [ -f checkpoints/drafts/$(basename $d)/config.json ] || "
           f"{{ mkdir -p checkpoints/drafts && cp -r $d checkpoints/drafts/; }}; done; ")
SUITE = (f"python3 tools/gpu_pack.py --join {CARRY} || exit 1; {{RESTORE}}python3 -m decoding.bench --suite gpu "
         f"--target {CARRY}/payload/target.gguf{{DRAFT}} --budget-seconds {{BUDGET}} --out $OUT 2>&1 | tee $OUT/suite.log | tail -60")


def commands(parts: int, drafts: str = "none", budget: int = 460) -> list[dict]:
    """The device `run` calls for `parts` parts, the drafts carried as `drafts` says (head: no
    stand-alone draft, so no HF-assisted row): command (under 2,000 characters), carry, timeout.
    The graph tests ride in call 1 (which installs the wheels), the eager CUDA tests in call 2,
    the suite in the last, its budget shortened where the tests share its call. A lease is 900 s:
    on 2026-11-27 the start took ~50 s and the three calls 104, 110 and 441 s (727 s held), so a
    `budget` of 460 fits; lower it by what `lease.budget_left_s` after call 2 says is missing."""
    first = INSTALL + ENV + "nvidia-smi -L; "
    tests = [TESTS["graph"] + TESTS["lossless"]] if parts < 3 else [TESTS["graph"], TESTS["lossless"]]
    last = SUITE.format(RESTORE=RESTORE if drafts != "none" else "", DRAFT=" --draft none" if drafts == "head" else "",
                        BUDGET=min(budget, 240) if parts == 1 else budget)
    if parts == 1:
        return [{"command": first + tests[0] + last, "carry": [f"{CARRY}/part1"], "timeout_s": 600}]
    calls = [{"command": first + tests[0], "carry": [f"{CARRY}/part1"], "timeout_s": 260}]
    for i in range(2, parts):
        run = ENV + tests[1] if i == 2 and len(tests) > 1 else f"ls -l {CARRY}/part{i}"
        calls.append({"command": run, "carry": [f"{CARRY}/part{i}"], "timeout_s": 150 if i == 2 else 60})
    return calls + [{"command": ENV + last, "carry": [f"{CARRY}/part{parts}"], "timeout_s": min(600, budget + 80)}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/gpu_pack.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(ap, "out", unset=f"{CARRY}, git-ignored")
    ap.add_argument("--gguf", default=None, help="the target GGUF (default: the embedded one)")
    ap.add_argument("--wheels", default=".whl", help="folder of wheels to carry (transformers, gguf)")
    ap.add_argument("--drafts", choices=("none", "head", "both"), default="none",
                    help=f"carry the head ({DRAFTS[0]}) or both drafts in the parts (for a slimmed tree)")
    ap.add_argument("--slim", action="store_true",
                    help=f"size the parts for a tree without {', '.join(SLIM)} (moved out for the calls: docs/gpu.md)")
    ap.add_argument("--room-mib", type=float, default=None,
                    help="MiB one part may hold (default: 64 less the working tree that travels, less 1)")
    ap.add_argument("--join", default=None, metavar="DIR", help="reassemble DIR's parts into DIR/payload")
    ap.add_argument("--commands", action="store_true", help="print the device run calls (JSON)")
    a = ap.parse_args(argv)
    try:
        if a.join:
            print(join(Path(a.join)))
            return 0
        if a.out:
            from decoding.models.named_targets import smollm2_gguf_path

            wheels = sorted(Path(a.wheels).glob("*.whl")) if Path(a.wheels).is_dir() else []
            if not wheels:
                print(f"note: no wheels in {a.wheels}/: the device keeps its own transformers (see docs/gpu.md)",
                      file=sys.stderr)
            tree = tree_bytes(without=SLIM if a.slim else ())
            room = int(a.room_mib * 2**20) if a.room_mib else LIMIT - tree - 2**20
            if room <= 0:
                raise ValueError(f"the working tree alone is {tree / 2**20:.1f} MiB, over the 64 MiB a call "
                                 f"carries: slim it first (docs/gpu.md) or pass --room-mib")
            m = pack(payload(Path(a.gguf) if a.gguf else smollm2_gguf_path(), a.drafts), wheels,
                     Path(a.out), room)
            for d, n in m["part_bytes"].items():
                total = tree + n
                flag = "" if total <= LIMIT else "  OVER the 64 MiB a call carries"
                print(f"{d}: {n / 2**20:.1f} MiB + the tree {tree / 2**20:.1f} MiB = {total / 2**20:.1f} MiB{flag}")
        if a.commands:
            carry = Path(a.out or CARRY)
            parts = len(list(carry.glob("part*")))
            if not parts:
                raise ValueError(f"nothing packed in {carry}: run with --out {CARRY} first")
            names = json.loads((carry / f"part{parts}" / "manifest.json").read_text())["files"]
            has = [any(k.startswith(d + "/") for k in names) for d in DRAFTS]
            drafts = "both" if all(has) else "head" if has[0] else "none"
            print(json.dumps(commands(parts, drafts), indent=1))
    except (ValueError, OSError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
