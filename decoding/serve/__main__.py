"""`python -m decoding.serve`: an OpenAI-compatible server over continuous batching of
speculative rounds (decoding.batch). The models load once; every round drafts each active
request's tree and verifies all of them in one target forward.

    python -m decoding.serve --port 8000 [--target ... --draft ... --decider ...] [--budget joint]
    curl localhost:8000/v1/completions -d '{"model": "specstop", "prompt": "Hi", "max_tokens": 32}'
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from decoding.batch.prefill import parse_chunk
from decoding.defaults import check_options
from decoding.options import add_option, add_options, add_strategy_args
from decoding.serve.traffic_log import KEEP, LogConfig, TrafficLog
from decoding.serve.worker import batch_engine  # noqa: F401 (the server's engine; tests build it here)

BUDGETS = ("joint", "joint-always", "independent")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m decoding.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model-name", default="specstop", help="the `model` clients name (and /v1/models lists)")
    add_options(ap, "target", "draft")
    add_strategy_args(ap)
    ap.add_argument("--budget", choices=BUDGETS, default="joint",
                    help="joint: one grow budget spends each round's rows across the requests "
                         "(decoding.batch.budget), and a round drafts at all only while drafted rounds "
                         "have measured faster at that many requests (decoding.batch.measured; a round of one "
                         "request always drafts, as the batch-1 engine does); "
                         "joint-always: the budget every round; independent: each request sizes its own tree")
    ap.add_argument("--max-batch", type=int, default=8, help="most requests in one round")
    ap.add_argument("--max-queue", type=int, default=64, help="most requests waiting (more: 503)")
    ap.add_argument("--prefill-chunk", default="auto",
                    help="prompt tokens a request feeds a round at most, so a long prompt goes in over several "
                         "rounds beside the running streams instead of stalling them: auto sizes each round's "
                         "chunk by measured time (--prefill-stall; the whole rest of the prompt, up to 512, "
                         "when no stream runs); N: at most N tokens a round; 0: whole prompts (docs/server.md)")
    ap.add_argument("--prefill-stall", type=float, default=1.5,
                    help="with --prefill-chunk auto: a round carrying prompt rows aims at most this many times "
                         "the running streams' round without (> 1; lower: smoother streams, a long prompt's "
                         "first token later)")
    ap.add_argument("--prefill-whole", type=int, default=256,
                    help="with --prefill-chunk auto: a prompt of at most this many tokens goes in whole, in one "
                         "round (0: every prompt is sized by time)")
    ap.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGTERM / SIGINT: seconds the requests in flight get to finish (new ones: 503); "
                         "those still running then end with an error event")
    ap.add_argument("--reload-interval", type=float, default=5.0,
                    help="seconds between checks for a promoted decider (the registry's latest that --decider "
                         "resolves to, with --stop decider) or head (the --draft directory replaced); what changed "
                         "loads between rounds, is checked against the pair, and serves requests admitted after "
                         "it, while requests in flight finish on their models; a failed load keeps the old "
                         "(0: never; docs/server.md, Reloading)")
    ap.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    log = ap.add_argument_group("traffic logging (off unless --log-prompts; docs/server.md)")
    log.add_argument("--log-prompts", metavar="DIR", default=None,
                     help="record sampled requests in DIR as rows `python -m training.retrain` reads "
                          "(rotated files traffic-*.jsonl; no client addresses, headers or keys)")
    log.add_argument("--log-keep", choices=KEEP, default="prompts",
                     help="prompts: the request only; responses: also the generated text")
    log.add_argument("--log-sample-rate", type=float, default=1.0, help="share of requests logged, in (0, 1]")
    log.add_argument("--log-rotate-mb", type=float, default=64.0, help="hand the open file over at this size")
    log.add_argument("--log-rotate-minutes", type=float, default=60.0,
                     help="... or when its first row is this old")
    add_option(ap, "dtype", only=("float32", "bfloat16"))
    add_options(ap, "device", "forward", "kv_dtype", "threads")
    # generate's checks read these
    ap.set_defaults(temperature=0.0, top_p=1.0, max_new_tokens=1)
    return ap


def traffic_log(args) -> TrafficLog | None:
    """The --log-* options as a (not yet started) TrafficLog; None without --log-prompts."""
    cfg = LogConfig(args.log_prompts or "", args.log_keep, args.log_sample_rate, args.log_rotate_mb,
                    args.log_rotate_minutes)
    cfg.check()  # even when off: a bad value is a mistake either way
    return TrafficLog(cfg) if args.log_prompts else None


def serve(decoder, args, log: TrafficLog | None = None) -> None:
    import uvicorn

    from decoding.serve.app import Served, create_app
    from decoding.serve.worker import EngineWorker

    s = decoder.session
    eos = s.eos_token_id
    limit = getattr(s.target.config, "max_position_embeddings", None) or 1 << 20
    chunk = parse_chunk(args.prefill_chunk, args.prefill_stall, whole=args.prefill_whole)
    worker = EngineWorker(batch_engine(decoder, args.budget, chunk), args.max_batch, args.max_queue)
    attach_reloader(worker, decoder, args.budget, args.reload_interval)
    served = Served(args.model_name, s.tokenizer, limit - len(decoder.config.k_levels) - 1,
                    tuple([eos] if isinstance(eos, int) else eos or ()), args.default_max_tokens, log)
    server = uvicorn.Server(uvicorn.Config(create_app(served, worker), host=args.host, port=args.port,
                                           log_level="warning", timeout_graceful_shutdown=args.drain_timeout + 5))

    def http() -> None:
        try:
            server.run()
        finally:
            worker.stop()  # the HTTP side ended (or never started): so does the engine

    def shut(*_) -> None:  # drain: uvicorn stops accepting and waits for the streams the worker finishes
        worker.drain(args.drain_timeout)
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, shut)
    front = threading.Thread(target=http, name="specstop-http", daemon=True)
    front.start()
    print(f"serving {args.model_name} ({decoder.config.name}, budget {args.budget}) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr)
    del s  # a reload swaps the session's draft out: nothing here may keep the old one alive
    try:
        worker.run()  # on this thread, the one that loaded the model (decoding.serve.worker says why)
        server.should_exit = True
        front.join(30)
    finally:
        if log is not None:  # after the last stream ended: its rows are in the file handed over
            log.close()
    if not server.started:
        raise ValueError(f"could not serve on {args.host}:{args.port} (uvicorn's message above)")


def attach_reloader(worker, decoder, budget: str, interval: float) -> None:
    """Watch the checkpoints a speculative engine was loaded from (decoding.serve.reload); plain
    decoding has nothing to swap."""
    from decoding.serve.reload import Reloader

    if worker.engine.draft is not None:
        worker.seam = Reloader(decoder, worker.engine, budget, interval)


def check_port(host: str, port: int) -> None:
    """ValueError unless `host:port` can be listened on now."""
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise ValueError(f"could not serve on {host}:{port} ({e.strerror or e})") from None


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        check_options(args)
        if args.max_batch < 1 or args.max_queue < 0 or args.drain_timeout < 0:
            raise ValueError("--max-batch must be >= 1, --max-queue and --drain-timeout >= 0")
        if not 1 < args.prefill_stall < float("inf"):
            raise ValueError(f"--prefill-stall must be a number > 1 (got {args.prefill_stall})")
        if args.prefill_whole < 0:
            raise ValueError(f"--prefill-whole must be >= 0 (got {args.prefill_whole})")
        parse_chunk(args.prefill_chunk, args.prefill_stall, whole=args.prefill_whole)
        if not args.reload_interval >= 0:
            raise ValueError(f"--reload-interval must be >= 0 (got {args.reload_interval})")
        log = traffic_log(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from decoding.api import load_decoder
    from decoding.models.errors import ModelError
    from decoding.serve.faults import install

    install()  # a no-op unless $SPECSTOP_FAULT_SEED is set (load tests)

    try:
        check_port(args.host, args.port)  # before the models load: a taken port should not cost that wait
        if log is not None:
            log.start()  # an unwritable DIR fails here, before the models load
        serve(load_decoder(args), args, log)
    except (ModelError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
