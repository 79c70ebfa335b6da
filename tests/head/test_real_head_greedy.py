"""Marked `real`: EAGLE-3 heads on the embedded SmolLM2 target give the same greedy text as
`ar` (fp32), loaded through `--draft DIR`: one initialised from the target (untrained) and the
shipped trained head, which the target really accepts (deep tree paths are exercised)."""

from pathlib import Path

import pytest
import torch

from decoding import models
from decoding.drafts.feature import FeatureDraft, FeatureDraftConfig
from decoding.drafts.io import save_feature_draft
from decoding.sampling import SamplingConfig
from decoding.models.session import Session
from decoding.strategies import StrategyConfig, build_engine

pytestmark = pytest.mark.real
N = 24
SHIPPED = Path(__file__).resolve().parents[2] / "checkpoints" / "drafts" / "smollm2-135m-eagle3"


@pytest.mark.parametrize("which", ["untrained", "shipped"])
def test_feature_head_greedy_equals_ar(tmp_path, which):
    head_dir = SHIPPED
    if which == "untrained":
        target = models.load_model(None, "float32")
        cfg = FeatureDraftConfig.from_target(target.config, draft_vocab_size=8192)
        assert cfg.aux_layers == (2, 15, 27) and cfg.rope_theta == 100000.0
        head = FeatureDraft(cfg).init_from_target(target, torch.arange(8192))
        head_dir = save_feature_draft(head, tmp_path / "head", target)
    sess = Session.open(None, head_dir, "float32")  # the kind comes from the checkpoint
    assert isinstance(sess.draft, FeatureDraft)
    greedy = SamplingConfig()
    ids = sess.encode("Name three colors of the rainbow.", chat=True)
    ref, _ = build_engine(sess.target, None, StrategyConfig(strategy="ar"), greedy).generate(ids, N)
    for scfg in (StrategyConfig(strategy="sd", gamma=4), StrategyConfig(strategy="mcsd", k_config="3,2,1"),
                 StrategyConfig(strategy="ti-mcsd", width=3, depth=4, stop="confidence")):
        out, stats = sess.engine(scfg, greedy).generate(ids, N)
        assert out == ref, scfg.name
        assert stats.drafted > 0 and (which == "untrained" or stats.accepted > 0)
