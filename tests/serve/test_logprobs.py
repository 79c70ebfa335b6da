"""OpenAI `logprobs` from decoding.serve, through the `openai` client: the numbers are the target's
raw distribution (log_softmax of its logits, before temperature and top-p) at each output
position, the same under speculation as under plain decoding and as an independent HF forward's;
the top lists are sorted and hold the chosen token where it ranks; streams add up to the whole
answer; out-of-range values get a 400 naming the parameter; requests that do not ask cost nothing."""

import math
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from support.serve import client, save_pair, serving

from decoding import Decoder

pytestmark = pytest.mark.xdist_group("server-logprobs")
PROMPTS = ["w1 w2 w3", "w4 w5", "w6 w1 w2 w7 w3", "w2"]
TOL = 1e-4  # float32; tree rows and one-row steps sum in different orders


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(spec client, ar client, ar Decoder, HF target, spec worker): a server engine that drafts,
    and one without a draft."""
    import transformers as T

    t, d = save_pair(tmp_path_factory.mktemp("lp"))
    # a fixed tree every round: a priced rule would draft little on models this small
    spec = Decoder.load(t, d, strategy="ti-mcsd", width=2, depth=3, stop="fixed")
    ar = Decoder.load(t, strategy="ar")
    hf = T.AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    with serving(spec, budget="independent") as (sw, sport), serving(ar) as (_, aport):
        yield client(sport), client(aport), ar, hf, sw


def hf_logprobs(hf, prompt: list[int], out: list[int]) -> torch.Tensor:
    """Row j: log_softmax of the HF target's logits at the position that gives out[j]."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(out)]


def test_greedy_logprobs_equal_plain_decoding_and_an_hf_forward(servers):
    spec, ar_client, ar, hf, worker = servers
    ask = lambda c, p: c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0,  # noqa: E731
                                            logprobs=5).choices[0]
    c = worker.counters
    rounds, generated = c.round_requests, c.generated
    got = [ask(spec, p) for p in PROMPTS]  # one request a round: it drafts every round
    assert c.generated - generated > c.round_requests - rounds  # drafted tokens were accepted
    with ThreadPoolExecutor(4) as pool:  # and in batched rounds
        for b, g in zip(pool.map(lambda p: ask(spec, p), PROMPTS), got):
            assert b.logprobs.tokens == g.logprobs.tokens
            assert max(abs(x - y) for x, y in zip(b.logprobs.token_logprobs, g.logprobs.token_logprobs)) < TOL
    tok = ar.session.tokenizer
    for p, g in zip(PROMPTS, got):
        want, plain = ar.generate(p, 12), ask(ar_client, p)
        assert g.text == plain.text == want.text
        lp = g.logprobs
        assert lp.tokens == plain.logprobs.tokens == [tok.decode([i]) for i in want.token_ids]
        ref = hf_logprobs(hf, want.prompt_ids, want.token_ids)
        for j, i in enumerate(want.token_ids):
            assert abs(lp.token_logprobs[j] - plain.logprobs.token_logprobs[j]) < TOL
            assert abs(lp.token_logprobs[j] - ref[j, i].item()) < TOL
            top = ref[j].topk(5)
            assert list(lp.top_logprobs[j]) == [tok.decode([k]) for k in top.indices.tolist()]
            assert all(abs(a - b) < TOL for a, b in zip(lp.top_logprobs[j].values(), top.values.tolist()))
        assert lp.text_offset == [len(tok.decode(want.token_ids[:j], skip_special_tokens=True))
                                  for j in range(len(want.token_ids))]


def test_chat_logprobs_equal_plain_decoding_and_an_hf_forward(servers):
    spec, ar_client, ar, hf, _ = servers
    msgs = [{"role": "user", "content": "w6 w1 w2"}]
    ask = lambda c: c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,  # noqa: E731
                                              logprobs=True, top_logprobs=20).choices[0]
    got, plain = ask(spec), ask(ar_client)
    want = ar.generate("w6 w1 w2", 10, chat=True)
    ref = hf_logprobs(hf, want.prompt_ids, want.token_ids)
    tok = ar.session.tokenizer
    assert [c.token for c in got.logprobs.content] == [tok.decode([i]) for i in want.token_ids]
    for j, (c, a) in enumerate(zip(got.logprobs.content, plain.logprobs.content, strict=True)):
        assert abs(c.logprob - a.logprob) < TOL and abs(c.logprob - ref[j, want.token_ids[j]].item()) < TOL
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 20
        assert [t.token for t in c.top_logprobs] == [tok.decode([k]) for k in ref[j].topk(20).indices.tolist()]
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen token ranks first


