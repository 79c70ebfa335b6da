"""OpenAI's `logprobs` objects from the engine's TokenLogprob entries (decoding.batch.logprobs).

/v1/completions: the legacy object (`tokens`, `token_logprobs`, `top_logprobs`: a dict per token
of the `logprobs` most likely tokens plus the chosen one, most likely first, `text_offset`: where
each token's text starts in the answer). /v1/chat/completions: `content`, a list of {token,
logprob, bytes, top_logprobs: the `top_logprobs` most likely, most likely first}.

Which tokens: every token the engine committed for the answer (an end-of-text token included),
except after a stop string, where the answer is the tokens whose text starts before the cut. A
stream sends each token with the piece of text its text starts in, so the pieces' entries add up
to the whole answer's."""

from __future__ import annotations

import re
from functools import lru_cache

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_of() -> dict[str, int]:
    """GPT-2 byte-level BPE's character -> byte map (its tokens spell bytes as printable characters)."""
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


class Logprobs:
    """One request's entries as they arrive, and their OpenAI shape (`chat` or legacy)."""

    def __init__(self, tokenizer, chat: bool, top: int):
        self.tokenizer, self.chat, self.top = tokenizer, chat, top
        self.entries: list = []
        self.offsets: list[int] = []
        """Where each token's text starts: the length of the text of the tokens before it."""
        self.ids: list[int] = []
        self.sent = 0
        """Entries already handed out (a stream's earlier pieces)."""

    def add(self, entries) -> None:
        for e in entries:
            before = self.tokenizer.decode(self.ids, skip_special_tokens=True) if self.ids else ""
            self.offsets.append(len(before.rstrip("\ufffd")))  # a half character completes later
            self.ids.append(e.token)
            self.entries.append(e)

    def take(self, chars: int | None = None, empty: bool = False) -> dict | None:
        """The OpenAI object of the entries not handed out yet whose text starts before `chars`
        (None: all of them); where there are none, None (an empty object with `empty`)."""
        end = self.sent
        while end < len(self.entries) and (chars is None or self.offsets[end] < chars):
            end += 1
        if end == self.sent and not empty:
            return None
        part, offsets = self.entries[self.sent:end], self.offsets[self.sent:end]
        self.sent = end
        return self._chat(part) if self.chat else self._legacy(part, offsets)

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _bytes(self, token: int) -> list[int]:
        """The token's own bytes, also where it is part of a character (its text then shows U+FFFD)."""
        text = self._text(token)
        if "\ufffd" in text:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if m := _BYTE_TOKEN.fullmatch(piece or ""):  # sentencepiece's byte fallback
                return [int(m.group(1), 16)]
            if piece and all(c in _byte_of() for c in piece):
                return [_byte_of()[c] for c in piece]
        return list(text.encode("utf-8"))

    def _chat(self, part) -> dict:
        def one(t: int, lp: float) -> dict:
            return {"token": self._text(t), "logprob": lp, "bytes": self._bytes(t)}

        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in part], "refusal": None}

    def _legacy(self, part, offsets) -> dict:
        tops = []
        for e in part:
            top = dict((self._text(t), lp) for t, lp in e.top)
            top.setdefault(self._text(e.token), e.logprob)  # the chosen one, after the likelier ones
            tops.append(top)
        return {"tokens": [self._text(e.token) for e in part], "token_logprobs": [e.logprob for e in part],
                "top_logprobs": tops, "text_offset": offsets}
