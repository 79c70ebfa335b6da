"""Where a feature-head training step's time goes, phase by phase, on the run's own configs:

    python -m training.head.profile --config configs/distill_eagle3.yaml \\
        [--config ...] [--steps 8] [--warmup 2] [--json OUT.json] [any --trainer.* / --data.* / --model.*]

Builds the module and data exactly as `python -m training.distill` would (same configs, device
and precision flags: --trainer.accelerator gpu --trainer.precision bf16-mixed on a GPU), then runs
--warmup + --steps training steps by hand and times: data (the next batch, moved to the device),
target (the target's prefill for the features and labels: zero with a cached source), head_fc
(fusing the three target layers), head_step_J
(the head's forward for unrolled step J), loss (the output layer on labelled rows and the soft
cross-entropy, all steps), backward, clip and optimizer (AdamW). Prints the mean ms of each and its
share; the device is synchronised around every phase, so the split is exact and the total a little
slower than an unsynchronised step. No weights are written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from contextlib import nullcontext


def _clock(device):
    import torch

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def profile(module, data, device, autocast, steps: int, warmup: int, clip: float | None) -> dict:
    import torch

    from training.head.module import step_loss, unroll_skip

    data.prepare_data()
    data.setup("fit")
    module.build_head(data.layers, data.vocab.used)
    module.online_k = data.k
    module.to(device)
    head, now = module.head.train(), _clock(device)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=module.hp["lr"],
                            betas=tuple(module.hp["betas"]), weight_decay=module.hp["weight_decay"])
    att, marks = head.midlayer.self_attn, []
    qkv = att.qkv

    def timed_qkv(*a, **kw):  # each unrolled step starts with its q/k/v projection
        marks.append(now())
        return qkv(*a, **kw)

    att.qkv = timed_qkv
    times, positions = defaultdict(float), 0
    it = iter(data.train_dataloader())
    for n in range(warmup + steps):
        t0 = now()
        try:
            batch = next(it)
        except StopIteration:
            it = iter(data.train_dataloader())
            batch = next(it)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        t1 = now()
        with autocast:
            if "feats" not in batch:
                batch = module._online(batch)
            t2 = now()
            marks.clear()
            skip = unroll_skip(batch, module.hp["steps"])
            outs = head.unroll(batch["input_ids"], batch["feats"], module.hp["steps"],
                               batch["attention_mask"], skip=skip, logits=False)
            t3 = now()
            total = 0.0
            for j, (_, h) in enumerate(outs):
                loss, *_ = step_loss(head, h, batch, j, skip, module.hp.get("loss", "soft_ce"),
                                     module.hp.get("accept_temperature", 0.7))
                total = total + module.hp["step_decay"] ** j * loss
        t4 = now()
        total.backward()
        t5 = now()
        if clip:
            torch.nn.utils.clip_grad_norm_(head.parameters(), clip)
        t6 = now()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t7 = now()
        if n < warmup:
            continue
        positions += int(batch["attention_mask"].sum())
        ends = marks[1:] + [t3]
        phases = {"data": t1 - t0, "target": t2 - t1, "loss": t4 - t3, "backward": t5 - t4,
                  "clip": t6 - t5, "optimizer": t7 - t6, "head_fc": (marks[0] - t2) if marks else 0.0}
        phases |= {f"head_step_{j + 1}": e - s for j, (s, e) in enumerate(zip(marks, ends))}
        for k, v in phases.items():
            times[k] += v
        times["total"] += t7 - t0
    att.qkv = qkv
    ms = {k: 1000 * v / steps for k, v in times.items()}
    return {"steps": steps, "device": str(device), "positions_per_step": positions / steps,
            "ms": ms, "share": {k: v / ms["total"] for k, v in ms.items() if k != "total"}}


def main(argv: list[str] | None = None) -> None:
    import torch

    from training.config_flags import lightning_cli, usage_error
    from training.head.data import FeatureDataModule
    from training.head.module import FeatureDistillModule
    from training.head.train import RunConfig

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    a, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    if a.steps < 1 or a.warmup < 0:
        usage_error("--steps must be >= 1 and --warmup >= 0")
    run, trainer, module, data, _, _ = lightning_cli(FeatureDistillModule, FeatureDataModule, RunConfig, rest)
    device = trainer.strategy.root_device
    prec = str(trainer.precision)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if prec.startswith("bf16") else
                torch.autocast(device.type, dtype=torch.float16) if prec.startswith("16") else nullcontext())
    try:
        res = profile(module, data, device, autocast, a.steps, a.warmup, trainer.gradient_clip_val)
    except ValueError as e:
        usage_error(str(e))
    res |= {"precision": prec, "threads": torch.get_num_threads(), "source": data.source,
            "unrolled_steps": module.hp["steps"], "max_tokens": data.max_tokens}
    print(f"{res['steps']} steps on {res['device']} ({prec}, {data.source} source, {res['unrolled_steps']} "
          f"unrolled steps, {res['positions_per_step']:.0f} positions a step)")
    for k, v in sorted(res["ms"].items(), key=lambda kv: -kv[1]):
        share = "" if k == "total" else f"  {100 * res['share'][k]:5.1f}%"
        print(f"  {k:<14} {v:9.1f} ms{share}")
    if a.json:
        from pathlib import Path

        from training.shards import write_text

        write_text(Path(a.json), json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
