"""decoding.serve --prefill-chunk / --prefill-stall / --prefill-whole: `auto` (the default) reaches
the engine as a chunk sized by time with the stall and whole-prompt bound asked for, a number as a
fixed chunk, 0 as whole prompts, and a bad value is refused in one line before any model loads."""

import pytest

from decoding import Decoder
from decoding.batch.prefill import ChunkSizer, parse_chunk
from decoding.serve.__main__ import batch_engine, main, parser
from support.serve import save_pair


def chunk_of(*argv):
    a = parser().parse_args(list(argv))
    return parse_chunk(a.prefill_chunk, a.prefill_stall, whole=a.prefill_whole)


def test_auto_is_the_default_and_takes_the_stall():
    c = chunk_of()
    assert isinstance(c, ChunkSizer) and c.stall == 1.5
    assert chunk_of("--prefill-stall", "3").stall == 3.0
    assert c.whole == 256 and chunk_of("--prefill-whole", "0").whole == 0
    assert chunk_of("--prefill-chunk", "AUTO", "--prefill-stall", "2.5").stall == 2.5
    assert chunk_of("--prefill-chunk", "64") == 64 and chunk_of("--prefill-chunk", "0") is None


def test_the_engine_gets_the_chunk(tmp_path):
    t, _ = save_pair(tmp_path)
    dec = Decoder.load(t, strategy="ar")
    sizer = chunk_of()
    assert batch_engine(dec, "joint", sizer).chunk is sizer
    assert batch_engine(dec, "joint", 64).chunk == 64 and batch_engine(dec, "joint", None).chunk is None


@pytest.mark.parametrize("argv,flag", [(["--prefill-chunk", "-3"], "--prefill-chunk"),
                                       (["--prefill-chunk", "ten"], "--prefill-chunk"),
                                       (["--prefill-chunk", "1.5"], "--prefill-chunk"),
                                       (["--prefill-stall", "1"], "--prefill-stall"),
                                       (["--prefill-stall", "inf"], "--prefill-stall"),
                                       (["--prefill-chunk", "64", "--prefill-stall", "0.5"], "--prefill-stall"),
                                       (["--prefill-whole", "-3"], "--prefill-whole")])
def test_bad_values_are_refused_in_one_line(argv, flag, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {flag} must be"), err
