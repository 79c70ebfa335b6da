"""models.set_head_dtype: a bf16 target whose final norm and output layer run in fp32."""

import pytest
import torch

from support.models import tiny_llama
from decoding import models
from decoding.bench.agreement import check_greedy
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine


def test_fp32_head_on_a_bf16_model():
    bf = tiny_llama(3, scale=6).to(torch.bfloat16)
    fp = models.set_head_dtype(tiny_llama(3, scale=6).to(torch.bfloat16), "float32")
    fp_before = models.fingerprint(bf)
    assert models.fingerprint(fp) == fp_before  # deciders for the pair still apply
    assert fp.get_output_embeddings().weight.dtype == torch.float32
    assert fp.get_input_embeddings().weight.dtype == torch.bfloat16
    x = torch.tensor([[4, 2, 7, 1, 9]])
    with torch.no_grad():
        want = tiny_llama(3, scale=6).to(torch.bfloat16).float()(x).logits  # bf16 weights, fp32 math
        got_bf, got_fp = bf(x).logits, fp(x).logits
    assert got_fp.dtype == torch.float32 and got_bf.dtype == torch.bfloat16
    # same body: the fp32 head only removes the rounding of the norm's output and the logits
    assert (got_fp - want).abs().max() < (got_bf.float() - want).abs().max()
    assert not torch.equal(got_fp, got_bf.float())
    ar = build_engine(fp, None, StrategyConfig(strategy="ar"), SamplingConfig())
    sd = build_engine(fp, tiny_llama(8, layers=1, scale=6).to(torch.bfloat16),
                      StrategyConfig(strategy="sd", gamma=3), SamplingConfig())
    ref, out = ar.generate([4, 2], 24)[0], sd.generate([4, 2], 24)[0]
    assert check_greedy(fp, [4, 2], ref, out, "bfloat16").kind != "mismatch"


def test_head_dtype_needs_a_final_norm_and_a_known_dtype():
    with pytest.raises(models.ModelError, match="final norm"):
        models.set_head_dtype(torch.nn.Linear(2, 2), "float32")
    with pytest.raises(models.ModelError, match="unknown dtype"):
        models.load_model("/nonexistent", "bfloat16", head_dtype="fp64")


def test_ties_report_marks_mismatches_and_refuses_bad_input(capsys):
    from decoding.bench.ties import main, markdown

    k = {"equal": 1, "tie": 1, "mismatch": 1, "n": 3,
         "differences": [{"prompt": 1, "kind": "tie", "position": 4, "gap": 0.0, "tolerance": 1.0},
                         {"prompt": 2, "kind": "mismatch", "position": 0, "gap": 5.0, "tolerance": 1.0}]}
    eq = {"equal": 3, "tie": 0, "mismatch": 0, "n": 3, "differences": []}
    res = {"meta": {"date": "d", "prompts": "p", "n_prompts": 3, "new_tokens": 8, "threads": 1, "torch": "t",
                    "draft": "x"},
           "conditions": [{"head_dtype": "float32", "ar_tokens_per_s": 10.0, "ar_vs_fp32_ar": eq,
                           "rows": [{"name": "sd", "tokens_per_s": 20.0, "speedup": 2.0, "vs_ar": k}]}]}
    md = markdown(res, "cmd")
    assert "| float32 | sd | 20.0 | 2.00x | 1/1/1 of 3 **MISMATCH** (gap/tolerance: 0/1, 5/1) |" in md
    assert main(["-n", "0"]) == 2
    assert capsys.readouterr().err.startswith("error:")
