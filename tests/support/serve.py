"""decoding.serve on tiny models, in process: the saved pair the server tests load, what a served
request must answer (the batch-1 engine's text and finish reason), an app running on a free
loopback port, and a server (uvicorn, its EngineWorker in a thread) over a loaded Decoder."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from support.models import WORDS, noisy_copy, save_tiny, tiny_llama


def save_pair(root):
    """(target dir, draft dir): a tiny Llama over WORDS (64 positions) with a chat template, and a
    noisy copy of it as the draft."""
    from decoding.models import load_tokenizer

    target = tiny_llama(0, vocab=len(WORDS), scale=6, max_pos=64)
    t = save_tiny(root / "target", WORDS, target)
    d = save_tiny(root / "draft", WORDS, noisy_copy(target, 0.03))
    tok = load_tokenizer(t)  # a plain template, so the chat route has one to apply
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(t)
    return t, d


def alone(dec, prompt, n):
    """The batch-1 engine's text for `prompt`: what a served greedy request must answer."""
    return dec.generate(prompt, n).text


def finish_reason(dec, result) -> str:
    """The finish_reason a request must give: stop where the batch-1 engine ended on end of text."""
    return "stop" if result.token_ids and result.token_ids[-1] == dec.session.eos_token_id else "length"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(app):
    """Serve `app` (uvicorn, in a thread); yields its port, stops it after."""
    import uvicorn

    port = free_port()
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


@contextlib.contextmanager
def serving(dec, budget: str = "joint", max_active: int = 4, max_queue: int = 16, max_context: int = 60,
            default_max_tokens: int = 8, model: str = "tiny"):
    """Yields (worker, port) of a server of `dec` under the name `model`; stops both after."""
    from decoding.serve.app import Served, create_app
    from decoding.serve.worker import EngineWorker, batch_engine

    worker = EngineWorker(batch_engine(dec, budget), max_active=max_active, max_queue=max_queue).start()
    eos = dec.session.eos_token_id
    served = Served(model, dec.session.tokenizer, max_context, (eos,) if isinstance(eos, int) else (),
                    default_max_tokens)
    try:
        with running(create_app(served, worker)) as port:
            yield worker, port
    finally:
        worker.close()


def client(port: int, **kw):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, **kw)
