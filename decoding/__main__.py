"""`specstop COMMAND [options]` (or `python -m decoding COMMAND`): one entry point for every command; each runs the module users also
run as `python -m MODULE` (same options, same exit codes).

The training commands live in the `training` package, which this one never imports as a library:
they are run by module name, and without the [train] extra they say so in one line.
"""

from __future__ import annotations

import runpy
import sys

COMMANDS = {
    "generate": ("decoding.generate", "generate text (the measured defaults, or a named strategy)"),
    "serve": ("decoding.serve", "an OpenAI-compatible server with batched speculative rounds"),
    "bench": ("decoding.bench", "benchmarks and the suites behind the reports"),
    "collect": ("training.collect", "record decider traces of speculative runs on your prompts"),
    "fit": ("training.fit", "fit a decider on traces (Lightning)"),
    "retrain": ("training.retrain", "collect, fit, gate and promote on new prompts (scheduled)"),
    "distill": ("training.distill", "distil the stand-alone draft towards the target"),
    "redistill": ("training.head.redistill", "continue the feature head on new prompts, behind its gate"),
    "export": ("training.export", "export the head or the draft for vLLM, SGLang or llama.cpp"),
    "demo": ("training.demo", "collect, fit and generate end to end on the embedded pair"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items())
    return f"usage: specstop COMMAND [options]   (specstop COMMAND --help for its options)\n\ncommands:\n{rows}\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = COMMANDS[name][0]
    old = sys.argv
    sys.argv = [f"specstop {name}", *rest]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except ImportError as e:
        if "specstop[train]" not in str(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.argv = old
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
