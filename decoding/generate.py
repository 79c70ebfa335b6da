"""CLI: generate text with a speculative strategy.

    python -m decoding.generate --prompt "..." [--chat] [--strategy ar|sd|mcsd|ti-mcsd] ...

Without --json the text streams to stdout and a stats line goes to stderr; with --json one
object {"text", "token_ids", "stats"} is printed. Batch size is 1. A thin layer over the
Python API (decoding.Decoder).
"""

from __future__ import annotations

import argparse
import json
import sys
from decoding import defaults as dflt
from decoding.options import add_option, add_options, add_strategy_args


def defaults_help() -> str:
    """Where the unset options come from (shown in --help)."""
    try:
        kind = dflt.device_kind("cpu")
        d, other = dflt.defaults_for("cpu", True), dflt.defaults_for("cpu", False)
    except ValueError as e:
        return f"defaults: {e}"
    return (f"Defaults of the options marked (*): the measured-best lossless configuration for the shipped pair,\n"
            f"recorded per device kind in decoding/defaults.yaml (rewritten by\n"
            f"make defaults REPORT=DIR). On this machine's CPU ({kind}): {d.describe()}\n"
            f"  from {d.source}\n"
            f"Another target or draft (not measured): {other.describe()}.\n"
            f"The defaults apply only when you name neither --strategy nor a shape (--gamma, --k-config,\n"
            f"--width, --depth). A named strategy runs as named, with its own built-in values for what\n"
            f"you leave unset (stop: fixed depth unless --stop is given); --dtype still defaults as above.")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m decoding.generate", description=__doc__,
                                 epilog=defaults_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(ap, "prompt", required=True)
    ap.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    add_options(ap, "target", "draft")
    add_strategy_args(ap)
    add_options(ap, "temperature", "top_p", "seed")
    add_option(ap, "max_new_tokens", default=128)
    add_option(ap, "dtype", only=("float32", "bfloat16"))
    add_options(ap, "device", "forward", "kv_dtype", "threads")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        dflt.check_options(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from decoding.api import load_decoder
    from decoding.models.errors import ModelError

    try:
        dec = load_decoder(args)
        on_text = None if args.json else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
        res = dec.generate(args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed,
                           chat=args.chat, on_text=on_text)
    except (ModelError, ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    d = res.stats
    if args.json:
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": d}))
    else:
        print()
        print(f"[{d['strategy']}] {d['new_tokens']} tokens in {d['wall_s']:.2f}s = {d['tokens_per_s']} tok/s; "
              f"block efficiency {d['block_efficiency']}, acceptance {d['acceptance_rate']}, "
              f"target calls {d['target_calls']}, lossless={d['lossless']}", file=sys.stderr)
    if d.get("past_trained_window"):
        print(f"note: the draft head was trained on rows of up to {d['trained_window']} tokens and this context "
              f"reached {d['context_tokens']}: past its window its acceptance may fall (the output does not "
              "change)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
