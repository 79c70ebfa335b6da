"""The target's log-probabilities of committed tokens, for requests that ask (OpenAI `logprobs`).

Which distribution: the target's raw one, log_softmax of its logits in float32, before
temperature and top-p (vLLM's default, "raw_logprobs"). A greedy answer's numbers then do not
depend on the sampling settings, and they are the model's own: what an HF forward over the
prompt and the answer gives at each position.

Where the rows come from: a round's verify already holds the target's logits of every committed
token (decide()'s rows): the anchor's row gives the first committed token, accepted node i's row
the token after it (the next accepted node, or the bonus token). Only those rows are read, and
only for a request that asked, so the others pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP = 20
"""Most alternatives a position reports (OpenAI's chat limit; its completions limit is 5)."""


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token: its id, its log-probability, and the `top` most likely ids at its
    position as (id, logprob), most likely first (the chosen id among them where it ranks)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def committed_rows(size: int, path: list[int], rows: int) -> list[int]:
    """Indices (from the end, negative) of the logits rows that gave a round's committed tokens,
    as decide() reads them: the anchor's, then each accepted node's; the first `rows` of them."""
    return ([-size - 1] + [-size + i for i in path])[:rows]


def token_logprobs(logits: torch.Tensor, size: int, path: list[int], tokens: list[int],
                   top: int) -> list[TokenLogprob]:
    """TokenLogprob of each of `tokens` (a round's committed tokens, possibly cut short by the
    budget or an end of text) from that round's verify `logits` (a tree of `size` nodes whose
    accepted `path` is given); `top`: alternatives per position (0..MAX_TOP)."""
    if not tokens:
        return []
    idx = [len(logits) + i for i in committed_rows(size, path, len(tokens))]
    lp = torch.log_softmax(logits[idx].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if top > 0:
        vals, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)  # sorted, most likely first
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, c, a) for t, c, a in zip(tokens, chosen, tops)]
