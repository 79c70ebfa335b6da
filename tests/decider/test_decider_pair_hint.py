"""A decider refused for another head names, as its hint, only a registered decider fitted for
this head's weights: after a promotion the head keeps its name, and deciders fitted for the
old weights carry that name too."""

from __future__ import annotations

import json

import pytest
from support.head import make_head, make_head_target
from support.models import noisy_copy

from decoding.decider.policy import DeciderConfig, DeciderNet, load_decider, save_decider
from decoding.drafts.io import load_feature_draft, save_feature_draft
from decoding.models import ModelError, fingerprint, load_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("hint")
    target = make_head_target(root / "target")
    t = load_model(target)
    old = load_feature_draft(make_head(target, root / "head", damaged=False), t)
    new = noisy_copy(old, 0.05, seed=2)  # the promoted head: the same name, other weights
    save_feature_draft(new, root / "promoted" / "head", t, {"dtype": "float32"})
    return t, old, load_feature_draft(root / "promoted" / "head", t)


def registry(root, t, heads: dict, latest: str) -> None:
    runs = []
    for run, head in heads.items():
        fp = fingerprint(head)
        assert fp["name"] == "head"
        cfg = DeciderConfig(kind="logistic", rule="tree", model_pair={"target": fingerprint(t), "draft": fp})
        save_decider(root / run, DeciderNet(cfg), cfg, {})
        runs.append({"run_id": run, "model_pair": {"target": fingerprint(t)["name"], "draft": fp["name"]}})
    (root / "registry.json").write_text(json.dumps({"latest": latest, "runs": runs}))


def test_the_hint_names_the_decider_fitted_for_these_weights(tmp_path, pair):
    t, old, new = pair
    registry(tmp_path, t, {"fit-new": new, "fit-old": old}, latest="fit-old")
    with pytest.raises(ModelError, match=r"pass --decider .*fit-new \(fitted for this draft\)"):
        load_decider(tmp_path, t, new)
    load_decider(tmp_path / "fit-new", t, new)  # and it loads


def test_no_decider_for_these_weights_says_to_fit_one(tmp_path, pair):
    t, old, new = pair
    registry(tmp_path, t, {"fit-old-1": old, "fit-old-2": old}, latest="fit-old-2")
    with pytest.raises(ModelError, match="training.fit") as e:
        load_decider(tmp_path, t, new)
    assert "fit-old-1" not in str(e.value)  # same name, other weights: no hint to it
