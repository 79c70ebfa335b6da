"""The static, bucketed forward (decoding.forward.static) equals the dynamic cache on the CPU: the
same code path the CUDA graphs capture, minus the capture. Logits of a whole round's feeds agree
with CachedModel's to fp32 rounding; greedy output equals HF's `generate` for every strategy and
stop rule on every tiny architecture (sliding windows that bite included); a feature head reads
the right target rows through the taps; sampling keeps the target's law."""

import copy

import pytest
import torch

from support.arch_matrix import CASES, N, PROMPTS, models, reference
from support.exact import SAMPLES, WARPED, chi2_pvalue, exact_distribution, speculative_counts
from support.distill import tiny_tokenizer
from support.head import fit_head
from support.models import ARCHS, noisy_copy, tiny_llama
from decoding.drafts import head_graph
from decoding.drafts.feature import DraftKV, FeatureDraft, FeatureDraftConfig
from decoding.drafts.head_graph import HeadGraphs
from decoding.forward import static
from decoding.forward.packed import forward_kind, set_forward
from decoding.kv_cache import CachedModel
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine
from decoding.tree import layout_from_k_config

GREEDY = SamplingConfig()


def static_copy(*ms):
    out = tuple(copy.deepcopy(m) for m in ms)
    for m in out:
        assert set_forward(m, "static") == "static" == forward_kind(m)
    return out


def rounds(m, tree, rounds=6):
    """Feed a prompt, then rounds of (pending token + a tree in two calls, as a draft feeds it),
    keeping a path each time. Returns every feed's logits and hidden states."""
    seq, outs = [3, 1, 4, 1, 5, 9, 2, 6], []
    lay = layout_from_k_config(tree)
    outs.append(m.feed(seq, lay.sliced(0), [], 0, 0, hidden=True))
    for r in range(rounds):
        seq = seq + [(7 * r + 2) % 30]
        toks = [(5 * i + r) % 30 for i in range(lay.size)]
        half = lay.level_ends[1]
        outs.append(m.feed(seq, lay, toks[:half], 0, half, hidden=True))
        outs.append(m.feed(seq, lay, toks[half:], half, lay.size, hidden=True))
        path = lay.path_to(lay.size - 1)[: r % 3]
        m.commit(path, lay.size)
        seq = seq + [toks[i] for i in path]  # the accepted nodes are committed tokens now
    return outs


@pytest.mark.parametrize("arch", ["llama", "mistral+window", "gemma3+window"])
def test_logits_equal_the_dynamic_cache(arch):
    target = models(arch)[0]
    (st,) = static_copy(target)
    m = static.cached_model(st)
    assert isinstance(m, static.StaticCachedModel)
    for (lw, hw), (lg, hg) in zip(rounds(CachedModel(target), (3, 2, 2)), rounds(m, (3, 2, 2))):
        assert lg.shape == lw.shape and lg.dtype == torch.float32
        torch.testing.assert_close(lg, lw, rtol=0, atol=2e-5)  # fp32 rounding: sums over more columns
        torch.testing.assert_close(hg, hw, rtol=0, atol=2e-5)


def test_one_stacked_buffer_rolls_back_as_the_per_layer_ones(monkeypatch):
    """Every layer's keys (values) are views of one buffer, so a commit is one gather per buffer;
    its logits equal the per-layer rollback's bit for bit, growth past the capacity included."""
    target = models("llama")[0]
    (st,) = static_copy(target)
    monkeypatch.setattr(static, "START_CAPACITY", 16)  # the rounds outgrow it: a doubling restacks
    m = static.cached_model(st)
    got = rounds(m, (3, 2, 2), rounds=40)
    assert m.stacked is not None and m.capacity == 256  # 128 at the prompt, doubled since
    k, _ = m.stacked
    assert all(x.buf_k.data_ptr() == k[i].data_ptr() for i, x in enumerate(m.cache.layers))
    monkeypatch.setattr(static.StaticCachedModel, "_stack", lambda self: None)
    (st2,) = static_copy(target)
    m2 = static.cached_model(st2)
    for (a, _), (b, _) in zip(got, rounds(m2, (3, 2, 2), rounds=40), strict=True):
        assert m2.stacked is None and torch.equal(a, b)


def test_buckets_and_columns():
    assert [static.bucket(r) for r in (1, 2, 3, 5, 33, 64, 65)] == [1, 2, 4, 8, 64, 64, None]
    assert static.columns(10, 1024) == 128 and static.columns(300, 1024) == 512
    assert static.columns(3000, 2048) == 2048


@pytest.mark.parametrize("case", ["ar", *CASES])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_equals_hf_generate(arch, case):
    target, draft = static_copy(*models(arch))
    if case == "ar":
        eng = build_engine(target, None, StrategyConfig(strategy="ar"), GREEDY)
    else:
        cfg, make_stop = CASES[case]
        eng = build_engine(target, draft, cfg, GREEDY, stop=make_stop(draft) if make_stop else None)
    assert isinstance(eng.target, static.StaticCachedModel)
    for prompt in PROMPTS:
        out, stats = eng.generate(prompt, N)
        assert out == reference(arch, tuple(prompt)), f"{arch} / {case}"
        assert stats.lossless and stats.new_tokens == N


def test_growing_the_cache_mid_run_keeps_the_output(monkeypatch):
    """A capacity smaller than the run: the buffers double (graphs dropped) and nothing changes."""
    monkeypatch.setattr(static, "START_CAPACITY", 16)
    monkeypatch.setattr(static, "MIN_COLS", 8)
    target = tiny_llama(0, scale=6)
    draft = noisy_copy(target, 0.03)
    cfg = StrategyConfig(strategy="ti-mcsd", width=3, depth=4)
    want = build_engine(target, draft, cfg, GREEDY).generate([1, 5, 7, 3], 60)[0]
    eng = build_engine(*static_copy(target, draft), cfg, GREEDY)
    assert eng.generate([1, 5, 7, 3], 60)[0] == want
    assert eng.target.capacity >= 128  # grew from 16


