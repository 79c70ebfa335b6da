"""Python API: load a target/draft pair (+ decider) once, then generate or stream.

    from decoding import Decoder

    dec = Decoder.load()                      # shipped pair, measured-best defaults (defaults.yaml)
    res = dec.generate("Write a haiku about rain.", chat=True, max_new_tokens=64)
    print(res.text, res.stats["tokens_per_s"])
    for piece in dec.stream("Tell me a story.", chat=True):
        print(piece, end="", flush=True)

`target` / `draft` are model directories or already-loaded Hugging Face causal LMs (then pass
`tokenizer=`; they are used in the dtype and on the device they are in; a specstop stand-alone
draft loaded by plain transformers drafts with its recorded pruned head, as from its directory). Options left None come
from `decoding/defaults.yaml` for the shipped pair on this device kind, else its `other-pairs`
entry, as a whole and only when no strategy or shape is named: `strategy="sd", gamma=3` is sd
g3 at fixed depth, whatever the defaults' stop rule. Every bad input raises ValueError (decoding.models.ModelError for models) with one clear line.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path

from decoding import defaults as dflt
from decoding.defaults import is_shipped_pair  # noqa: F401 (re-exported)
from decoding.forward import gguf
from decoding.kv_cache import set_kv_dtype
from decoding.models.pair import check_pair
from decoding.models.session import Session
from decoding.models.weights import load_tokenizer
from decoding.sampling import SamplingConfig
from decoding.stopping import GROW
from decoding.stopping.gate import DraftGate
from decoding.strategies import StrategyConfig, build_engine

_STRATEGY_KEYS = {f.name for f in fields(StrategyConfig)}


@dataclass
class GenerationResult:
    text: str
    """Decoded new text (special tokens skipped)."""
    token_ids: list[int]
    """New token ids (the prompt excluded)."""
    stats: dict
    """RunStats.to_dict(): tokens/s, block efficiency, acceptance, time split, ..."""
    prompt_ids: list[int]
    """The prompt as the target saw it (chat template applied)."""


def _as_text(x) -> str:
    return str(x) if isinstance(x, (str, Path)) else type(x).__name__


class Decoder:
    """A loaded pair with one strategy; `variant(...)` shares the models with other options."""

    def __init__(self, session: Session, config: StrategyConfig, decider=None, decider_rule=None,
                 decider_threshold=None, defaults: dflt.Defaults | None = None):
        self.session = session
        self.config = config
        self.defaults = defaults
        """The defaults entry the unset options came from."""
        self._decider = (decider, decider_rule, decider_threshold)
        self._stop = None
        if config.strategy != "ar" and session.draft is None:
            raise ValueError(f"strategy {config.strategy} needs a draft model")
        if config.stop == "decider" and config.strategy != "ar":  # load and check it now, not mid-run
            self._stop = session.decider_stop(decider, decider_rule, decider_threshold, config)
        elif config.stop == "confidence" and config.confidence_rule == GROW and config.strategy != "ar":
            self._stop = session.grow_policy(config, decider)  # the cost model comes with a decider
        self._engines: dict[SamplingConfig, object] = {}
        self.last_result: GenerationResult | None = None
        """The result of the last stream() that ran to the end."""

    @classmethod
    def load(cls, target=None, draft=None, decider=None, *, tokenizer=None, draft_tokenizer=None,
             dtype: str | None = None, device: str = "cpu", strategy: str | None = None,
             decider_rule: str | None = None, decider_threshold: float | None = None,
             defaults_file=None, forward: str | None = None, kv_dtype: str | None = None, **options) -> Decoder:
        """Load once. options: StrategyConfig fields (gamma, k_config, width, depth, mode,
        replacement, stop, confidence_threshold, confidence_rule); unset ones come from the
        defaults entry when neither `strategy` nor a shape (gamma, k_config, width, depth) is
        given, else from the strategy's own built-in values (fixed depth unless `stop` is set). decider: checkpoint dir or 'latest' (used when stop is 'decider').
        forward: eager | packed | lean (decoding.forward.packed; None: packed.default_forward)
        for models loaded here; kv_dtype: float16 stores the target's KV cache so
        (decoding.kv_cache.set_kv_dtype: half the bytes a step's attention reads)."""
        bad = set(options) - _STRATEGY_KEYS
        if bad:
            raise TypeError(f"unknown option(s): {', '.join(sorted(bad))}")
        d = dflt.defaults_for(device, is_shipped_pair(target, draft), defaults_file)
        given_strategy = strategy
        cfg = dflt.strategy_config(d, strategy, options)  # validated before the (slow) model load
        if isinstance(target, (str, Path)) or target is None:
            # a GGUF target whose blocks the kernel takes runs them in float32 (decoding.forward.quant)
            sess = Session.open(target, draft, dtype or ("auto" if gguf.runs_quantized(target, device)
                                                         else d.dtype), device,
                                need_draft=given_strategy not in (None, "ar"), forward=forward,
                                kv_dtype=kv_dtype)
        else:
            if dtype is not None:
                raise ValueError("dtype applies to models loaded from directories: convert loaded models "
                                 "yourself (model.to(dtype))")
            sess = _session_from_models(target, draft, tokenizer, draft_tokenizer)
            set_kv_dtype(sess.target, kv_dtype)
        sess.cost_cache = True  # a grown tree's measured cost curve is timed once per machine
        if given_strategy is None and sess.draft is None:
            cfg = replace(cfg, strategy="ar")  # no draft shipped or given: plain decoding
        if d.decider_rule and decider_rule is None and cfg.stop == "decider" \
                and not dflt.names_strategy(strategy, options):
            decider_rule = d.decider_rule
        return cls(sess, cfg, decider, decider_rule, decider_threshold, d)

    def variant(self, strategy: str | None = None, **options) -> Decoder:
        """Another strategy / stop policy on the same loaded models (decider options included)."""
        dec = {k: options.pop(k) for k in ("decider", "decider_rule", "decider_threshold") if k in options}
        cfg = replace(self.config, **({"strategy": strategy} if strategy else {}),
                      **{k: v for k, v in options.items() if v is not None})
        old = dict(zip(("decider", "decider_rule", "decider_threshold"), self._decider))
        return Decoder(self.session, cfg, **{**old, **dec}, defaults=self.defaults)

    def default_variant(self, **overrides) -> Decoder:
        """The defaults entry's configuration (`self.defaults`) on the same loaded models; e.g.
        after `Decoder.load(strategy="ar")`, the default beside plain decoding."""
        d = self.defaults or dflt.Defaults()
        opts = {k: getattr(d, k) for k in _STRATEGY_KEYS} | {"decider_rule": d.decider_rule}
        return self.variant(**{**opts, **overrides})

    def with_draft(self, draft) -> Decoder:
        """This configuration on the same loaded target with another draft directory, checked
        against it (Session.with_draft): how a benchmark runs two heads in one interleaved run."""
        return Decoder(self.session.with_draft(draft), self.config, *self._decider, defaults=self.defaults)

    def warm_up(self, prompt: str = "Hello", max_new_tokens: int = 8, chat: bool = True) -> None:
        """One short request for the kernels, caches and cost curve (timed once per machine), whose
        rounds the draft gate then forgets: a benchmark's first measured request meets the gate a
        new process would. (An 8-token reply to "Hello" commits ~1.25 tokens a drafted round, and
        its rounds alone held the gate shut at short contexts.)"""
        self.generate(prompt, max_new_tokens, chat=chat)
        stops = [self._stop, *(getattr(e, "stop", None) for e in self._engines.values())]
        for stop in {id(s): s for s in stops if isinstance(getattr(s, "gate", None), DraftGate)}.values():
            stop.gate = stop.gate.fresh()

    @property
    def tokenizer(self):
        return self.session.tokenizer

    def engine(self, sampling: SamplingConfig):
        """The engine for these sampling settings (built once; the decider is loaded once)."""
        if sampling not in self._engines:
            s = self.session
            self._engines[sampling] = build_engine(s.target, s.draft, self.config, sampling, self._stop)
        return self._engines[sampling]

    def prompt_ids(self, prompt, chat: bool = False, max_new_tokens: int = 128) -> list[int]:
        """Token ids of a text prompt (chat template optional) or a checked list of ids."""
        depth = len(self.config.k_levels)
        if isinstance(prompt, str):
            return self.session.encode(prompt, chat=chat, max_new_tokens=max_new_tokens, tree_depth=depth)
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise ValueError("prompt must be a string or a sequence of token ids") from None
        if not ids:
            raise ValueError("empty prompt")
        vocab = self.session.target.get_output_embeddings().weight.shape[0]
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        self.session.check_length(ids, max_new_tokens, depth)
        return ids

    def _prepare(self, prompt, max_new_tokens, temperature, top_p, chat):
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1 (got {max_new_tokens!r})")
        return SamplingConfig(temperature, top_p), self.prompt_ids(prompt, chat, max_new_tokens)

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, chat: bool = False, on_text=None) -> GenerationResult:
        """Generate up to max_new_tokens (stops at EOS). prompt: text or token ids. temperature
        0 is greedy. on_text(piece) is called with newly committed text after each round."""
        sampling, ids = self._prepare(prompt, max_new_tokens, temperature, top_p, chat)
        push = self.session.streamer(_Writer(on_text)) if on_text else None
        out, stats = self.engine(sampling).generate(ids, max_new_tokens, self.session.eos_token_id, seed, push)
        return GenerationResult(self.tokenizer.decode(out, skip_special_tokens=True), out,
                                stats.to_dict(), ids)

    def stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, chat: bool = False) -> Iterator[str]:
        """Yield text pieces as rounds commit (arguments as generate); the full result is then
        in `self.last_result`. Bad input raises here, before the first piece."""
        self._prepare(prompt, max_new_tokens, temperature, top_p, chat)
        return self._stream(prompt, dict(max_new_tokens=max_new_tokens, temperature=temperature,
                                         top_p=top_p, seed=seed, chat=chat))

    def _stream(self, prompt, kwargs) -> Iterator[str]:
        # generation runs in a worker thread so the engine loop stays the one loop; the
        # consumer leaving early makes the next callback raise, which ends the worker
        q: queue.Queue = queue.Queue()
        stop = threading.Event()
        done = object()

        def on_text(piece):
            if stop.is_set():
                raise _Cancelled
            if piece:
                q.put(piece)

        def work():
            try:
                q.put((done, self.generate(prompt, on_text=on_text, **kwargs)))
            except _Cancelled:
                q.put((done, None))
            except BaseException as e:  # handed to the consumer
                q.put((done, e))

        self.last_result = None
        t = threading.Thread(target=work, daemon=True)
        t.start()
        shown = 0
        try:
            while True:
                item = q.get()
                if isinstance(item, tuple) and item[0] is done:
                    if isinstance(item[1], BaseException):
                        raise item[1]
                    self.last_result = item[1]
                    break
                shown += len(item)
                yield item
            if self.last_result is not None and len(self.last_result.text) > shown:
                yield self.last_result.text[shown:]  # a trailing partial character
        finally:
            stop.set()
            t.join()


