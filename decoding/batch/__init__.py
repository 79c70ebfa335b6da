"""Speculative rounds for several requests in one target forward (the server's engine).

forward.py: the multi-request verify (rows stacked for the linears, attention per request
against its own KV cache); scheduler.py: BatchEngine, requests joining and leaving between
rounds; budget.py: one grow budget across the requests' frontiers; drafting.py: level-by-level
drafting in lockstep for that budget. Tokens/s batched vs one after another: decoding.bench.batch.
"""
