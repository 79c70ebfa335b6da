"""Tiny target, corpora and trainers shared by the distillation tests (their fixtures are in
tests/conftest.py: one tiny target and corpus per test module)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from decoding.models import load_model
from support.models import build
from training.corpus.teacher import CorpusConfig, Prompt, Teacher, build_corpus
from training.draft.data import CorpusDataModule
from training.draft.module import DraftConfig
from training.draft.teacher_cache import build_cache

ROOT = Path(__file__).resolve().parents[2]  # the checkout
V, EOS, PAD = 64, 2, 0
TINY_DRAFT = DraftConfig(layers=1, hidden=32, heads=2, intermediate=64, head_size=48)


def tiny_tokenizer(path: Path, shift: int = 0) -> None:
    """A word-level tokenizer over V single-character tokens; `shift` permutes the ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = [chr(ord("A") + i) for i in range(V - 3)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab |= {c: 3 + (i + shift) % (V - 3) for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(path)


def make_target(out: Path) -> Path:
    """A tiny, sharp random Llama target saved as an HF directory with a tokenizer."""
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    model = build(cfg, LlamaForCausalLM, seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(3)  # sharp next-token distributions: a learnable target
    model.save_pretrained(out)
    tiny_tokenizer(out)
    return out


def make_corpus(target_dir: Path, out: Path) -> Path:
    """A toy corpus written by the tiny target, with its teacher top-k cached."""
    model = load_model(target_dir)
    teacher = Teacher(model, lambda t: [1] + [3 + ord(c) % 60 for c in t], [EOS], PAD,
                      {"name": "tiny", "vocab_size": V})
    prompts = [Prompt(f"p{i}", "code" if i % 3 else "general", "train", "abcde"[i % 5] * (1 + i % 4))
               for i in range(48)]
    build_corpus(CorpusConfig(out=str(out), dtype="float32", batch_size=8, shard_size=16,
                              max_new_tokens=24, temperature=1.0), teacher, prompts, progress=False)
    build_cache(out, out / "cache", k=8, teacher=teacher, progress=False)
    return out


def data_module(corpus_dir, **kw) -> CorpusDataModule:
    args = {"corpus": str(corpus_dir), "teacher_cache": str(corpus_dir / "cache"), "k": 8,
            "batch_size": 8, "val_percent": 20, "max_val_rows": 16, "refresh": False}
    return CorpusDataModule(**(args | kw))


def trainer(**kw) -> L.Trainer:
    args = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False}
    return L.Trainer(**(args | kw))


def make_on_policy_corpus(target_dir: Path, corpus_dir: Path, out: Path) -> Path:
    """An on-policy corpus for the tiny target: a random draft writes, the target scores."""
    from dataclasses import replace

    target = load_model(target_dir)
    teacher = Teacher(target, lambda t: [1] + [3 + ord(c) % 60 for c in t], [EOS], PAD,
                      {"name": "tiny", "vocab_size": V})
    torch.manual_seed(3)
    draft = LlamaForCausalLM(target.config).eval()
    writer = replace(teacher, model=draft, info=teacher.info | {"writer": {"name": "rnd"}})
    prompts = [Prompt(f"p{i}", "general", "train", "abcde"[i % 5] * (1 + i % 4)) for i in range(48)]
    build_corpus(CorpusConfig(out=str(out), dtype="float32", batch_size=8, shard_size=16,
                              max_new_tokens=24, temperature=1.0, seed=7), writer, prompts,
                 progress=False)
    build_cache(out, corpus_dir / "cache", k=8, teacher=teacher, progress=False)
    return out
