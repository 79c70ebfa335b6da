"""The fault table: each bad input / crash point a user can hit, run through the real
CLIs on tiny models (subprocesses), with what the user sees, the exit code and what is left
on disk.

    python tests/support/faults.py reports/faults.md

tests/ops/test_fault_table.py asserts every row. Crash rows kill the process with SIGKILL at the
named step (an event inside the child, no timing) and then run the command again.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve()
if __name__ == "__main__" and sys.path and Path(sys.path[0] or ".").resolve() == HERE.parent:
    del sys.path[0]  # run as a script: support/'s modules are `support.*`, never top-level names
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's packages, then test helpers
PY = sys.executable
KILLED = -signal.SIGKILL


@dataclass
class Case:
    name: str
    argv: list[str]
    """Command after the interpreter; {t} {d} {dec} {w} are the tiny target, draft, decider, work dir."""
    expect_exit: int
    expect: str
    """Text the user must see (in the error line; for crash rows, in the re-run's output)."""
    prepare: Callable[[Path], None] | None = None
    left: Callable[[Path], str] | None = None
    """After the run: describes what is on disk, raising AssertionError where something is lost."""
    rerun: bool = False
    """Crash rows: run the command again (without the fault); it must finish with exit 0."""
    xfail: str | None = None


@dataclass
class Row:
    case: str
    command: str
    exit: int
    seen: str
    lines: int
    left: str
    problems: list[str] = field(default_factory=list)
    xfail: str | None = None


# ---- tiny inputs ---------------------------------------------------------------------------
def build_inputs(w: Path) -> None:
    from support.models import WORDS, noisy_copy, save_tiny, tiny_llama

    target = tiny_llama(0, vocab=len(WORDS), scale=6, max_pos=64)
    save_tiny(w / "target", WORDS, target)
    save_tiny(w / "draft", WORDS, noisy_copy(target, 0.03))
    from decoding.decider.policy import DeciderConfig, DeciderNet, save_decider
    from decoding.models import fingerprint, load_model

    pair = {"target": fingerprint(load_model(w / "target")), "draft": fingerprint(load_model(w / "draft"))}
    cfg = DeciderConfig(kind="logistic", model_pair=pair, threshold=0.3)
    save_decider(w / "decider", DeciderNet(cfg), cfg, {})


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def copy_draft(w: Path, name: str) -> Path:
    import shutil

    shutil.copytree(w / "draft", w / name)
    return w / name


def truncate_draft(w: Path) -> None:
    f = copy_draft(w, "draft_truncated") / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])


def mismatch_draft(w: Path) -> None:
    from support.models import WORDS, tiny_llama

    other = tiny_llama(3, vocab=len(WORDS), hidden=16, max_pos=64)  # config says hidden 32
    other.save_pretrained(w / "mismatch_src")
    d = copy_draft(w, "draft_mismatched")
    (d / "model.safetensors").write_bytes((w / "mismatch_src" / "model.safetensors").read_bytes())


def truncate_decider(w: Path) -> None:
    import shutil

    shutil.copytree(w / "decider", w / "decider_truncated")
    f = w / "decider_truncated" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:50])


def null_registry(w: Path) -> None:
    (w / "deciders_null").mkdir()
    (w / "deciders_null" / "registry.json").write_text(json.dumps({"latest": None, "runs": []}))


# ---- retrain rows: synthetic traces + hand-made deciders (support/retrain_seams.py) --------
def retrain_prepare(w: Path) -> None:
    import yaml

    from support.decider import write_prompts
    from support.retrain_seams import make_decider

    r = w / "retrain"
    if r.exists():
        import shutil

        shutil.rmtree(r)
    write_prompts(r / "logged", "day1.jsonl", 16)
    make_decider(r / "deciders", "champ", "timid", promote=True)
    cfg = dict(new_prompts=str(r / "logged"), work=str(r / "work"), deciders=str(r / "deciders"),
               target=str(w / "target"), draft=str(w / "draft"), dtype="float32", chat=False,
               heldout_fraction=0.4, live_prompts=0, threads=1, min_prompts=8,
               fit_overrides=["--data.val_fraction", "0.3"])
    (r / "cfg.yaml").write_text(yaml.safe_dump(cfg))


def retrain_left(w: Path) -> str:
    r = w / "retrain"
    reg = json.loads((r / "deciders" / "registry.json").read_text())
    runs = {x["run_id"] for x in reg["runs"]}
    assert all((r / "deciders" / rid / "model.safetensors").is_file() for rid in runs), "a registered decider is gone"
    assert (r / "deciders" / reg["latest"] / "config.json").is_file(), "latest names no decider"
    files = sorted(p.name for p in r.glob("work/*/decision*.json"))
    decided = [json.loads(p.read_text()) for p in r.glob("work/*/decision.json")]
    if decided:
        d = decided[0]
        assert d["champion"] != d["challenger"], "the challenger was compared with itself"
        assert not d["promoted"] or reg["latest"] == d["challenger"], "decision and registry disagree"
    champs = ", ".join(f"champion={d['champion']}" for d in decided)
    return f"registry latest={reg['latest']} ({len(runs)} runs, all present); {', '.join(files) or 'no decision file'}" + \
        (f" ({champs})" if champs else "")