class _Cancelled(Exception):
    pass


class _Writer:
    """File-like adapter for Session.streamer."""

    def __init__(self, fn):
        self.write, self.flush = fn, lambda: None


def load_decoder(args) -> Decoder:
    """The Decoder parsed command-line flags name (generate and serve; checked first by
    decoding.defaults.check_options): threads set, models loaded once."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    return Decoder.load(args.target, args.draft, args.decider, dtype=args.dtype, device=args.device,
                        forward=args.forward, kv_dtype=args.kv_dtype, strategy=args.strategy,
                        decider_rule=args.decider_rule, decider_threshold=args.decider_threshold,
                        **dflt.strategy_options(args))


def _session_from_models(target, draft, tokenizer, draft_tokenizer) -> Session:
    """A Session over already-loaded models; the pair is checked as Session.open checks it."""
    for m, what in ((target, "target"), (draft, "draft")):
        if m is not None and not hasattr(m, "get_output_embeddings"):
            raise ValueError(f"{what} must be a model directory or a loaded Hugging Face causal LM "
                             f"(got {_as_text(m)})")
    if isinstance(draft, (str, Path)):
        raise ValueError("pass target and draft the same way: both directories or both loaded models")
    if tokenizer is None:
        raise ValueError("a loaded target model needs tokenizer= (its tokenizer object or directory)")
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)
    if isinstance(draft_tokenizer, (str, Path)):
        draft_tokenizer = load_tokenizer(draft_tokenizer)
    target.eval()
    if draft is not None:
        from decoding.drafts.pruned import with_recorded_head

        # a stand-alone draft loaded by plain transformers drafts with the head its directory
        # records, as when loaded from that directory (same fingerprint, same deciders)
        draft = with_recorded_head(draft.eval())
        check_pair(target, draft, tokenizer, draft_tokenizer or tokenizer)
    return Session(target, draft, tokenizer, None, None)
