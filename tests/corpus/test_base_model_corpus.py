"""A base model's corpus (training.corpus.teacher --chat false): plain-text prompts, recorded in
the corpus identity only when set; a tokenizer without a chat template is one clear error."""

import json

import pytest
from support.distill import make_target

from decoding.models import load_tokenizer
from training.corpus.teacher import CorpusConfig, Prompt, build_corpus, load_teacher


def test_plain_text_corpus_for_a_tokenizer_without_chat_template(tmp_path):
    target = make_target(tmp_path / "target")  # its tokenizer has no chat template
    tok = load_tokenizer(target)
    assert not tok.chat_template
    chat = load_teacher(CorpusConfig(target=str(target), dtype="float32"))
    with pytest.raises(ValueError, match="no chat template .*--chat false"):
        chat.encode("abc")
    cfg = CorpusConfig(out=str(tmp_path / "corpus"), target=str(target), dtype="float32", chat=False,
                       max_new_tokens=4, batch_size=2, shard_size=2)
    teacher = load_teacher(cfg)
    assert teacher.encode("abc") == tok.encode("abc")
    build_corpus(cfg, teacher, [Prompt("p0", "general", "train", "abc")], progress=False)
    manifest = json.loads((tmp_path / "corpus" / "manifest.json").read_text())
    assert manifest["generation"]["chat"] is False