def child(mode: str, args: list[str]) -> int:
    """Run a real CLI in this process with one fault injected at an exact step."""
    from support import retrain_seams
    from training.decider import retrain as R

    if mode == "generate-with-deciders":  # decoding.generate with another deciders root
        from decoding.decider import policy as D
        from decoding.generate import main

        D.DECIDERS_DIR = Path(args[0])
        return main(args[1:])
    if mode == "kill-in-draft-export":  # killed while swapping a new draft over an old one
        from decoding.models import load_model
        from training import swap
        from training.draft import distill

        def killed(*a):
            os.kill(os.getpid(), signal.SIGKILL)

        out = Path(args[0])
        swap.exchange = killed
        distill.write_draft(load_model(out), out, {"re": "export"}, out)
        return 0
    retrain_seams.install(setattr, {"kind": "good"})
    if mode == "latest-moved":  # a training.decider.fit promotes while retrain compares
        real = R.decide

        def meanwhile(*a):
            retrain_seams.make_decider(Path(args[1]), "other", "timid", promote=True)
            return real(*a)

        R.decide = meanwhile
    elif mode in ("kill-before-swap", "kill-after-swap"):
        real_register = R.register

        def register(*a, **k):
            if mode == "kill-after-swap":
                real_register(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)

        R.register = register
    return R.main(["--config", args[0]])


def draft_left(w: Path) -> str:
    from decoding.models import load_model

    load_model(w / "draft_export")  # the old draft still loads
    tmp = [p.name for p in w.glob(".draft_export.tmp-*")]
    return f"old draft intact and loadable; {len(tmp)} temp dir(s) beside it (removed by no one: harmless)"


def draft_export_prepare(w: Path) -> None:
    copy_draft(w, "draft_export")


# ---- the table -------------------------------------------------------------------------------
G = ["-m", "decoding.generate", "--prompt", "w1 w2", "--target", "{t}", "--draft", "{d}",
     "--max-new-tokens", "4", "--json"]
SELF = [str(HERE), "--child"]
RETRAIN_CFG = "{w}/retrain/cfg.yaml"


def cases() -> list[Case]:
    import torch

    cuda = torch.cuda.is_available()
    return [
        Case("--k-config 16,16,16,16 (a 69,904-node tree)", G + ["--strategy", "mcsd", "--k-config", "16,16,16,16"],
             2, "more than 1024 nodes"),
        Case("--width 64 --depth 17 (1,088 nodes)", G + ["--width", "64", "--depth", "17"], 2, "MAX_TREE_NODES"),
        Case("--width 0", G + ["--width", "0"], 2, "width >= 1"),
        Case("--temperature nan", G + ["--temperature", "nan"], 2, "temperature must be 0"),
        Case("--temperature inf", G + ["--temperature", "inf"], 2, "temperature must be 0"),
        Case("--temperature 1e-45 (overflows logits / T)", G + ["--temperature", "1e-45"], 2, "temperature must be 0"),
        Case("--top-p nan", G + ["--top-p", "nan"], 2, "top-p must be in (0, 1]"),
        Case("--top-p 1.5", G + ["--top-p", "1.5"], 2, "top-p must be in (0, 1]"),
        Case("--confidence-threshold nan", G + ["--stop", "confidence", "--confidence-threshold", "nan"], 2,
             "confidence threshold must be a finite number"),
        Case("--decider-threshold nan", G + ["--stop", "decider", "--decider", "{dec}", "--decider-threshold", "nan"],
             2, "--decider-threshold must be a finite number"),
        Case("--device cuda" + (" (CUDA present: runs)" if cuda else " without a CUDA device"),
             G + ["--device", "cuda"], 0 if cuda else 2, "" if cuda else "no CUDA device"),
        Case('registry.json with "latest": null, --stop decider',
             SELF + ["generate-with-deciders", "{w}/deciders_null"] + G[2:] + ["--stop", "decider"], 2,
             "names no latest decider", prepare=null_registry),
        Case("truncated decider model.safetensors", G + ["--stop", "decider", "--decider", "{w}/decider_truncated"],
             2, "corrupt decider weights", prepare=truncate_decider),
        Case("truncated draft model.safetensors", [a.replace("{d}", "{w}/draft_truncated") for a in G], 2,
             "model.safetensors", prepare=truncate_draft, ),
        Case("draft model.safetensors of another shape", [a.replace("{d}", "{w}/draft_mismatched") for a in G], 2,
             "model.safetensors", prepare=mismatch_draft, ),
        Case("retrain: latest moved (a training.decider.fit promoted) during the comparison",
             SELF + ["latest-moved", RETRAIN_CFG, "{w}/retrain/deciders"], 75, "latest is now 'other'",
             prepare=retrain_prepare, left=retrain_left),
        Case("retrain: killed after decision.pending.json, before the registry swap",
             SELF + ["kill-before-swap", RETRAIN_CFG], KILLED, '"promoted": true', prepare=retrain_prepare,
             left=retrain_left, rerun=True),
        Case("retrain: killed after the registry swap, before decision.json",
             SELF + ["kill-after-swap", RETRAIN_CFG], KILLED, '"promoted": true', prepare=retrain_prepare,
             left=retrain_left, rerun=True),
        Case("draft export killed at the directory swap", SELF + ["kill-in-draft-export", "{w}/draft_export"],
             KILLED, "", prepare=draft_export_prepare, left=draft_left),
    ]


