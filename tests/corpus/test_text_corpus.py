"""training.corpus.text: existing text (another model's corpus) re-tokenized for a target
that labels it. Its manifest names the labelling target (so the feature cache accepts it) and
says the text is not the target's; the rows decode to the source text in the target's ids."""

import json
import string

import pyarrow.parquet as pq
import pytest
from support.distill import EOS, PAD, V, make_target
from transformers import PreTrainedTokenizerFast

from decoding.models import load_model
from training.head import cache as feature_cache
from training.corpus.teacher import CorpusConfig, Prompt, Teacher, build_corpus
from training.corpus.text import base_opening, build_text_corpus

CHARS = string.ascii_letters + " \n:.,?()_"  # 61 = V - 3 printable tokens


def char_tokenizer(shift: int) -> PreTrainedTokenizerFast:
    """One token per character (ids permuted by `shift`), decoding by concatenation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {c: 3 + (i + shift) % (V - 3) for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A corpus written by a 'source model' whose tokenizer is char_tokenizer(7)."""
    d = tmp_path_factory.mktemp("text")
    target = make_target(d / "writer")
    src = char_tokenizer(7)
    teacher = Teacher(load_model(target), lambda t: src.encode(t), [EOS], PAD,
                      {"name": "writer", "vocab_size": V})
    prompts = [Prompt(f"p{i}", "general", "train", f"Say {'abc'[i % 3]} (n {i})") for i in range(6)]
    build_corpus(CorpusConfig(out=str(d / "src"), dtype="float32", batch_size=3, shard_size=3,
                              max_new_tokens=12, temperature=1.0), teacher, prompts, progress=False)
    return d, src, {p.id: p.text for p in prompts}


def test_rows_are_the_source_text_in_the_target_ids_and_the_manifest_says_so(source):
    d, src, prompts = source
    tgt, info = char_tokenizer(0), {"name": "labeller", "vocab_size": V}
    stats = build_text_corpus(str(d / "out"), info, tgt, src, [str(d / "src")], prompts, shard_size=4)
    assert stats == {"new_rows": 6, "total_rows": 6}
    m = json.loads((d / "out" / "manifest.json").read_text())
    assert m["target"] == info and [s["rows"] for s in m["shards"]] == [4, 2]
    gen = m["generation"]
    assert gen["source"] == "existing-text" and gen["from"][0]["writer"] == "writer"
    assert "temperature" not in gen  # never passes for a target-written corpus
    out = pq.read_table(d / "out" / "shard-00000.parquet").to_pylist()
    srows = pq.read_table(d / "src" / "shard-00000.parquet").to_pylist()
    for o, s in zip(out, srows):
        assert o["prompt_id"] == s["prompt_id"]
        assert o["prompt_ids"] == [tgt.bos_token_id] + tgt.encode(base_opening(prompts[o["prompt_id"]]))
        text = src.decode(s["completion_ids"], skip_special_tokens=True).strip()
        comp = o["completion_ids"][:-1] if o["finished"] else o["completion_ids"]
        assert tgt.decode(comp) == " " + text
        assert o["completion_ids"] != s["completion_ids"] or not text  # other ids, same text
    # resumable: a second run adds nothing; another target is another corpus
    assert build_text_corpus(str(d / "out"), info, tgt, src, [str(d / "src")], prompts)["new_rows"] == 0
    with pytest.raises(ValueError, match="another target"):
        build_text_corpus(str(d / "out"), {"name": "other", "vocab_size": V}, tgt, src,
                          [str(d / "src")], prompts)


def test_the_labelling_target_caches_it_and_a_missing_prompt_is_refused(source):
    d, src, prompts = source
    tgt, info = char_tokenizer(0), {"name": "labeller", "vocab_size": V}
    build_text_corpus(str(d / "cached"), info, tgt, src, [str(d / "src")], prompts)
    teacher = Teacher(load_model(make_target(d / "labeller")), tgt.encode, [EOS], PAD, info)
    settings = feature_cache.CacheSettings([0, 0, 0], draft_vocab_size=32, k=4)
    folder, _ = feature_cache.build([str(d / "cached")], d / "fc", settings, teacher, progress=False)
    man = json.loads((d / "cached" / "manifest.json").read_text())
    assert len(feature_cache.cached(folder, d / "cached", man)) == len(man["shards"])
    with pytest.raises(ValueError, match="in none of the prompt files"):
        build_text_corpus(str(d / "bad"), info, tgt, src, [str(d / "src")], {"p0": "x"})
