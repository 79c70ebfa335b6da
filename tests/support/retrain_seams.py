"""Seams that make training.decider.retrain run in seconds on synthetic traces (tests and fault table).

`collect` writes synthetic traces (acceptance follows q_token, see support/traces.py) and
`training.decider.fit.main` exports a hand-made decider: good (scores q_token up), inverted (down)
or timid (stops at once). Everything after them (assess, decide, the registry
compare-and-swap, the decision record) is the real code.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from decoding.decider.policy import DeciderConfig, DeciderNet, save_decider
from decoding.decider.features import FEATURE_NAMES
from support.traces import write_traces
from training.decider import fit
from training.decider import registry
from training.decider import retrain as R
from training.decider.threshold import DEFAULT_COST

KINDS = {"good": (20.0, -10.0), "inverted": (-20.0, 10.0), "timid": (0.0, -10.0)}


def make_decider(root: Path, run_id: str, kind: str, promote: bool) -> None:
    cfg = DeciderConfig(kind="logistic", threshold=0.5, rule="paper", cost_model=asdict(DEFAULT_COST))
    net = DeciderNet(cfg)
    weight, bias = KINDS[kind]
    with torch.no_grad():
        net.net[0].weight.zero_()
        net.net[0].weight[0, FEATURE_NAMES.index("q_token")] = weight
        net.net[0].bias.fill_(bias)
    save_decider(Path(root) / run_id, net, cfg, {"kind": kind})
    registry.register(root, run_id, {"kind": kind}, promote=promote)


def fake_collect(ccfg, session, prompts, progress=True):
    write_traces(ccfg.out, n_prompts=len(prompts), prefix=Path(ccfg.out).name[-7:], per_shard=8,
                 seed=len(prompts))
    return {"acceptance_rate": 0.5}


def install(monkeypatch_setattr, challenger: dict) -> None:
    """Patch retrain's collect and fit (`challenger["kind"]` picks the exported decider)."""

    def fake_fit(argv):
        a = dict(zip(argv[::2], argv[1::2]))
        make_decider(Path(a["--export.out"]), a["--export.run_id"], challenger["kind"], promote=False)
        return 0

    monkeypatch_setattr(R, "collect", fake_collect)
    monkeypatch_setattr(fit, "main", fake_fit)
