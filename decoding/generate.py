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
from decoding.options import ALL_FORWARDS, add_strategy_args


def defaults_help() -> str:
    """Where the unset options come from (shown in --help)."""
    try:
        kind = dflt.device_kind("cpu")
        d, other = dflt.defaults_for("cpu", True), dflt.defaults_for("cpu", False)
    except ValueError as e:
        return f"defaults: {e}"
    return (f"Defaults of the options marked (*): the measured-best lossless configuration for the shipped pair,\n"
            f"recorded per device kind in decoding/defaults.yaml (rewritten by\n"
            f"python -m decoding.bench --write-defaults). On this machine's CPU ({kind}): {d.describe()}\n"
            f"  from {d.source}\n"
            f"Another target or draft (not measured): {other.describe()}.\n"
            f"The defaults apply only when you name neither --strategy nor a shape (--gamma, --k-config,\n"
            f"--width, --depth). A named strategy runs as named, with its own built-in values for what\n"
            f"you leave unset (stop: fixed depth unless --stop is given); --dtype still defaults as above.")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m decoding.generate", description=__doc__,
                                 epilog=defaults_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", required=True, help="prompt text")
    ap.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    ap.add_argument("--target", default=None, help="target HF model dir (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", default=None, help="draft HF model dir (default: the shipped draft, if any)")
    add_strategy_args(ap)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="(*) bfloat16 on CUDA, a CPU with AMX, or one with AVX512-BF16 and the packed forward; float32 elsewhere (measured faster there)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--forward", choices=ALL_FORWARDS, default=None,
                    help="how the models compute: lean (Llama-family layers as a few fused ops over "
                         "prepacked weights, decoding.forward.lean; packed for other layers), packed "
                         "(oneDNN-prepacked linears, decoding.forward.packed), eager (as loaded, the "
                         "reference), static (eager over a preallocated KV cache in bucketed sizes) or graph "
                         "(static, captured as CUDA graphs: CUDA only, decoding.forward.static); default: $SPECSTOP_FORWARD, else the fastest measured here")
    ap.add_argument("--kv-dtype", choices=("float32", "float16"), default=None,
                    help="store the target's KV cache as float16 (a float32 target on the lean forward with "
                         "the CPU kernels: half the bytes its attention reads, llama.cpp's default KV type; "
                         "the math stays float32)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's; on a busy machine fewer threads than "
                         "cores avoids oversubscription, which can slow decoding many times over)")
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