def test_sampled_logprobs_are_the_raw_distribution_sorted_with_the_chosen_token(servers):
    """Temperature and top-p change which token is drawn, not the numbers reported: they are the
    target's raw log_softmax, so a top list can rank the chosen token anywhere (or not hold it)."""
    spec, _, ar, hf, _ = servers
    got = spec.completions.create(model="tiny", prompt="w1 w2", max_tokens=12, temperature=1.7, top_p=0.9,
                                  seed=3, logprobs=3).choices[0]
    tok = ar.session.tokenizer
    ids = tok.convert_tokens_to_ids(got.logprobs.tokens)
    ref = hf_logprobs(hf, tok.encode("w1 w2"), ids)
    ranks = []
    for j, i in enumerate(ids):
        assert abs(got.logprobs.token_logprobs[j] - ref[j, i].item()) < TOL
        top = list(got.logprobs.top_logprobs[j].items())
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        rank = int((ref[j] > ref[j, i]).sum())
        ranks.append(rank)
        assert top[min(rank, 3)][0] == got.logprobs.tokens[j]  # where it ranks, or appended after the top 3
        assert len(top) == (3 if rank < 3 else 4)
    assert max(ranks) > 0  # a drawn token off the top: the case above is exercised
    chat = spec.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1 w2"}],
                                        max_tokens=12, temperature=1.7, seed=3, logprobs=True,
                                        top_logprobs=2).choices[0].logprobs.content
    for c in chat:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert (c.token in [t.token for t in c.top_logprobs]) == (c.logprob >= c.top_logprobs[1].logprob)


def test_streamed_logprobs_add_up_to_the_answer(servers):
    spec, _, _, _, _ = servers
    kw = dict(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0, logprobs=2)
    whole = spec.completions.create(**kw).choices[0]
    parts = [c.choices[0] for c in spec.completions.create(**kw, stream=True)]
    assert "".join(c.text for c in parts) == whole.text
    lps = [c.logprobs for c in parts if c.logprobs]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(x, field) for x in lps), []) == getattr(whole.logprobs, field), field
    msgs = [{"role": "user", "content": "w4 w5"}]
    ckw = dict(model="tiny", messages=msgs, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    whole = spec.chat.completions.create(**ckw).choices[0].logprobs.content
    streamed = sum((c.choices[0].logprobs.content for c in spec.chat.completions.create(**ckw, stream=True)
                    if c.choices[0].logprobs), [])
    assert streamed == whole and len(whole) > 1


def test_a_stop_string_keeps_the_tokens_whose_text_starts_before_it(servers):
    spec, _, _, _, _ = servers
    kw = dict(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0, logprobs=1)
    full = spec.completions.create(**kw).choices[0]
    stop = full.text[4:7]
    cut = spec.completions.create(**kw, stop=stop).choices[0]
    keep = sum(o < len(cut.text) for o in full.logprobs.text_offset)
    assert cut.finish_reason == "stop" and 0 < keep < len(full.logprobs.tokens)
    assert cut.logprobs.tokens == full.logprobs.tokens[:keep]
    assert cut.logprobs.token_logprobs == full.logprobs.token_logprobs[:keep]
    streamed = sum((c.choices[0].logprobs.tokens for c in spec.completions.create(**kw, stop=stop, stream=True)
                    if c.choices[0].logprobs), [])
    assert streamed == cut.logprobs.tokens


@pytest.mark.parametrize("route,kwargs,name", [
    ("completions", {"logprobs": 6}, "logprobs"), ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"extra_body": {"top_logprobs": 3}}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"), ("chat", {"extra_body": {"logprobs": "many"}}, "logprobs")])
def test_out_of_range_values_get_a_400_naming_the_parameter(servers, route, kwargs, name):
    spec, _, _, _, _ = servers
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            spec.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}], max_tokens=2,
                                         **kwargs)
        else:
            spec.completions.create(model="tiny", prompt="w1", max_tokens=2, **kwargs)
    assert name in str(e.value)


def test_requests_without_logprobs_compute_none(servers, monkeypatch):
    from decoding.batch import scheduler as S

    spec, _, _, _, worker = servers
    deadline = time.monotonic() + 10
    while worker.engine.active and time.monotonic() < deadline:  # a stream the last test cut at its stop
        time.sleep(0.01)                                          # string may still be in its last round
    calls, real = [], S.token_logprobs
    monkeypatch.setattr(S, "token_logprobs", lambda *a: calls.append(1) or real(*a))
    plain = spec.completions.create(model="tiny", prompt="w1 w2", max_tokens=8, temperature=0)
    chat = spec.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}], max_tokens=8,
                                        temperature=0, logprobs=False)
    assert plain.choices[0].logprobs is None and chat.choices[0].logprobs is None and not calls
    asked = spec.completions.create(model="tiny", prompt="w1 w2", max_tokens=8, temperature=0, logprobs=0)
    assert calls and asked.choices[0].text == plain.choices[0].text
    lp = asked.choices[0].logprobs
    assert all(list(t) == [tk] for t, tk in zip(lp.top_logprobs, lp.tokens))  # 0 alternatives: the chosen one
    assert all(math.isfinite(x) and x <= 0 for x in lp.token_logprobs)
