"""The host's side of the device round: SpeculativeEngine's `generate` contract over a DeviceRound,
one round = one call (a CUDA graph replay per (shape, cache columns) on CUDA) and ONE host read,
the new tokens, for EOS, streaming and the next round's column bucket.

Draws come from the device's own generator (`torch.manual_seed(seed)` at the start of a request):
a graph replays them, a CUDA generator of our own could not be.
"""

from __future__ import annotations

import time

import torch

from decoding.round.runner import DeviceRound
from decoding.round.shape import RoundShape
from decoding.run_stats import RunStats
from decoding.sampling import SamplingConfig


class RoundEngine:
    lossless = True
    proposer = None
    observer = None

    def __init__(self, target, head, shape: RoundShape, sampling: SamplingConfig, name: str = "ar",
                 capture: bool | None = None, compiled: bool = False):
        self.runner = DeviceRound(target, head, shape, sampling)
        self.target = self.runner.sc
        self.shape, self.sampling, self.name = shape, sampling, name
        self.capture = self.runner.dev.type == "cuda" if capture is None else capture
        if self.capture and self.runner.dev.type != "cuda":
            raise ValueError("capturing the device round needs a CUDA device")
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.epoch = self.runner.epoch
        self.step = torch.compile(self.runner.round, fullgraph=True, dynamic=False) if compiled else self.runner.round
        self.reads = 0
        """Host reads of device data so far (one a round: the new tokens)."""

    def generate(self, prompt_ids, max_new_tokens: int = 128, eos_token_id=None, seed: int = 0,
                 on_tokens=None) -> tuple[list[int], RunStats]:
        if not prompt_ids:
            raise ValueError("empty prompt")
        torch.manual_seed(seed)
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        stats = RunStats(self.name, True)
        t_start = time.perf_counter()
        out = [self.runner.prefill(list(prompt_ids))]
        stats.add_plain_round(time.perf_counter() - t_start)
        length = len(prompt_ids)
        if on_tokens:
            on_tokens(out[:])
        while len(out) < max_new_tokens and out[-1] not in eos:
            t0 = time.perf_counter()
            self.runner.ensure(length)
            self.run(self.runner.cols_for(length))
            got = self.runner.out.tolist()  # the round's one host read
            self.reads += 1
            n = got[0]
            length += n
            new = got[1:1 + n][: max_new_tokens - len(out)]
            hit = next((i for i, t in enumerate(new) if t in eos), None)
            new = new if hit is None else new[: hit + 1]
            out += new
            stats.add_device_round(self.shape.depth, self.shape.rows - 1, n - 1, len(new), time.perf_counter() - t0)
            if on_tokens and new:
                on_tokens(new)
        stats.wall_s = time.perf_counter() - t_start
        stats.context = len(prompt_ids) + len(out)
        return out, stats

    def run(self, cols: int) -> None:
        """One round: a replay of its graph (captured on first use) or the round's own call."""
        if not self.capture:
            self.step(cols)
            return
        if self.epoch != self.runner.epoch:  # the buffers moved: new graphs, in a new pool (static._ensure)
            self.graphs, self.pool, self.epoch = {}, None, self.runner.epoch
        g = self.graphs.get(cols)
        if g is None:
            g = self.graphs[cols] = self._capture(cols)
        g.replay()

    def _capture(self, cols: int):
        return self.capture_fn(lambda: self.runner.round(cols))

    def capture_fn(self, fn):
        """`fn` (a part of the round, or all of it) captured as a CUDA graph: warmed up on a side
        stream with the state put back after (a round's writes past `length` are scratch the next
        real round overwrites), then captured."""
        state = [t.clone() for t in self._state()]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
                self.restore(state)
        torch.cuda.current_stream().wait_stream(s)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph

    def restore(self, state) -> None:
        for t, v in zip(self._state(), state):
            t.copy_(v)

    def _state(self):
        r = self.runner
        extra = (r.anchor_logits, r.anchor_h) if r.head is not None else ()
        return (r.length, r.pending, r.out, *extra)

    def precapture(self, prompt_ids, max_len: int) -> int:
        """Capture every column bucket a run up to `max_len` tokens needs (a benchmark's warm-up:
        no capture inside a timed run). Returns the graphs held."""
        if not self.capture:
            return 0
        self.runner.prefill(list(prompt_ids))
        self.runner.ensure(max_len)
        buckets = sorted({self.runner.cols_for(n) for n in range(len(prompt_ids), max_len + 1)})
        if self.epoch != self.runner.epoch:
            self.graphs, self.pool, self.epoch = {}, None, self.runner.epoch
        for c in buckets:
            if c not in self.graphs:
                self.graphs[c] = self._capture(c)
        return len(self.graphs)
