"""The feature (EAGLE-3) head's test helpers: a tiny head on a tiny target (random or briefly
fitted), the decoding cases it runs, and the head-training targets, corpora and redistill runs
(their fixtures: tests/head/conftest.py, and tests/conftest.py for the redistill run)."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.drafts.capture import capture_aux
from decoding.drafts.feature import FeatureDraft, FeatureDraftConfig
from decoding.drafts.io import save_feature_draft
from decoding.models import load_model
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine
from support.decider import write_prompts
from support.distill import EOS, PAD, V, tiny_tokenizer
from support.models import build
from training.corpus.teacher import CorpusConfig, Prompt, Teacher, build_corpus
from training.draft.distill import target_fingerprint
from training.head import redistill as RD
from training.head.data import FeatureDataModule
from training.head.module import FeatureDistillModule

# ---- a head on an in-memory target -------------------------------------------------------------

AUX = (0, 1, 3)


def tiny_feature_draft(target, draft_vocab=24, seed=0, aux=AUX, init=True):
    torch.manual_seed(seed)
    cfg = FeatureDraftConfig.from_target(target.config, draft_vocab_size=draft_vocab, aux_layers=aux)
    d = FeatureDraft(cfg, target.get_input_embeddings().weight).eval()
    used = torch.randperm(cfg.vocab_size)[:draft_vocab]
    if init:
        d.init_from_target(target, used)
        with torch.no_grad():  # keep it random enough that every part of the head matters
            for p in d.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    else:
        d.set_vocab(used)
    return d


# ---- decoding with a head ---------------------------------------------------------------------

GREEDY = SamplingConfig()


N = 24


PROMPTS = [[1, 2, 3], [5], [7, 7, 7, 7, 9, 11]]


CASES = [
    StrategyConfig(strategy="sd", gamma=4),
    StrategyConfig(strategy="mcsd", k_config="3,2,1"),
    StrategyConfig(strategy="ti-mcsd", width=3, depth=4),
    StrategyConfig(strategy="ti-mcsd", width=2, depth=5, stop="confidence", confidence_threshold=0.5),
    StrategyConfig(strategy="mcsd", k_config="2,2,1", stop="confidence", confidence_rule="tree",
                   confidence_threshold=0.3),
]


def fit_head(target, draft_vocab=32, steps=150, seed=0):
    """A head briefly trained (training-time test, 2 steps) on the target's own greedy text, so
    that drafts get accepted and the accepted-path bookkeeping is really exercised."""
    torch.manual_seed(seed)
    prompts = torch.randint(0, target.config.vocab_size, (24, 3))
    with torch.no_grad():
        seqs = target.generate(prompts, max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)
        with capture_aux(target, (0, 1, 3)) as cap:
            teacher = target(input_ids=seqs).logits.argmax(-1)
    used = torch.bincount(seqs.flatten(), minlength=target.config.vocab_size).argsort(descending=True)[:draft_vocab]
    draft = tiny_feature_draft(target, draft_vocab=draft_vocab, init=False)
    draft.init_from_target(target, used)
    t2d_index = torch.full((target.config.vocab_size,), -1).index_put_((draft.used_ids,), torch.arange(draft_vocab))
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    T = seqs.shape[1]
    for _ in range(steps):
        outs = draft.unroll(seqs, cap.aux(), 2)
        loss = 0.0
        for j, (logits, _) in enumerate(outs):
            label = t2d_index[teacher[:, 1 + j:]]  # target's argmax at position t+1+j
            loss = loss + torch.nn.functional.cross_entropy(
                logits[:, : T - 1 - j].reshape(-1, draft_vocab), label.reshape(-1), ignore_index=-1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


def ar_output(target, prompt, n=N):
    return build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY).generate(prompt, n)[0]


# exact sampling over a tiny vocabulary (support/exact.py's machinery)
SAMPLES = 4000


# ---- training a head: a target directory, its corpus, the data module ------------------------

LAYERS = [0, 1, 3]


def make_head_target(out: Path, seed: int = 0) -> Path:
    """A tiny, sharp random 4-layer Llama (three distinct aux layers) with a tokenizer."""
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=True)
    model = build(cfg, LlamaForCausalLM, seed=seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(4)  # sharp next-token distributions: a learnable target
    model.save_pretrained(out)
    tiny_tokenizer(out)
    return out


def teacher_of(target: Path) -> Teacher:
    model = load_model(target)
    return Teacher(model, lambda t: [1] + [3 + ord(c) % 60 for c in t], [EOS], PAD,
                   target_fingerprint(str(target)))


def data(head_corpus, **kw) -> FeatureDataModule:
    target, corpus, cache = head_corpus
    args = dict(corpora=[str(corpus)], target=str(target), cache_root=str(cache),
                draft_vocab_size=40, k=8, layers=LAYERS, max_prompt_tokens=16, max_tokens=256,
                val_percent=20, max_val_rows=16)
    return FeatureDataModule(**(args | kw))


def make_head_corpus(root: Path):
    """(target dir, corpus dir, cache root) under `root`: a 4-layer target and 64 prompts' corpus."""
    target = make_head_target(root / "target")
    prompts = [Prompt(f"p{i}", "code" if i % 3 else "general", "train", "abcde"[i % 5] * (1 + i % 4))
               for i in range(64)]
    build_corpus(CorpusConfig(out=str(root / "corpus"), dtype="float32", batch_size=8,
                              shard_size=16, max_new_tokens=24, temperature=1.0),
                 teacher_of(target), prompts, progress=False)
    return target, root / "corpus", root / "cache"


