"""Traces of the server's job: prompts run N at a time through batched rounds (decoding.batch), every
round's rows spent across the requests by the joint grow budget over the draft's q.

Why: the joint budget asks of an estimate what a tree's stop rule does not: which request's next node
is worth a row. A decider fitted for that job learns from the nodes that budget drafts (its
candidates, at the depths and contexts its trees reach), not from full trees of one request. Each
request's logits equal its batch-1 logits (the batched forward is row-independent), so the labels
mean what they mean in `training.decider.traces`; only which nodes get drafted differs.
"""

from __future__ import annotations

from decoding.batch.budget import JointGrow
from decoding.batch.scheduler import BatchEngine
from decoding.sampling import SamplingConfig
from decoding.stopping.gate import DraftGate
from decoding.strategies import StrategyConfig
from decoding.tree import layout_from_k_config


def joint_engine(session, scfg: StrategyConfig) -> BatchEngine:
    """The server's `--budget joint-always` engine over q for this pair: a tree of scfg's width and
    depth at most, the budget every round (no measured switch to plain rounds: those draft nothing)."""
    grow = session.grow_policy(scfg, scorer=None)
    # the gate held open: a request left alone in its batch would otherwise be gated by rounds
    # timed on the wall, and the traces would depend on the machine's load
    budget = JointGrow(grow.scorer, grow.cost, max_width=grow.max_width, max_nodes=grow.max_nodes,
                       label=grow.label, needs_hidden=grow.needs_hidden, gate=DraftGate.held_open())
    return BatchEngine(session.target, session.draft, layout_from_k_config(scfg.k_levels), budget=budget)


class PerRequest:
    """Engine observer: a TraceRecorder's rows, each request's under its own prompt id and rounds."""

    def __init__(self, recorder):
        self.rec = recorder
        self.hidden = recorder.hidden
        self.names: dict[int, str] = {}
        self.rounds: dict[int, int] = {}

    def __call__(self, req, tree, logits, outcome, position: int) -> None:
        self.rec.prompt_id, self.rec.round = self.names[req.id], self.rounds.get(req.id, 0)
        self.rec(tree, logits, outcome, position)
        self.rounds[req.id] = self.rec.round


def run_batched(engine: BatchEngine, observer: PerRequest, jobs, slots: int, max_new_tokens: int,
                sampling: SamplingConfig, eos, on_done=None) -> None:
    """jobs: (prompt id, token ids, seed) in order; `slots` requests at a time, a slot taking the next
    job when its request ends (as a server's clients do)."""
    engine.observer = observer
    queue = list(jobs)

    def admit() -> None:
        name, ids, seed = queue.pop(0)
        req = engine.add(ids, max_new_tokens, sampling, seed, eos_token_id=eos)
        observer.names[req.id] = name

    for _ in range(min(slots, len(queue))):
        admit()
    while engine.active:
        for req in engine.step():
            if req.error is not None:
                raise req.error
            if on_done is not None:
                on_done(observer.names[req.id])
            if queue:
                admit()


def in_prompt_order(rows: dict[str, list], order: list[str]) -> dict[str, list]:
    """The recorder's rows (interleaved across requests) grouped by prompt in `order`, rounds kept in
    order within a prompt."""
    rank = {name: i for i, name in enumerate(order)}
    idx = sorted(range(len(rows["prompt_id"])), key=lambda i: (rank[rows["prompt_id"][i]], rows["round"][i]))
    return {c: [v[i] for i in idx] for c, v in rows.items()}
