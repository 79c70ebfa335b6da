"""Benchmarks. Figures are measured here, never hard-coded; noisy shared machines mean
only ratios from ONE run are quoted.

    python -m decoding.bench --config configs/bench.yaml   # every strategy and peer side by side
    python -m decoding.bench --quick --out DIR             # CI smoke: tiny random models, seconds
    python -m decoding.bench --suite engine                # ar vs model.generate, per-round time split
    python -m decoding.bench --suite forward               # one target forward: eager vs packed, per size
    python -m decoding.bench --suite cli                   # a generate call end to end: defaults vs ar
    python -m decoding.bench --suite llama                 # llama.cpp vs our ar / defaults on one GGUF
    python -m decoding.bench --suite context               # defaults vs ar / fixed shapes by cached context
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from decoding import models
from decoding.bench.compare import describe_cpu, log, run_compare, write_report
from decoding.bench.config import BenchConfig, StrategySpec, load_config
from decoding.bench.engine_suite import engine_markdown, engine_suite, random_draft  # noqa: F401  (public helpers)
from decoding.bench.oracle import require_replay
from decoding.bench.quick import quick_config
from decoding.bench.report import write_atomic
from decoding.options import add_option


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m decoding.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(ap, "suite", default="compare")
    add_option(ap, "clients", several=True, default=[1, 2, 4, 8])
    add_option(ap, "config", default="configs/bench.yaml")
    add_option(ap, "quick")
    add_option(ap, "out", unset="the config's out; engine: reports/engine")
    add_option(ap, "target", unset="the config's")
    add_option(ap, "draft", unset="the config's")
    add_option(ap, "decider", unset="the config's; 'none': no decider")
    ap.add_argument("--row", action="append", default=None, metavar="NAME",
                    help="run only this row of the config (repeatable; ar always runs)")
    ap.add_argument("--oracle-traces", default=None, help="trace dir for the oracle-stop bound")
    add_option(ap, "prompts", unset="the config's prompts_per_set")
    add_option(ap, "max_new_tokens", unset="the config's")
    ap.add_argument("--temperatures", default=None, help="override temperatures, e.g. 0 or 0,0.7")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tokens/s vs tree size sweep")
    add_option(ap, "repeats", unset="the config's; engine suite: 3")
    add_option(ap, "threads")
    add_option(ap, "dtype", only=("auto", "float32", "bfloat16"), unset="the config's")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="engine / forward suites: dtypes")
    ap.add_argument("--forward-threads", default="1,2", help="forward suite: torch thread counts")
    ap.add_argument("--forwards", default="eager,packed",
                    help="forward suite: eager, packed, lean, compiled (a torch.compile probe over a static "
                         "cache); packed/torch, lean/torch: without decoding.forward.kernels; lean/sdpa: "
                         "torch's attention ($SPECSTOP_BATCH_INVARIANT=0)")
    ap.add_argument("--context", type=int, default=200, help="forward suite: cached tokens before the forward")
    ap.add_argument("--sizes", default="1,2,4,8,16", help="forward suite: new tokens per forward")
    add_option(ap, "new_tokens", default=64)
    ap.add_argument("--duration", type=float, default=None,
                    help="serve-load suite: seconds after which the clients send no more (default: their --prompts)")
    add_option(ap, "llama_server")
    ap.add_argument("--serve-log", choices=("prompts", "responses"), default=None,
                    help="serve suite: also the row `ours, joint, logged KEEP` (--log-prompts on, keeping KEEP)")
    ap.add_argument("--head-gguf", default=None, help="llama suite: a head GGUF (python -m training.export "
                    "--format gguf) for the row llama.cpp + head")
    ap.add_argument("--candidate-draft", default=None, metavar="DIR",
                    help="llama suite: a head directory for the row `candidate` (our default with that head, interleaved)")
    ap.add_argument("--candidate-gate", default=None, choices=("request", "context"),
                    help="llama suite: the row `candidate` drafts with this gate (context: the head's first catch-up "
                         "on its whole window, as that gate ran)")
    ap.add_argument("--contexts", default="100,600,1200,2400", help="context suite: tokens a prompt is padded to")
    ap.add_argument("--variants", default=None, help="context suite: rows to run (default: context_suite.VARIANTS)")
    ap.add_argument("--write-defaults", nargs="?", const="", default=None, metavar="PATH",
                    help="record this run's fastest lossless greedy row as a defaults entry in the report's own "
                         "defaults.yaml, or in PATH (the package's file: make defaults REPORT=DIR)")
    return ap


def _check_defaults_path(path: str) -> None:
    from decoding.defaults import DEFAULTS_PATH

    if path and Path(path).resolve() == DEFAULTS_PATH.resolve():
        raise ValueError("--write-defaults: a bench run never rewrites the package's defaults.yaml; "
                         "keep the report, then `make defaults REPORT=DIR` (decoding.bench.pick_defaults)")


def _write_defaults(results: dict, cfg: BenchConfig, out: Path, path: str) -> None:
    """This run's pick into PATH, or into the report's own defaults.yaml (the package's file with
    this kind's entry replaced, as the GPU suite writes it)."""
    from decoding.bench.pick_defaults import pick_best, write_defaults
    from decoding.defaults import DEFAULTS_PATH, run_kind

    entry = pick_best(results, source=str(out / "results.json"))
    kind = run_kind(cfg.device, entry["dtype"])
    if not path:
        path = out / "defaults.yaml"
        path.write_text(DEFAULTS_PATH.read_text())
    written = write_defaults(entry, kind, path)
    log(f"defaults for {kind} in {written}: {entry['strategy']} ({entry['source']})")


def _select_rows(specs: list[StrategySpec], want: list[str]) -> list[StrategySpec]:
    """The config's rows named in `want`, in config order (ar, the reference, always kept)."""
    known = {s.name for s in specs}
    unknown = [n for n in want if n not in known]
    if unknown:
        raise ValueError(f"--row: no row named {', '.join(map(repr, unknown))} in the config "
                         f"(rows: {', '.join(s.name for s in specs)})")
    return [s for s in specs if s.strategy == "ar" or s.name in want]


def _apply_overrides(cfg: BenchConfig, a) -> BenchConfig:
    for key, val in (("target", a.target), ("draft", a.draft), ("decider", a.decider),
                     ("prompts_per_set", a.prompts), ("max_new_tokens", a.max_new_tokens),
                     ("repeats", a.repeats), ("threads", a.threads), ("dtype", a.dtype)):
        if val is not None:
            setattr(cfg, key, val)
    if a.decider == "none":
        cfg.decider = None
    if a.row:
        cfg.strategies = _select_rows(cfg.strategies, a.row)
    if a.oracle_traces:
        cfg.oracle.traces = a.oracle_traces
    if a.temperatures:
        try:
            cfg.temperatures = [float(t) for t in a.temperatures.split(",")]
        except ValueError:
            raise ValueError(f"--temperatures: not a list of numbers: {a.temperatures}") from None
    if a.no_sweep:
        cfg.sweep.enabled = False
    cfg.validate()
    return cfg


def _engine_main(a) -> int:
    if a.threads:
        torch.set_num_threads(a.threads)
    results = [engine_suite(d, a.new_tokens, a.repeats or 3) for d in a.dtypes.split(",")]
    out = Path(a.out or "reports/engine")
    write_atomic(out / "results.json", json.dumps(results, indent=2))
    md = engine_markdown(results, a.new_tokens)
    write_atomic(out / "results.md", md)
    print(md)
    return 0


def _forward_main(a, command: str) -> int:
    from decoding.bench.forward import forward_markdown, forward_suite

    threads = [int(t) for t in a.forward_threads.split(",")]
    res = forward_suite(a.dtypes.split(","), forwards=a.forwards.split(","), threads=threads, context=a.context,
                        repeats=a.repeats or 15, sizes=tuple(int(n) for n in a.sizes.split(",")))
    res["command"] = command
    return _write_suite(a, "forward", res, forward_markdown(res, command))


def _cli_main(a, command: str) -> int:
    from decoding.bench.cli_suite import cli_markdown, cli_suite

    res = cli_suite(a.prompts or 4, a.new_tokens, a.repeats or 3, a.threads, progress=log)
    res["command"] = command
    res["cpu"] = describe_cpu()
    return _write_suite(a, "cli", res, cli_markdown(res, command, res["cpu"]))


def _llama_main(a, command: str) -> int:
    from decoding.bench.llama import llama_markdown, llama_suite

    res = llama_suite(a.prompts or 6, a.new_tokens, a.threads or 1, a.llama_server, a.target, a.head_gguf,
                      a.candidate_draft, a.candidate_gate, progress=log)
    res["command"] = command
    return _write_suite(a, "llama", res, llama_markdown(res) + f"\nCommand: `{command}`\n")


def _context_main(a, command: str) -> int:
    from decoding.bench.context_suite import context_markdown, context_suite

    res = context_suite([int(c) for c in a.contexts.split(",")], a.prompts or 4, a.new_tokens, a.repeats or 2,
                        a.threads or 2, a.target, a.variants.split(",") if a.variants else None, progress=log)
    res["command"] = command
    return _write_suite(a, "context", res, context_markdown(res, command))


def _write_suite(a, name: str, res: dict, md: str) -> int:
    out = Path(a.out or f"reports/{name}-{time.strftime('%Y-%m-%d')}")
    write_atomic(out / "results.json", json.dumps(res, indent=2))
    write_atomic(out / "results.md", md)
    print(md)
    return 0


def _serve_main(a, command: str) -> int:
    from decoding.bench.serve_suite import main as serve_main

    return serve_main(a, command, log)


def _serve_load_main(a, command: str) -> int:
    from decoding.bench.serve_load import main as load_main

    return load_main(a, command, log)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parser().parse_args(argv)
    command = "python -m decoding.bench " + " ".join(argv)
    try:
        side = {"engine": lambda: _engine_main(a), "forward": lambda: _forward_main(a, command),
                "cli": lambda: _cli_main(a, command), "llama": lambda: _llama_main(a, command),
                "context": lambda: _context_main(a, command),
                "serve": lambda: _serve_main(a, command), "serve-load": lambda: _serve_load_main(a, command)}
        if a.suite != "compare" and (a.quick or a.write_defaults is not None):
            raise ValueError("--quick and --write-defaults belong to the compare suite")
        if a.suite in side:
            return side[a.suite]()
        if a.suite == "dtype":
            from decoding.bench.dtype import dtype_main

            out = Path(a.out or f"reports/dtype-{time.strftime('%Y-%m-%d')}")
            print(dtype_main(_apply_overrides(load_config(a.config), a), out, command))
            return 0
        if a.quick:
            root = Path(tempfile.mkdtemp(prefix="specstop-bench-quick-"))
            cfg = _apply_overrides(quick_config(root, a.oracle_traces), a)
            out = Path(a.out) if a.out else root / "report"
        else:
            cfg = _apply_overrides(load_config(a.config), a)
            out = Path(a.out or cfg.out.format(date=time.strftime("%Y-%m-%d")))
        if a.write_defaults is not None:
            _check_defaults_path(a.write_defaults)  # refused before the (long) run
        require_replay(cfg.oracle)
        results = run_compare(cfg, command)
        md = write_report(results, out)
        if a.write_defaults is not None:
            _write_defaults(results, cfg, out, a.write_defaults)
    except (models.ModelError, ValueError, FileNotFoundError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(md)
    log(f"wrote {out}/ ({', '.join(results['meta']['files'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

