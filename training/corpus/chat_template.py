"""The target's chat template as the data tools need it: rendering, assistant-token masks and
the bare user prefix (Magpie).

The loss mask of a conversation covers the assistant turns only, each with its end-of-turn
token (what the target itself generates before it stops) and nothing of the template's role
headers. Templates that mark assistant text with `{% generation %}` give it directly
(`return_assistant_tokens_mask`); for the others (SmolLM2's among them) the spans come from
rendering prefixes: the conversation up to assistant turn i with the generation prompt ends
where turn i starts, the conversation through turn i ends at or after its end-of-turn token.
Characters map to tokens through the tokenizer's offsets, so no prefix is tokenized alone.
"""

from __future__ import annotations

SENTINEL = "\u2063specstop-user-text\u2063"  # invisible separator: no template writes it


def render(tok, messages: list[dict], generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(messages, tokenize=False,
                                   add_generation_prompt=generation_prompt)


def encode(tok, text: str) -> list[int]:
    """Token ids of rendered text (the template writes every special token itself)."""
    return list(tok(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tok, messages: list[dict]) -> list[int]:
    """What the target reads before it writes the next assistant turn."""
    return encode(tok, render(tok, messages, generation_prompt=True))


def has_generation_marks(tok) -> bool:
    return "{% generation %}" in (tok.chat_template or "").replace("{%-", "{%").replace("-%}", "%}")


def assistant_char_spans(tok, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(full text, [start, end) of every assistant turn): content plus end-of-turn token."""
    full = render(tok, messages)
    eos = tok.eos_token or ""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(tok, messages[:i], True), render(tok, messages[: i + 1])
        if not (full.startswith(before) and full.startswith(through)) or len(through) < len(before):
            raise ValueError("the chat template does not render conversations incrementally "
                             "(an earlier turn changes when later ones follow); it needs "
                             "{% generation %} marks for its assistant masks")
        seg = through[len(before):]
        cut = seg.rfind(eos) if eos else -1
        spans.append((len(before), len(before) + (cut + len(eos) if cut >= 0 else len(seg))))
    return full, spans


def assistant_mask(tok, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """(token ids of the whole conversation, True where an assistant token is)."""
    if has_generation_marks(tok):
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        return list(out["input_ids"]), [bool(x) for x in out["assistant_masks"]]
    full, spans = assistant_char_spans(tok, messages)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a <= s and e <= b for a, b in spans) and e > s for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def mask_runs(mask: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    runs, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def user_prefix(tok, system: str | None = None) -> str:
    """The text the template writes before a user's words (Magpie's pre-query template): an
    instruct model continuing it writes a plausible user turn and ends it with its own
    end-of-turn token. A default system prompt the template adds stays in."""
    msgs = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": SENTINEL}]
    text = render(tok, msgs)
    if SENTINEL not in text:
        raise ValueError("the chat template does not write the user's text verbatim")
    return text[: text.index(SENTINEL)]
