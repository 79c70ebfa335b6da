"""Record decider traces: run the engine over a prompt set and keep, for every drafted node,
its features (decoding.decider.features) and what the target made of it.

    python -m training.collect --config configs/collect.yaml [--shard-index I --num-shards N]

Resumable: prompts already in a shard are skipped; shards are written atomically.
With --num-shards N, process I takes every N-th prompt and writes `<out>/part-I-of-N/`;
`training.decider.traces.load_traces(<out>)` merges the parts.
"""

from __future__ import annotations

import collections
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import torch

from decoding.decider.features import FEATURE_NAMES, FEATURE_SCHEMA_VERSION
from decoding.models import ModelError, fingerprint
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine

from training.config_flags import parse_config
from training.corpus.teacher import prompt_seed, read_prompts
from training.shards import ShardWriter
from training.decider import batched
from training.decider.traces import KIND, SCHEMA, SCHEMA_VERSION, TraceRecorder


@dataclass
class CollectConfig:
    prompt_files: list[str] = field(default_factory=lambda: ["data/prompts/val.jsonl"])
    """JSONL prompt files ({id, kind, prompt})."""
    out: str = "runs/traces"
    """Trace directory (parquet shards + manifest.json)."""
    target: str | None = None
    """Target model dir; None = the embedded SmolLM2-135M-Instruct."""
    draft: str | None = None
    """Draft model dir; None = the shipped default draft."""
    dtype: str = "auto"
    """auto: bfloat16 only where the CPU or GPU computes it natively, else float32."""
    strategy: str = "ti-mcsd"
    """Tree drafted every round, always to full depth (stop decisions are replayed later)."""
    k_config: str = "4,2,2,1"
    width: int = 4
    depth: int = 6
    gamma: int = 4
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    chat: bool = True
    """Wrap each prompt in the tokenizer's chat template (as users of an instruct model do)."""
    hidden: bool = False
    """Also record the draft's last hidden state (float16) for the hidden-state decider."""
    every_position: bool = False
    """Start a round at every position (commit one token a round; ~2.5x the work). A replay of
    such traces follows each policy's own rounds, as deployment runs them, instead of the rounds
    the full tree happened to leave (training.decider.replay walks them)."""
    batched: int = 0
    """N > 0: run the prompts N at a time through batched rounds, the joint grow budget over q
    sizing every round's trees across the requests (the server's job: training.decider.batched);
    0: one prompt at a time, full trees."""
    shard_size: int = 16
    """Prompts per shard: the most work an interruption can lose."""
    seed: int = 0
    max_prompts: int | None = None
    """Read at most this many prompts, in the order of --prompt-files (the first file first)."""
    shard_index: int = 0
    """This process collects every num_shards-th prompt from this one (scale-out over processes)."""
    num_shards: int = 1
    """Processes the prompts are split over; each writes its own part of the trace set."""
    threads: int | None = None

    def __post_init__(self):
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"--shard-index must be in [0, {self.num_shards})")
        if self.batched < 0:
            raise ValueError(f"--batched must be >= 0 (got {self.batched})")
        if self.batched and (self.strategy != "ti-mcsd" or self.every_position or self.hidden):
            raise ValueError("--batched runs the joint grow budget and records features: strategy ti-mcsd, "
                             "every_position false, hidden false")


def out_dir(cfg: CollectConfig) -> Path:
    root = Path(cfg.out)
    return root if cfg.num_shards == 1 else root / f"part-{cfg.shard_index}-of-{cfg.num_shards}"


