"""An OpenAI-compatible HTTP server over continuous batching of speculative rounds
(`python -m decoding.serve`): app.py the routes, worker.py the engine's thread, protocol.py the
request and response shapes."""
