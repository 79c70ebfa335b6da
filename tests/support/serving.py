"""A tiny model pair with a chat template, and decoding.serve's app running on a free loopback
port (the server tests)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import uvicorn

from decoding.models import load_tokenizer
from support.models import WORDS, noisy_copy, save_tiny, tiny_llama


def tiny_pair(root: Path) -> tuple[str, str]:
    target = tiny_llama(0, vocab=len(WORDS), scale=6, max_pos=64)
    t = save_tiny(root / "target", WORDS, target)
    d = save_tiny(root / "draft", WORDS, noisy_copy(target, 0.03))
    tok = load_tokenizer(t)  # a plain template, so the chat route has one to apply
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(t)
    return t, d


@contextlib.contextmanager
def running(app):
    """Serve `app`; yields its port, stops it after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(10)