def run_case(c: Case, w: Path) -> Row:
    fmt = {"t": str(w / "target"), "d": str(w / "draft"), "dec": str(w / "decider"), "w": str(w)}
    argv = [a.format(**fmt) for a in c.argv]
    if c.prepare:
        c.prepare(w)
    before = snapshot(w)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([PY, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    shown = [ln for ln in p.stderr.splitlines() if ln.strip()]
    if p.returncode == KILLED:
        seen = "(nothing: killed by SIGKILL)"
    else:
        seen = shown[-1] if shown else (p.stdout.strip().splitlines() or [""])[-1]
    seen = seen.replace(str(w), "<work>")
    row = Row(c.name, " ".join(["python", *c.argv]).replace(str(HERE), "tests/support/faults.py"),
              p.returncode, seen, len(shown), "", xfail=c.xfail)
    if p.returncode != c.expect_exit:
        row.problems.append(f"exit {p.returncode}, expected {c.expect_exit}")
    left_now = ""
    if c.left:
        try:
            left_now = c.left(w)
        except AssertionError as e:
            row.problems.append(f"lost: {e}")
    if c.rerun:
        child_mode = argv.index("--child") + 1
        again = subprocess.run([PY, *argv[:child_mode], "plain", *argv[child_mode + 1:]], cwd=ROOT,
                               capture_output=True, text=True, timeout=600, env=env)
        seen_again = (again.stdout.strip().splitlines() or [""])[-1]
        row.seen += f"; re-run: exit {again.returncode}, {seen_again}".replace(str(w), "<work>")
        if again.returncode != 0 or c.expect not in seen_again:
            row.problems.append(f"re-run gave exit {again.returncode}: {again.stderr.strip()[-300:]}")
    elif p.returncode not in (0, KILLED):
        if len(shown) != 1 or not shown[0].startswith("error: ") or c.expect not in shown[0]:
            row.problems.append(f"expected one 'error: ...{c.expect}...' line, got: {p.stderr.strip()[-300:]}")
    if c.left:
        row.left = left_now
        if c.rerun:
            try:
                row.left = f"after the kill: {left_now}. After the re-run: {c.left(w)}"
            except AssertionError as e:
                row.problems.append(f"lost after the re-run: {e}")
    else:
        after = snapshot(w)
        changed = sorted(k for k in before if after.get(k) != before[k])
        row.left = f"inputs unchanged ({len(before)} files), nothing written" if not changed and after == before \
            else f"CHANGED: {changed or sorted(set(after) - set(before))}"
        if changed:
            row.problems.append(f"inputs changed: {changed}")
    return row


def run_all(w: Path) -> list[Row]:
    w.mkdir(parents=True, exist_ok=True)
    build_inputs(w)
    rows = []
    for c in cases():
        rows.append(run_case(c, w))
        print(f"{'ok ' if not rows[-1].problems else 'XF ' if c.xfail else 'BAD'} {c.name}", file=sys.stderr)
    return rows


def markdown(rows: list[Row]) -> str:
    esc = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    out = ["# Fault table", "", "Generated by `python tests/support/faults.py reports/faults.md` (tiny random models, "
           "real CLIs in subprocesses); `tests/ops/test_fault_table.py` asserts every row. Exit -9 = killed by "
           "SIGKILL at the named step (the row then shows the re-run).", "",
           "| case | exit | what the user sees | left on disk | status |", "|---|---|---|---|---|"]
    for r in rows:
        status = "ok" if not r.problems else (f"xfail: {r.xfail}" if r.xfail else "FAIL: " + "; ".join(r.problems))
        out.append(f"| {esc(r.case)} | {r.exit} | `{esc(r.seen)}` | {esc(r.left)} | {esc(status)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[2:])
    import tempfile

    if len(argv) != 1:
        print("usage: python tests/support/faults.py reports/faults.md", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="specstop-faults-") as tmp:
        rows = run_all(Path(tmp))
    out = Path(argv[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(f".{out.name}.tmp")
    tmp_out.write_text(markdown(rows))
    os.replace(tmp_out, out)
    bad = [r for r in rows if r.problems and not r.xfail]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