# ---- redistill runs ----------------------------------------------------------------------------

USED = torch.cat([torch.tensor([0, 1, 2]), torch.arange(27, 64)])  # not the corpus's own choice


def make_head(target: Path, out: Path, damaged: bool = True) -> Path:
    module = FeatureDistillModule(target=str(target))
    head = module.build_head(LAYERS, USED)
    if damaged:
        with torch.no_grad():
            head.lm_head.weight.zero_()
    return save_feature_draft(head, out, module.target(), {"dtype": "float32"})


def setup_run(tmp_path, damaged_champion, **kw) -> tuple[RD.RedistillConfig, Path]:
    """A copy of the damaged champion, 40 logged prompts, a redistill config."""
    import shutil

    root, target, damaged = damaged_champion
    champ = tmp_path / "drafts" / "head"
    shutil.copytree(damaged, champ)
    write_prompts(tmp_path / "logged", "day1.jsonl", 40)
    args = dict(new_prompts=str(tmp_path / "logged"), work=str(tmp_path / "work"), draft=str(champ),
                target=str(target), heldout_fraction=0.3, distill_config=str(root / "distill.yaml"),
                max_minutes=None, max_steps=30, dtype="float32", temperature=1.0, max_new_tokens=24,
                batch_size=8, shard_size=16, depth=2, threads=1,
                serve_check_python=str(tmp_path / "no-vllm" / "python"))  # test_serve_gate runs one
    return RD.RedistillConfig(**(args | kw)), champ


def make_redistill_run(root: Path):
    """(root, target dir, damaged champion dir): a head target, a 2-step distill config and a
    champion that never agrees (its lm_head zeroed), so any training helps."""
    target = make_head_target(root / "target")
    base = {"seed_everything": 0,
            "run": {"kind": "eagle3", "threads": 1},
            "model": {"steps": 2, "schedule": "steps", "lr": 0.01, "warmup_ratio": 0.0},
            "data": {"cache_root": str(root / "cache"), "k": 8, "max_prompt_tokens": 16,
                     "max_tokens": 256, "val_percent": 20, "max_val_rows": 16},
            "trainer": {"accelerator": "cpu", "logger": False, "enable_progress_bar": False,
                        "enable_model_summary": False}}
    (root / "distill.yaml").write_text(yaml.safe_dump(base))
    return root, target, make_head(target, root / "damaged")
