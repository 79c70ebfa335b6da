"""decoding.bench.context_suite: a held-out prompt padded to a cached context keeps its question
last and has the context's length; the filler text is long enough for the largest context."""

from decoding.bench.context_suite import filler_text, padded


class _Chars:
    """A tokenizer of one token per character, a chat template of one token either side."""

    tokenizer = type("T", (), {"decode": staticmethod(lambda ids: "".join(map(chr, ids)))})()

    @staticmethod
    def prompt_ids(text, chat=False):
        return [1] + [ord(c) for c in text] + [2]


def test_a_prompt_is_padded_to_the_context_with_its_question_last():
    fill = [ord(c) for c in "lorem ipsum " * 100]
    ids = padded(_Chars(), "Q?", 50, fill)
    assert len(ids) == 50 and ids[-3:] == [ord("Q"), ord("?"), 2] and ids[1:6] == fill[:5]
    assert padded(_Chars(), "Q?" * 40, 50, fill) == _Chars.prompt_ids("Q?" * 40)  # longer already: as is


def test_the_filler_covers_the_largest_context():
    assert len(filler_text()) > 4 * 2400  # about 4 characters a token


def test_an_unknown_row_is_one_clear_error_before_any_model_loads():
    import pytest

    from decoding.bench.context_suite import context_suite

    with pytest.raises(ValueError, match="no row default-wide .*default-w1"):
        context_suite((100,), variants=["default", "ar", "default-wide"], target="no/such/dir")
