# dflash_offline — every user-facing job is one target here. Variables: TARGET CORPUS CACHE RUN SHARD NPROC RECIPE.
SHELL := /bin/bash
PY_BOOT ?= python3
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
RECIPE ?= manifests/demo.toml
TARGET ?=
CORPUS ?=
CACHE ?=
SHARD ?=
NPROC ?= 1
DEMO_DIR ?= build/demo
export PYTHONUNBUFFERED := 1

.PHONY: setup test test-gpu lint style demo tiny tokenize status clean help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' Makefile | sed 's/:.*## /\t/'

setup: $(VENV)/.installed  ## create the venv and install the project (idempotent)

$(VENV)/.installed: pyproject.toml
	test -x $(PYTHON) || $(PY_BOOT) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q -e '.[dev]'
	touch $@

test: setup  ## CPU test suite (a few minutes on 2 cores)
	$(PYTHON) -m pytest -q -m "not gpu" tests

test-gpu:  ## GPU tests (needs CUDA; run on the device machine)
	$(PYTHON) -m pytest -q -m gpu tests -s

lint: setup  ## check style
	$(PYTHON) -m ruff check dflash_offline stages tests

style: setup  ## rewrite style
	$(PYTHON) -m ruff check --fix dflash_offline stages tests
	$(PYTHON) -m ruff format dflash_offline stages tests

tiny: setup  ## build the embedded default target + tokenizer + bundled corpus into $(DEMO_DIR)
	$(PYTHON) -m stages.build_tiny --out $(DEMO_DIR)/target

tokenize: setup  ## corpus → packed token shards (CORPUS=, TARGET= for the tokenizer, CACHE= to pin the directory)
	$(PYTHON) -m stages.tokenize --recipe=$(RECIPE) --corpus=$(CORPUS) --tokenizer=$(TARGET) --out=$(CACHE)

status: setup  ## shard table and summary of CACHE= (a cache or a directory of caches)
	$(PYTHON) -m stages.status $(or $(CACHE),cache) $(if $(JSON),--json)

demo: setup  ## the whole pipeline on the embedded default, on CPU
	$(PYTHON) -m stages.build_tiny --out $(DEMO_DIR)/target
	$(PYTHON) -m stages.tokenize --recipe=manifests/demo.toml --out=$(DEMO_DIR)/cache/tokens
	$(PYTHON) -m stages.status $(DEMO_DIR)/cache/tokens

clean:  ## remove build outputs and caches made by the demo (never touches CACHE=)
	rm -rf build/demo .pytest_cache
