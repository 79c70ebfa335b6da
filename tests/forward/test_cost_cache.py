"""decoding.forward.cost_cache: a grown tree's measured cost curve is timed once per machine, pair,
dtype and thread count, then read back; anything else is a miss, never a stale hit. A hit is
trusted; re-timing is asked for explicitly (tested with made-up timings)."""

import json

import torch

from support.models import tiny_llama
from decoding.forward import cost as cost_timing
from decoding.forward.cost_cache import RETIME_ENV, cached_cost, cost_key


def test_timed_once_then_read_back_and_keyed_on_what_it_depends_on(tmp_path):
    target, draft = tiny_llama(0, vocab=32, layers=2), tiny_llama(1, vocab=32, layers=1)
    first, how = cached_cost(target, draft, tmp_path, None)
    assert "now" in how and len(list(tmp_path.glob("*.json"))) == 1
    again, how = cached_cost(target, draft, tmp_path, None)
    assert "earlier" in how and again == first
    stored = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert stored["key"] == cost_key(target, draft) and stored["key"]["dtype"] == "float32"
    # another draft, another dtype or thread count: a new curve, the first one kept
    other = tiny_llama(2, vocab=32, layers=1)
    assert "now" in cached_cost(target, other, tmp_path, None)[1]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert "now" in cached_cost(target, draft, tmp_path, None)[1]
    finally:
        torch.set_num_threads(threads)
    assert "now" in cached_cost(target.to(torch.bfloat16), draft.to(torch.bfloat16), tmp_path, None)[1]
    assert len(list(tmp_path.glob("*.json"))) == 4
    assert "earlier" in cached_cost(target.float(), draft.float(), tmp_path, None)[1]


def test_a_corrupt_or_unwritable_cache_only_costs_a_re_timing(tmp_path):
    target, draft = tiny_llama(0, vocab=32, layers=2), tiny_llama(1, vocab=32, layers=1)
    cached_cost(target, draft, tmp_path, None)
    f = next(tmp_path.glob("*.json"))
    f.write_text("{not json")
    curve, how = cached_cost(target, draft, tmp_path, None)
    assert "now" in how and json.loads(f.read_text())["curve"]["sizes"] == curve.sizes
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache directory should be
    curve, how = cached_cost(target, draft, blocked / "cost")
    assert "now" in how and curve.sizes


def test_a_curve_stored_in_the_old_unit_is_a_miss(tmp_path):
    """Curves stored before sizes counted new tokens (no unit, 7 sizes) are re-timed, not read."""
    target, draft = tiny_llama(0, vocab=32, layers=2), tiny_llama(1, vocab=32, layers=1)
    cached_cost(target, draft, tmp_path, None)
    f = next(tmp_path.glob("*.json"))
    stored = json.loads(f.read_text())
    assert stored["curve"]["unit"] == "tokens" and stored["key"]["unit"] == "tokens"
    old_key = {k: v for k, v in stored["key"].items() if k not in ("sizes", "unit")}
    f.write_text(json.dumps({"key": old_key, "curve": {k: v for k, v in stored["curve"].items() if k != "unit"}}))
    assert "now" in cached_cost(target, draft, tmp_path, None)[1]


def test_a_hit_is_trusted_and_re_timed_only_when_asked(tmp_path, monkeypatch):
    """A stored curve is read back whatever today's timings say (a busy moment must
    not cost a 10-30 s re-timing); $SPECSTOP_RETIME_COST (or retime=True) re-times and overwrites."""
    target, draft = tiny_llama(0, vocab=32, layers=2), tiny_llama(1, vocab=32, layers=1)
    today = {n: 30.0 + n for n in range(1, 65)}
    calls = []

    def fake(model, sizes, repeats=3, context=256, verify=True):
        calls.append(list(sizes))
        return [today[n] for n in sizes]

    monkeypatch.setattr(cost_timing, "time_forwards", fake)
    monkeypatch.delenv(RETIME_ENV, raising=False)
    first, how = cached_cost(target, draft, tmp_path)
    assert "now" in how and first.target(8) == today[8]
    today = {n: 3 * v for n, v in today.items()}  # the machine is busy now: 3x slower
    calls.clear()
    kept, how = cached_cost(target, draft, tmp_path)
    assert "earlier" in how and kept.target(8) == first.target(8) and not calls  # nothing timed
    monkeypatch.setenv(RETIME_ENV, "1")
    again, how = cached_cost(target, draft, tmp_path)
    assert "now" in how and again.target(8) == today[8] and calls
    monkeypatch.setenv(RETIME_ENV, "0")
    assert cached_cost(target, draft, tmp_path)[0].target(8) == today[8]  # the re-timed one, stored
    assert "now" in cached_cost(target, draft, tmp_path, retime=True)[1]


def test_the_key_names_the_forward_and_whether_the_cpu_kernels_run_it():
    """A curve timed on the CPU kernels is not the curve of the same forward without them
    (SPECSTOP_CPU_KERNELS=0, or set_forward(kernels=False))."""
    from decoding.forward import kernels
    from decoding.forward.packed import packed_available, set_forward

    target, draft = tiny_llama(0, vocab=32, layers=2), tiny_llama(1, vocab=32, layers=1)
    assert cost_key(target, draft)["forward"] == "eager"
    if not packed_available(torch.float32, "cpu"):
        return
    set_forward(target, "lean", kernels=False)
    off = cost_key(target, draft)["forward"]
    set_forward(target, "lean")
    on = cost_key(target, draft)["forward"]
    assert off.startswith("lean-r") and not off.endswith("-kernels")
    assert on == off + ("-kernels" if kernels.available() else "")
