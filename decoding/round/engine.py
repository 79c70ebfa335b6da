"""The host's side of the device round: SpeculativeEngine's `generate` contract over a DeviceRound,
one round = one call (a CUDA graph replay per (shape, cache columns) on CUDA) and ONE host read,
the new tokens, for EOS, streaming and the next round's column bucket.

Draws come from the device's own generator (`torch.manual_seed(seed)` at the start of a request):
a graph replays them, a CUDA generator of our own could not be.
"""

from __future__ import annotations

import collections
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
                 capture: bool | None = None, compiled: bool = False, lookahead: int | None = None):
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
        self.lookahead = lookahead or 1
        """Rounds queued ahead of the read: 2 hides the read's wait behind the next replay on CUDA
        (a CPU runs each op as it is called: nothing to hide there)."""
        self._pinned = [torch.empty(shape.depth + 2, dtype=torch.long, pin_memory=True)
                        for _ in range(self.lookahead + 1)] if self.capture and self.lookahead > 1 else []
        self._ring = 0

    def generate(self, prompt_ids, max_new_tokens: int = 128, eos_token_id=None, seed: int = 0,
                 on_tokens=None) -> tuple[list[int], RunStats]:
        """`lookahead` rounds stay queued on the device: round r + 1 is launched before round r's
        tokens are read (its cache columns sized for the most round r can commit), so on CUDA the
        read's wait overlaps the next replay. A round launched past EOS or the token budget is
        dropped unread: the next request's prefill resets the state it advanced."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        torch.manual_seed(seed)
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        stats = RunStats(self.name, True)
        t_start = time.perf_counter()
        out = [self.runner.prefill(list(prompt_ids))]
        stats.add_plain_round(time.perf_counter() - t_start)
        length, most = len(prompt_ids), self.shape.depth + 1
        queued: collections.deque = collections.deque()
        if on_tokens:
            on_tokens(out[:])
        while len(out) < max_new_tokens and out[-1] not in eos:
            t0 = time.perf_counter()
            while len(queued) < self.lookahead and len(out) + len(queued) < max_new_tokens:
                bound = length + most * len(queued)  # the cache's length after the queued rounds, at most
                self.runner.ensure(bound)
                self.run(self.runner.cols_for(bound))
                queued.append(self._stage())
            got = self._read(queued.popleft())  # the round's one host read
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

    def _stage(self):
        """The round's `out` where a later read finds it: itself when nothing is queued behind it,
        else a copy (on CUDA into pinned memory, ordered on the stream before the next replay)."""
        out = self.runner.out
        if self.lookahead == 1:
            return out
        if not self.capture:
            return out.clone()
        self._ring = (self._ring + 1) % len(self._pinned)
        buf = self._pinned[self._ring]
        buf.copy_(out, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return buf, ev

    def _read(self, staged) -> list[int]:
        self.reads += 1
        if isinstance(staged, tuple):
            staged[1].synchronize()
            staged = staged[0]
        return staged.tolist()

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
