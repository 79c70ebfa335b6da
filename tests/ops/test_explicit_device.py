"""Device handling is explicit (`--device cuda`), checked without a GPU.

Seam: run on CPU data under `torch.device("meta")` as the DEFAULT device. Every tensor made
without an explicit device (a random draw that ignores its generator's device, a feature
built beside CUDA q's on the CPU) then lands on `meta` and the run fails, exactly where a
CUDA run would mix devices. A correct run gives the same output as outside the context.
"""

import pytest
import torch

from support.models import tiny_llama
from decoding.models import session as S
from decoding.decider.policy import DeciderConfig, DeciderNet, DeciderStop
from decoding.sampling import SamplingConfig, multinomial, uniforms
from decoding.strategies import StrategyConfig, build_engine
from decoding.stopping import make_stop_policy


def test_draws_use_the_generators_device():
    ref = torch.rand(4, generator=torch.Generator().manual_seed(3)).tolist()
    with torch.device("meta"):  # the default device is not the generator's
        u = uniforms(4, torch.Generator().manual_seed(3))
        toks = multinomial(torch.tensor([0.0, 1.0, 0.0], device="cpu"), 1, torch.Generator().manual_seed(0))
    assert u == ref and toks == [1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("stop", ["decider-paper", "decider-tree", "confidence", "fixed"])
def test_engine_makes_no_tensor_on_the_default_device(pair, temperature, stop):
    target, draft = pair
    if stop.startswith("decider"):
        cfg = DeciderConfig(kind="mlp", threshold=0.1, rule=stop.split("-")[1])
        policy = DeciderStop(DeciderNet(cfg), cfg)
    else:
        policy = make_stop_policy(stop, 0.1, "tree")
    eng = build_engine(target, draft, StrategyConfig("ti-mcsd", width=3, depth=3, stop=stop.split("-")[0]),
                       SamplingConfig(temperature), policy)
    ref, _ = eng.generate([1, 2, 3], 10, None, seed=0)
    with torch.device("meta"):
        out, _ = eng.generate([1, 2, 3], 10, None, seed=0)
    assert out == ref and len(out) == 10


def test_decider_is_moved_to_the_drafts_device(monkeypatch):
    cfg = DeciderConfig(kind="logistic", threshold=0.3)
    net = DeciderNet(cfg)
    monkeypatch.setattr(S, "load_decider", lambda *a, **k: (net, cfg))
    draft = tiny_llama(1, vocab=16, layers=1, hidden=16).to("meta")  # stands in for a CUDA draft
    sess = S.Session(target=tiny_llama(0, vocab=16, layers=1, hidden=16), draft=draft, tokenizer=None,
                     target_dir=None, draft_dir=None)
    stop = sess.decider_stop("some-dir")
    assert {p.device.type for p in stop.net.parameters()} | {b.device.type for b in stop.net.buffers()} == {"meta"}


def test_cuda_without_a_device_is_one_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(S.ModelError, match="no CUDA device"):
        S.Session.open(device="cuda")
