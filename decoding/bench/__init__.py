"""The benchmark: our engine's strategies against plain decoding and against other engines, each
figure measured here (`python -m decoding.bench`, `--suite NAME`). Every module, by its part:

The comparison (`--config configs/bench.yaml`, the default suite):
- cli: the command, its suites' dispatch; __main__ runs it (or gpu_suite for `--suite gpu`);
- compare: the comparison run itself (every row under every condition, the tree-size sweep, the
  run's meta) and its report files;
- config: the typed YAML config; runs: measuring rows (our engine, the Hugging Face peers),
  interleaved repeats, memory, agreement; stats: speedups and bootstrap intervals over prompts;
- report, plots: results.md and the PNGs from results.json; oracle: the oracle-stop bound, read
  from what training wrote; agreement: bf16 outputs against `ar`, near-tie flips told apart;
- quick: `--quick`, the whole pipeline on tiny random models (CI smoke);
- pick_defaults: a report's fastest lossless row as a defaults entry; the maintainer's step
  `python -m decoding.bench.pick_defaults DIR` (make defaults) writes the package's defaults.yaml.

The suites:
- engine_suite (`engine`): `ar` against `model.generate`, and a round's time split;
- dtype (`dtype`): which dtype decodes fastest on this machine;
- forward (`forward`): one target forward by variant and size, with its roofline (roofline, the
  bound from peaks measured by csrc/peaks.cpp), profile (profiling) and the torch.compile
  probe (compiled_forward, `--forwards compiled`);
- cli_suite (`cli`): a `generate` call end to end, as a user waits for it;
- llama (`llama`): llama.cpp against us on one GGUF;
- context_suite (`context`): the default against `ar` and fixed shapes at a given cached context;
- serve_suite (`serve`): our server against llama-server under concurrent clients; serve_load
  (`serve-load`): a real server process under a hostile crowd, every request's outcome counted,
  its memory sampled; serve_client the HTTP client both use (and tests/serve);
- gpu_suite (`gpu`): what a GPU user gets, in one budgeted run; gpu_rows its rows and warm-up;
  gpu_report its page; launches
  the ops a round dispatches besides its graph replays (`python -m decoding.bench.launches`);
- batch (`python -m decoding.bench.batch`): requests batched (decoding.batch) against one after
  another;
- ties (`python -m decoding.bench.ties`): how often bf16 greedy runs reproduce `ar`;
- prefill_stall (`python -m decoding.bench.prefill_stall`): the running streams' latency when a
  long prompt arrives, whole, in fixed chunks or in chunks sized by time.

Benches of what training makes live in training.bench; the packing of a GPU run for a leased
machine is tools/gpu_pack.py, outside the package.
"""
