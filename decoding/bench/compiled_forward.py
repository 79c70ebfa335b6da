"""A probe of a candidate faster forward: the target under torch.compile
(inductor, frozen weights: constants folded and linears prepacked) over a static KV cache, one
graph per forward size (`python -m decoding.bench --suite forward --forwards eager,packed,compiled`).

Measured before it is built into the engine: the forward suite times it beside eager and packed
at each size (the same tree rows against the same context), with its compile time. It is not
an engine forward: the engine's cache grows and is cut back each round (decoding.kv_cache), which
under torch.compile recompiles per shape; a static cache needs slot bookkeeping and a mask over
its whole length, so this probe pays attention over `context + max size` slots at every size.
"""

from __future__ import annotations

import time

import torch


class CompiledForward:
    """Same interface as forward._Forward: prepare(n) -> layout, call(n, layout) -> logits [n, V],
    time(n) -> ms; the cache holds the context but its last token, as there."""

    def __init__(self, model, vocab: int, context: int, max_new: int = 16):
        import torch._inductor.config as inductor
        from transformers import StaticCache

        inductor.freezing = True  # weights as constants: inductor folds and prepacks them
        # one graph per size and model: the default limit (8) would silently fall back to eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.model, self.vocab = model, vocab
        self.prompt = [(10 + i) % vocab for i in range(context)]
        self.slots = context + max_new
        self.cache = StaticCache(config=model.config, max_cache_len=self.slots)
        self.compiled = torch.compile(model, dynamic=False)
        self.compile_s: dict[int, float] = {}
        held = context - 1
        with torch.inference_mode():
            model(input_ids=torch.tensor([self.prompt[:-1]]), past_key_values=self.cache, use_cache=True,
                  cache_position=torch.arange(held))
        self.held = held

    def prepare(self, n: int):
        return n  # the static cache keeps the context; this call's slots are overwritten

    @torch.inference_mode()
    def call(self, n: int, _layout=None) -> torch.Tensor:
        # the pending token and n - 1 siblings under it (forward._Forward's tree, k-config [n - 1]):
        # each sibling sees the context, the pending token and itself
        slots = torch.arange(self.held, self.held + n)
        see = torch.arange(self.slots)[None] <= self.held
        see = see.expand(n, -1).clone()
        see[torch.arange(n), slots] = True
        mask = torch.zeros((1, 1, n, self.slots), dtype=self.model.dtype)
        mask[0, 0][~see] = torch.finfo(self.model.dtype).min
        pos = torch.tensor([self.held] + [self.held + 1] * (n - 1))
        ids = torch.tensor([[self.prompt[-1]] + [(1 + i) % self.vocab for i in range(n - 1)]])
        for layer in self.cache.layers:  # transformers' static layers write at their own counter
            layer.cumulative_length.fill_(self.held)
        t = time.perf_counter()
        out = self.compiled(input_ids=ids, position_ids=pos[None], attention_mask=mask, past_key_values=self.cache,
                            use_cache=True, cache_position=slots, logits_to_keep=n)
        self.compile_s.setdefault(n, time.perf_counter() - t)  # the first call of a size compiles it
        return out.logits[0].float()

    def time(self, n: int) -> float:
        t = time.perf_counter()
        self.call(n)
        return 1000 * (time.perf_counter() - t)

    def profile(self, n: int) -> dict:
        from decoding.bench.profiling import profile_one

        return profile_one(lambda: self.call(n))
