"""The decider pipeline's test helpers: logged prompt files, hand-drawn replay rounds, a fast fit
config and a collection session that encodes text character by character."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import yaml


def write_prompts(folder: Path, name: str, n: int, offset: int = 0):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(
        json.dumps({"prompt": f"w{(i + offset) % 30} w{(7 * i + offset) % 30} w{(3 * i) % 30}"}) + "\n"
        for i in range(n)))


def table(rounds):
    """rounds: list of (parents, accepted) per round; nodes in BFS order, -1 = level 1."""
    cols = {k: [] for k in ("prompt_id", "round", "node", "parent", "depth", "branch", "accepted", "valid")}
    for r, (parents, accepted) in enumerate(rounds):
        depth, seen = [], {}
        for p in parents:
            depth.append(1 if p < 0 else depth[p] + 1)
            cols["branch"].append(seen.get(p, 0))
            seen[p] = seen.get(p, 0) + 1
        cols["prompt_id"] += ["p"] * len(parents)
        cols["round"] += [r] * len(parents)
        cols["node"] += list(range(len(parents)))
        cols["parent"] += list(parents)
        cols["depth"] += depth
        cols["accepted"] += [i in accepted for i in range(len(parents))]
        cols["valid"] += [True] * len(parents)
    return pa.table(cols)


# a fork tree: 2 chains of depth 3 (nodes 0,1 | 2,3 | 4,5; chain 0 = 0,2,4; chain 1 = 1,3,5)
FORK = (-1, -1, 0, 1, 2, 3)


def fit_config(tmp: Path, traces: Path, **over) -> Path:
    """A fast fit config (tiny MLP, high lr, illustrative cost model) writing under `tmp`."""
    cfg = {"seed_everything": 0, "threads": 1,
           "model": {"kind": "mlp", "lr": 0.01},
           "data": {"traces": str(traces), "label": "hard", "batch_size": 128},
           "trainer": {"max_epochs": 6, "accelerator": "cpu", "devices": 1, "logger": False,
                       "enable_progress_bar": False, "default_root_dir": str(tmp / "work")},
           "replay": {"cost_model": "default", "decider_ms": 0.0, "grid": [0.1, 0.3, 0.5, 0.7, 0.9]},
           "export": {"out": str(tmp / "deciders"), "reports": None}}
    for key, val in over.items():
        cfg[key] = {**cfg.get(key, {}), **val} if isinstance(val, dict) else val
    path = tmp / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class StubSession:
    def __init__(self, target, draft):
        self.target, self.draft, self.eos_token_id = target, draft, None

    def encode(self, text, chat=True, max_new_tokens=0, tree_depth=0):
        return [3 + (ord(c) % 20) for c in text]