@pytest.mark.parametrize("head_forward", ["eager", "static"])
def test_feature_head_reads_the_real_rows(head_forward):
    """A feature head over a static target reads the target's layer inputs through the taps,
    padded rows cut (its own steps eager, or bucketed on decoding.drafts.head_graph): its output,
    acceptance and its own KV cache equal the dynamic run's."""
    target = tiny_llama(0, vocab=40, layers=4, hidden=32, scale=6)
    head = fit_head(target)
    (st,) = static_copy(target)
    sh = static_copy(head)[0] if head_forward == "static" else head
    for cfg in (StrategyConfig(strategy="mcsd", k_config="3,2,1"), StrategyConfig(strategy="ti-mcsd", width=3, depth=4)):
        dyn, sta = build_engine(target, head, cfg, GREEDY), build_engine(st, sh, cfg, GREEDY)
        assert isinstance(sta.proposer.model.cache, HeadGraphs) == (head_forward == "static")
        for prompt in ([1, 2, 3], [7, 7, 7, 7, 9, 11]):
            (want, ws), (got, gs) = dyn.generate(prompt, 24), sta.generate(prompt, 24)
            assert got == want and gs.accepted == ws.accepted > 0 and gs.rounds == ws.rounds
            torch.testing.assert_close(sta.proposer.model.cache.k, dyn.proposer.model.cache.k, rtol=0, atol=1e-5)
    assert not hasattr(st, "_specstop_capturing") and "_specstop_taps" not in st.__dict__


def test_head_steps_equal_the_dynamic_cache(monkeypatch):
    """HeadGraphs' bucketed steps (padded rows, columns past the cache, a capacity that doubles)
    give the head's own step's logits and h, and keep the same keys."""
    monkeypatch.setattr(static, "START_CAPACITY", 16)
    target = tiny_llama(0, vocab=40, layers=4, hidden=32, scale=6)
    head = FeatureDraft(FeatureDraftConfig.for_target(target, draft_vocab_size=40, aux_layers=(0, 1, 3)))
    head.init_from_target(target, torch.arange(40)).eval()
    g = torch.Generator().manual_seed(0)
    ref, got = DraftKV(), head_graph.HeadGraphs(head)
    lay = layout_from_k_config((3, 2))
    n = 75  # 5 entries, then 70: more than the largest bucket, uncaptured, and past the capacity
    toks = torch.randint(0, 40, (1, n), generator=g)
    hid = torch.randn(1, n, 32, generator=g)
    with torch.inference_mode():
        for cache in (ref, got):
            for a, b in ((0, 5), (5, n)):
                out = head_graph.head_step(head, cache, toks[:, a:b], hid[:, a:b], torch.arange(a, b)[None])
            whole = head_graph.head_step(head, DraftKV(), toks, hid, torch.arange(n)[None])[0]
            torch.testing.assert_close(out[0], whole[:, 5:], rtol=0, atol=2e-5)
        for r in range(5):
            length = len(ref)
            for start, end in ((0, 3), (3, 9)):
                t = torch.randint(0, 40, (1, end - start), generator=g)
                h = torch.randn(1, end - start, 32, generator=g)
                pos = (length + lay.depth_ids[start:end])[None]
                mask = torch.cat((torch.ones(end - start, length, dtype=torch.bool), lay.mask[start:end, :end]), 1)
                want = head_graph.head_step(head, ref, t, h, pos, mask)
                have = head_graph.head_step(head, got, t, h, pos, mask)
                for a, b in zip(have, want):
                    torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
            for cache in (ref, got):  # commit: drop the tree, one true entry follows
                cache.crop(length)
                head_graph.head_step(head, cache, t[:, :1] * 0 + r, h[:, :1], torch.tensor([[length]]))
    torch.testing.assert_close(got.k, ref.k, rtol=0, atol=1e-6)
    assert got.capacity == 256 and len(got) == len(ref)  # 128 at first, doubled with 5 entries held


def test_graph_is_refused_without_cuda(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    from decoding.generate import main

    model = tiny_llama(0)
    with pytest.raises(ValueError, match="graph needs a CUDA device") as e:
        set_forward(model, "graph")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="CUDA"):
        static.StaticCachedModel(model, capture=True)
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer(tmp_path / "m")
    assert main(["--target", str(tmp_path / "m"), "--strategy", "ar", "--prompt", "x", "--forward", "graph"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--forward graph needs a CUDA device" in err[0]


SAMPLING = [("ti-mcsd+confidence-top-p", StrategyConfig(strategy="ti-mcsd", width=2, depth=2, stop="confidence",
                                                        confidence_threshold=0.2), WARPED)]


@pytest.mark.parametrize("name,cfg,sampling", SAMPLING, ids=[c[0] for c in SAMPLING])
def test_continuations_follow_target(name, cfg, sampling):
    """The exact-sampling test (support.exact: 4,000 continuations, chi-square against the
    enumerated law) on the static forward."""
    target = tiny_llama(0, vocab=6, layers=1, hidden=16, scale=3)
    draft = tiny_llama(1, vocab=6, layers=1, hidden=16, scale=3)
    counts, _, _ = speculative_counts(build_engine(*static_copy(target, draft), cfg, sampling), SAMPLES)
    pvalue = chi2_pvalue(counts, exact_distribution(target, sampling), SAMPLES)
    assert pvalue > 1e-3, f"{name}: p={pvalue:.2e}"
