"""Expected acceptance sum min(p, q) under temperature (closed forms), the LK losses, and both
logged / selectable in feature-head training; the trained window recorded in the checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
from support.head import data

from training.draft.accept_metrics import combine, expected_acceptance, sd_rounds, walk_sd
from training.head.module import FeatureDistillModule


def logp(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()[None]


def test_equal_distributions_accept_always():
    p = torch.softmax(torch.randn(5, 12), -1)
    ids = torch.arange(12).expand(5, 12)
    for t in (0.3, 0.7, 1.0):
        got = expected_acceptance(ids, p.log(), p.log() + 3.0, t)  # q unnormalised: same law
        torch.testing.assert_close(got, torch.ones(5))


def test_disjoint_supports_never_accept():
    ids = torch.tensor([[0, 1, 2, 3]])
    lp = torch.tensor([[math.log(0.6), math.log(0.4), -math.inf, -math.inf]])
    lq = torch.tensor([[-1e4, -1e4, 0.0, 0.0]])
    assert float(expected_acceptance(ids, lp, lq, 0.7)) == pytest.approx(0.0, abs=1e-6)


def test_hand_computed_case_with_and_without_temperature():
    ids = torch.tensor([[0, 1, 2]])
    lp, lq = logp([0.5, 0.5, 0.0]), logp([0.2, 0.3, 0.5])
    assert float(expected_acceptance(ids, lp, lq, 1.0)) == pytest.approx(0.5)
    # T = 0.5 squares the probabilities: q -> (0.04, 0.09, 0.25) / 0.38, p stays (.5, .5, 0)
    assert float(expected_acceptance(ids, lp, lq, 0.5)) == pytest.approx(0.13 / 0.38)
    # top-k labels: the target's mass is where its ids say, wherever they sit in the row
    perm = torch.tensor([[2, 0]])
    lp2 = torch.tensor([[0.0, -math.inf]])  # p = all on id 2
    assert float(expected_acceptance(perm, lp2, lq, 1.0)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="temperature"):
        expected_acceptance(ids, lp, lq, 0.0)


def test_losses_combine_as_specified():
    ce, acc, w = torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0.2, 0.6, 0.9]), torch.tensor([1.0, 1.0, 0.0])
    assert float(combine("soft_ce", ce, acc, w)) == pytest.approx(2.0)
    assert float(combine("lk_alpha", ce, acc, w)) == pytest.approx(-math.log(0.4))
    lam = math.exp(-3.0 * 0.4)
    assert float(combine("lk_lambda", ce, acc, w, 1.0, 3.0)) == pytest.approx(lam * 2 + (1 - lam) * 0.6)
    with pytest.raises(ValueError, match="loss must be"):
        combine("mse", ce, acc, w)
    with pytest.raises(ValueError, match="loss must be"):
        FeatureDistillModule(loss="mse")


def test_sd_rounds_walk_a_continuation():
    ok = [True] * 7
    assert sd_rounds([0] * 7, ok, 0) == (7, 7)  # never right: one token per target call
    assert sd_rounds([4] * 7, ok, 0) == (2, 10)  # always right (chain of 4): 5 per call
    # hand-walked: t=0 takes 1, t=1 takes 3, t=4 takes 2, t=6 takes 1
    assert sd_rounds([0, 2, 0, 0, 1, 0, 0], ok, 0) == (4, 7)
    assert sd_rounds([0, 2, 0, 0, 1, 0, 0], ok, 2) == (4, 5)  # the walk starts at the prompt's end
    assert sd_rounds([0, 2, 0, 0, 1, 0, 0], ok[:4] + [False] * 3, 0) == (2, 4)  # no label: stop
    assert sd_rounds([], [], 0) == (0, 0)


def test_walk_sd_chains_the_steps_of_each_row():
    t, f = True, False
    step1 = torch.tensor([[t, t, f, t, t, t, t], [f] * 7])
    step2 = torch.tensor([[t, f, t, t, t, f, t], [t] * 7])  # row 1: step 2 right, never reached
    # row 0: leading runs [2, 1, 0, 2, 2, 1, 2] -> rounds at t = 0 (3 tokens), 3 (3), 6 (3)
    valid = torch.ones(2, 7, dtype=torch.bool)
    assert walk_sd([step1, step2], valid, [0, 0]).tolist() == [[3, 9], [7, 7]]
    assert walk_sd([step1, step2], valid, [1, 5]).tolist() == [[3, 8], [2, 2]]  # t = 1 (2), 3 (3), 6 (3)
    assert walk_sd([step1], valid, [0, 0]).tolist() == [[4, 7], [7, 7]]  # one draft: t = 0, 2, 3, 5
    assert walk_sd([step1[:0], step2[:0]], valid[:0], []).shape == (0, 2)


@pytest.mark.parametrize("loss", ["lk_alpha", "lk_lambda"])
def test_acceptance_losses_train_and_validation_logs_acceptance(head_corpus, tmp_path, loss):
    from support.distill import trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from training.head.train import load_feature_module

    torch.manual_seed(0)
    dm = data(head_corpus)
    module = FeatureDistillModule(target=dm.target, steps=2, lr=1e-2, schedule="steps", loss=loss)
    before = trainer().validate(module, datamodule=dm, verbose=False)[0]
    assert 0 < before["val/accept_1"] < 1 and "val/accept_2" in before
    assert 1 <= before["val/sd_tokens_per_call"] <= 3  # a chain of 2 walked: 1..3 per call
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    t = trainer(max_steps=40, callbacks=[ckpt], enable_checkpointing=True,
                val_check_interval=1.0, check_val_every_n_epoch=1000)
    t.fit(module, datamodule=dm)
    after = trainer().validate(module, datamodule=dm, verbose=False)[0]
    assert after["val/accept_1"] > before["val/accept_1"] + 0.05
    assert after["val/sd_tokens_per_call"] > before["val/sd_tokens_per_call"]
    # the trained window: the longest training row (prompt context + completion), kept on load
    state = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)
    assert state["specstop_hparams"]["trained_window"] == max(r["n"] for r in dm.train_rows) > 16
    assert load_feature_module(tmp_path / "last.ckpt").hp["trained_window"] == dm.window
