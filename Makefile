# The two front-door commands: `make test` and (later) `make train`. Both create/update .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# A CPU build by default; a GPU user installs their own torch into .venv first and it is kept.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install test lint clean train

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "$(TORCH_SPEC)"
	$(BIN)/pip install -e ".[dev]"
	touch $@

lint: install
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The default experiment: gpt_tiny on the stdlib's bytes, zero3+tp on 4 gloo processes (ARGS= for overrides).
train: install
	$(BIN)/python -m experiments.train $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache outputs multirun