def collect(cfg: CollectConfig, session, prompts, progress: bool = True) -> dict:
    """Run the engine with a recorder over the prompts not yet collected."""
    from tqdm import tqdm

    scfg = StrategyConfig(strategy=cfg.strategy, k_config=cfg.k_config, width=cfg.width,
                          depth=cfg.depth, gamma=cfg.gamma)
    sampling = SamplingConfig(cfg.temperature, cfg.top_p)
    engine = build_engine(session.target, session.draft, scfg, sampling)
    rec = TraceRecorder(sampling, hidden=cfg.hidden)
    engine.observer = rec
    settings = {k: v for k, v in asdict(cfg).items()
                if k in ("strategy", "k_config", "width", "depth", "gamma", "temperature", "top_p",
                         "max_new_tokens", "hidden", "seed")}
    settings["dtype"] = str(next(session.target.parameters()).dtype).removeprefix("torch.")  # auto resolved
    if cfg.every_position:  # recorded only when set: older trace sets still resume
        settings["every_position"] = True
        engine.commit_limit = 1
    if cfg.batched:  # likewise
        settings["batched"], settings["budget"] = cfg.batched, "joint over q"
        engine = batched.joint_engine(session, scfg)
    identity = {"feature_schema": FEATURE_SCHEMA_VERSION, "feature_names": list(FEATURE_NAMES),
                "model_pair": {"target": fingerprint(session.target), "draft": fingerprint(session.draft)},
                "collect": settings}
    mine = prompts[cfg.shard_index :: cfg.num_shards]
    with ShardWriter(out_dir(cfg), KIND, SCHEMA_VERSION, identity) as w:
        todo = [p for p in mine if p.id not in w.done()]
        bar = tqdm(total=len(todo), unit="prompt", disable=not progress, dynamic_ncols=True)
        for i in range(0, len(todo), cfg.shard_size):
            chunk = todo[i : i + cfg.shard_size]
            jobs = [(p.id, session.encode(p.text, chat=cfg.chat and not p.raw, max_new_tokens=cfg.max_new_tokens,
                                          tree_depth=len(scfg.k_levels)), prompt_seed(cfg.seed, p.id)) for p in chunk]

            def done(_):
                bar.set_postfix(acceptance=f"{rec.accepted / max(rec.drafted, 1):.3f}", refresh=False)
                bar.update(1)

            if cfg.batched:
                batched.run_batched(engine, batched.PerRequest(rec), jobs, cfg.batched, cfg.max_new_tokens,
                                    sampling, session.eos_token_id, done)
                rows = batched.in_prompt_order(rec.take(), [p.id for p in chunk])
            else:
                for name, ids, seed in jobs:
                    rec.start(name)
                    engine.generate(ids, cfg.max_new_tokens, session.eos_token_id, seed)
                    done(name)
                rows = rec.take()
            w.write(pa.table(rows, schema=SCHEMA), [p.id for p in chunk])
        bar.close()
        total = sum(s["rows"] for s in w.manifest["shards"])
    return {"new_prompts": len(todo), "rows": total, "acceptance_rate": set_acceptance(out_dir(cfg)),
            "new_acceptance_rate": rec.accepted / rec.drafted if rec.drafted else None}


def set_acceptance(folder: Path) -> float | None:
    """Accepted / drafted (valid) nodes over the whole trace set in `folder`, resumed runs included
    (a resumed run that drafted nothing new reported 0.0)."""
    from training.shards import read_shards

    _, t = read_shards(folder, KIND, SCHEMA_VERSION, SCHEMA)
    valid = t.column("valid").to_pylist()
    drafted = sum(valid)
    return sum(a for a, v in zip(t.column("accepted").to_pylist(), valid) if v) / drafted if drafted else None


def main(argv=None) -> int:
    cfg = parse_config(CollectConfig, argv, "python -m training.collect", __doc__.split("\n\n")[0])
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        prompts = read_prompts(cfg.prompt_files, cfg.max_prompts)
        if cfg.max_prompts is not None:  # the first files first: say what was kept
            kept = collections.Counter((p.split, p.kind) for p in prompts)
            print(f"--max-prompts {cfg.max_prompts}: kept " + ", ".join(
                f"{n} {kind} from {split}" for (split, kind), n in kept.items()), file=sys.stderr)
        from decoding.models.session import Session

        sess = Session.open(cfg.target, cfg.draft, cfg.dtype, need_draft=True)
        stats = collect(cfg, sess, prompts)
    except (ModelError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished shards are kept; rerun to resume", file=sys.stderr)
        return 130
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
