"""decoding.bench.prefill_stall's run on tiny models (no timing asserted): each chunk mode gives the
long prompt its first token, in one round whole and over several in chunks, with the per-token
view and the stall ratios in the row; the noise floor times one fixed round; a bad --chunks value
is refused in one line."""

import math

import pytest

from decoding import Decoder
from decoding.bench.prefill_stall import main, noise_floor, run_once
from support.serve import save_pair


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    t, d = save_pair(tmp_path_factory.mktemp("stall"))
    return Decoder.load(t, d, strategy="ti-mcsd", width=2, depth=3, stop="confidence", confidence_rule="grow",
                        grow_cost="measure")


@pytest.mark.parametrize("chunk", ["0", "8", "auto"])
def test_a_run_measures_the_streams_and_the_long_prompt(decoder, chunk):
    streams = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    long = [3 + i % 20 for i in range(40)]
    row = run_once(decoder, chunk, streams, long, arrive=3, new_tokens=12, whole=0)
    assert row["chunk"] == chunk and math.isfinite(row["long_ttft_ms"])
    fewest = {"0": 1, "8": 40 // 8, "auto": 2}[chunk]  # auto: a first chunk of 4, then more
    assert row["long_rounds"] >= fewest and (chunk != "0" or row["long_rounds"] == 1)
    for k in ("after_p99_over_before_p50", "tok_after_p99_over_before_p50", "tok_before_p50"):
        assert row[k] > 0
    assert row["tok_before_p50"] <= row["before_p50"]  # a gap delivers one token or more


def test_the_noise_floor_times_one_fixed_round(decoder):
    floor = noise_floor(decoder, [[3, 4, 5], [6, 7]], times=20)
    assert 0 < floor["p50"] <= floor["p99"] and floor["p99_over_p50"] >= 1


def test_a_bad_chunk_is_refused_in_one_line(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "o"), "--chunks", "0,fast"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --chunks must be")
    assert not (tmp_path / "o").exists()
