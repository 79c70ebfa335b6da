"""A tiny chat target: one token per printable character, SmolLM2's chat template (with its
default system prompt) and `<|im_end|>` as end of turn; and chat files in both shapes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from support.models import build

CHARS = [chr(i) for i in range(32, 127)] + ["\n"]
PAD, START, EOS = 0, 1, 2
V = 3 + len(CHARS)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
# The same turns, with assistant text marked for return_assistant_tokens_mask.
GENERATION_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
    "'<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + "
    "'<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def chat_tokenizer(template: str = SMOLLM2_TEMPLATE) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": PAD, "<|im_start|>": START, "<|im_end|>": EOS}
    vocab |= {c: 3 + i for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = template
    return fast


def make_chat_target(out: Path, seed: int = 0, layers: int = 4) -> Path:
    """A tiny, sharp random Llama with the chat tokenizer, saved as an HF directory."""
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                      bos_token_id=START, eos_token_id=EOS, pad_token_id=PAD,
                      tie_word_embeddings=True)
    model = build(cfg, LlamaForCausalLM, seed=seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(4)
        model.lm_head.weight[EOS] += 0.3  # turns end now and then within a few dozen tokens
    model.save_pretrained(out)
    chat_tokenizer().save_pretrained(out)
    return out


def sharegpt_rows(n: int, turns: int = 2) -> list[dict]:
    return [{"conversations": ([{"from": "system", "value": f"Be brief {i}."}] if i % 2 else [])
             + [t for k in range(turns) for t in (
                 {"from": "human", "value": f"Question {i}.{k}: why {'ab' * (1 + k)}?"},
                 {"from": "gpt", "value": f"Because {k} ok."})]} for i in range(n)]


def openai_rows(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Write code {i}"},
                          {"role": "assistant", "content": f"```py\nx = {i}\n```"},
                          {"role": "user", "content": "Thanks!"}]} for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
