"""The forward suite's roofline: a forward's bytes and flops by its shapes, the bound as the
larger of its two sides, and the probes that measure this machine."""

import pytest
import torch

from support.models import tiny_llama
from decoding.forward import kernels
from decoding.bench import roofline


def test_work_counts_each_linear_once_and_the_attention_by_shape():
    m = tiny_llama(layers=2, hidden=32, vocab=32)  # 4 heads of 8, 2 kv heads, MLP 64, untied
    per_layer = 32 * 32 + 2 * (16 * 32) + 32 * 32 + 3 * (64 * 32)  # q, k + v, o, gate + up + down
    w = roofline.work_of(m)
    assert w.linear_params == 2 * per_layer + 32 * 32  # + the output layer
    assert w.weight_bytes == 4 * w.linear_params
    assert w.kv_bytes_per_token == 2 * 2 * 2 * 8 * 4  # k and v, 2 layers, 2 kv heads of 8, fp32
    assert w.attention_flops_per_pair == 4 * 2 * 4 * 8
    layers = m.model.layers
    layers[1].self_attn.o_proj.weight = layers[0].self_attn.o_proj.weight  # shared: read once
    assert roofline.work_of(m).linear_params == w.linear_params - 32 * 32
    assert roofline.work_of(m.to(torch.bfloat16)).weight_bytes == 2 * (w.linear_params - 32 * 32)


def test_bound_is_the_larger_side():
    w = roofline.Work(weight_bytes=10**9, linear_params=5 * 10**8, kv_bytes_per_token=0, attention_flops_per_pair=0)
    p = roofline.Peaks(1, read_gbps=10.0, fp32_gflops=100.0, bf16_gflops=1000.0, bf16_unit="test")
    one = roofline.bound_ms(w, 1, 0, torch.float32, p)
    assert one["memory_ms"] == pytest.approx(100.0) and one["compute_ms"] == pytest.approx(10.0)
    assert one["ms"] == pytest.approx(100.0)  # 1 token: reading the weights
    sixteen = roofline.bound_ms(w, 16, 0, torch.float32, p)
    assert sixteen["ms"] == pytest.approx(160.0)  # 16 GFLOP at 100 GFLOP/s: the FMAs
    assert roofline.bound_ms(w, 16, 0, torch.bfloat16, p)["ms"] == pytest.approx(100.0)
    cache = roofline.Work(0, 0, kv_bytes_per_token=10**6, attention_flops_per_pair=10**6)
    got = roofline.bound_ms(cache, 2, 98, torch.float32, p)
    assert got["memory_ms"] == pytest.approx(10.0) and got["compute_ms"] == pytest.approx(2.0)


def test_suite_rows_and_report_section():
    w = roofline.Work(10**9, 5 * 10**8, 0, 0)
    p = roofline.Peaks(1, 10.0, 100.0, 1000.0, "test")
    rows = roofline.suite_rows({"float32": w}, [1, 16], 0, p, {"float32 lean": {1: 150.0, 16: 240.0}, "bfloat16 x": {1: 1.0, 16: 1.0}})
    assert rows["over_bound"] == {"float32 lean": {1: pytest.approx(1.5), 16: pytest.approx(1.5)}}
    text = "\n".join(roofline.markdown(rows, [1, 16], 1))
    assert "| float32 | 100.0 [1.00] | 160.0 [1.60] |" in text and "| float32 lean | 1.50 | 1.50 |" in text


@pytest.mark.skipif(not kernels.available(), reason=f"cpu kernels: {kernels.why_not()}")
def test_probes_measure_something_plausible():
    p = roofline.measure(1, repeats=1, read_mib=64, fma_iters=2_000_000)
    assert 1 < p.read_gbps < 1000 and 10 < p.fp32_gflops < 10_000 and p.bf16_gflops > p.fp32_gflops / 2
    assert p.bf16_unit == ("AMX tiles" if kernels.amx() else "AVX512-BF16")
    assert torch.get_num_threads() == 1  # put back as it was
