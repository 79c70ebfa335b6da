"""The OpenAI-compatible request bodies (pydantic, as FastAPI validates them) and response shapes.

Only what a speculative decoder can honour is accepted; fields OpenAI clients send by default
(`n`=1, `echo` off, ...) are checked rather than silently ignored where they would change
the answer."""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


NEUTRAL = {"user": None, "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
           "top_logprobs": (0,), "echo": (False,), "best_of": (1,), "logit_bias": ({},),
           "response_format": ({"type": "text"},), "parallel_tool_calls": (True, False), "store": (False,),
           "metadata": None, "service_tier": ("auto", "default")}
"""Fields this server does not implement, accepted only at the value that changes nothing (None:
any value, e.g. `user`); a null is always accepted. Any other value, and any field not named
here or below, is refused with a 400 that names it: never silently ignored."""


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # checked by _supported: refused by name, or neutral

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    """None: a random draw per request (a sampled answer is not the same twice)."""
    stream: bool = False
    n: int = 1
    stop: str | list[str] | None = None
    """Up to 4 strings: the text ends before the first one that appears (finish_reason "stop")."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the answer as end of text does (not returned)."""

    @field_validator("n")
    @classmethod
    def _one(cls, v):
        if v != 1:
            raise ValueError("only n=1 is served")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        v = [v] if isinstance(v, str) else (v or [])
        if len(v) > 4 or any(not s for s in v):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v

    @model_validator(mode="after")
    def _supported(self):
        for name, value in (self.model_extra or {}).items():
            ok = NEUTRAL.get(name, ())
            if value is None or (name in NEUTRAL and (ok is None or value in ok)):
                continue
            raise ValueError(f"{name} is not supported by this server" + (f" (only {ok[0]!r})" if ok else ""))
        return self

    def budget(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    """The chosen token's logprob and this many alternatives (decoding.serve.logprobs)."""

    def alternatives(self) -> int | None:
        """Alternatives each token's logprobs list (None: no logprobs)."""
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _nonempty(cls, v):
        if not v:
            raise ValueError("prompt is empty")
        return v


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[Message]
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages")
    @classmethod
    def _nonempty(cls, v):
        if not v:
            raise ValueError("messages is empty")
        return v


def error(message: str, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _head(kind: str, model: str) -> dict:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()), "model": model}


def completion(model: str, text: str, finish: str, prompt_tokens: int, tokens: int,
               logprobs: dict | None = None) -> dict:
    return {**_head("text_completion", model),
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
            "usage": usage(prompt_tokens, tokens)}


def chat_completion(model: str, text: str, finish: str, prompt_tokens: int, tokens: int,
                    logprobs: dict | None = None) -> dict:
    return {**_head("chat.completion", model),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": logprobs, "finish_reason": finish}],
            "usage": usage(prompt_tokens, tokens)}


def usage(prompt_tokens: int, tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}


class Chunks:
    """The server-sent events of one streamed answer (same id and creation time throughout)."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.head = _head("chat.completion.chunk" if chat else "text_completion", model)

    def piece(self, text: str, finish: str | None = None, first: bool = False, logprobs: dict | None = None) -> dict:
        if self.chat:
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
            return {**self.head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                              "finish_reason": finish}]}
        return {**self.head, "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
