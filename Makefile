# The two front-door commands: `make test` and `make train`. Both create/update .venv first, from the lock.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is not in the lock: the CPU wheel by default; a GPU user installs their own torch into .venv first
# and it is kept (the lock pins everything else, torch's own dependencies included).
TORCH_VERSION ?= 2.13.0
TORCH_SPEC    ?= torch==$(TORCH_VERSION)
LOCK          := requirements.lock
PIP_TOOLS     := pip-tools==7.6.2
PYTEST_ARGS ?=
EXPLORE_SECONDS ?= 600
MUTANTS_ARGS ?=

.PHONY: install test lint clean train lock test-latest test-torch211 test-explore test-zoo test-scale mutants drill

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "$(TORCH_SPEC)"
	$(BIN)/pip install -r $(LOCK)
	$(BIN)/pip install --no-deps -e .
	touch $@

lint: install
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The default experiment: gpt_tiny on the stdlib's bytes, zero3+tp on 4 gloo processes (ARGS= for overrides).
train: install
	$(BIN)/python -m experiments.train $(ARGS)

# Fault drills: kills, hangs, killed saves and NaN batches at random moments, per layout family, each against an
# uninterrupted run, on real gloo processes (>= 50 drills, ~1 h here); the table goes to outputs/drill/drills.md.
# DRILL_ARGS="--quick" for one per family (< 5 min); exits 1 if any drill lost data, hung or resumed unequal.
DRILL_ARGS ?=
drill: install
	$(BIN)/python -m experiments.drill $(DRILL_ARGS)

# Regenerate the lock after changing a dependency in pyproject.toml (then commit both). pip-tools runs from its
# own venv; resolving against the pinned torch keeps the CPU wheel's dependency set (no CUDA packages).
lock:
	test -x .venv-lock/bin/pip-compile || ($(PYTHON) -m venv .venv-lock && .venv-lock/bin/pip install "$(PIP_TOOLS)")
	echo "$(TORCH_SPEC)" > .venv-lock/torch.txt
	CUSTOM_COMPILE_COMMAND="make lock" .venv-lock/bin/pip-compile --quiet --upgrade --extra dev --strip-extras --unsafe-package torch \
	  --no-emit-index-url --no-emit-find-links \
	  --constraint .venv-lock/torch.txt --output-file $(LOCK) pyproject.toml
	! grep -iE "^(nvidia-|triton)" $(LOCK) || (echo "the lock pulled CUDA packages: make the CPU torch wheel reachable (PIP_FIND_LINKS or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)"; exit 1)

# The suite against the newest releases of every dependency (the lock ignored), in its own venv.
# torch stays as installed (constrained: an eager upgrade would pull the newest CUDA build, several GB).
test-latest:
	test -x .venv-latest/bin/python || $(PYTHON) -m venv .venv-latest
	.venv-latest/bin/python -c "import torch" 2>/dev/null || .venv-latest/bin/pip install "$(TORCH_SPEC)"
	.venv-latest/bin/python -c "import torch; print('torch==' + torch.__version__)" > .venv-latest/torch.txt
	.venv-latest/bin/pip install --upgrade --upgrade-strategy eager -c .venv-latest/torch.txt -e ".[dev]"
	SHARDLAB_UNLOCKED=1 .venv-latest/bin/python -m pytest -p no:cacheprovider $(PYTEST_ARGS)

# The suite on torch 2.11, the oldest supported (GPU images ship it), in its own venv; not part of `make test`.
# The registry has only its CUDA build (~530 MB, several GB with the nvidia-* packages). Simulated ranks need
# torch 2.13: those tests skip, naming both versions (tests/conftest.py).
test-torch211:
	test -x .venv-torch211/bin/python || $(PYTHON) -m venv .venv-torch211
	.venv-torch211/bin/python -c "import torch, sys; sys.exit(not torch.__version__.startswith('2.11.'))" 2>/dev/null \
	  || .venv-torch211/bin/pip install "torch==2.11.0"
	.venv-torch211/bin/pip install -r $(LOCK)
	.venv-torch211/bin/pip install --no-deps -e .
	.venv-torch211/bin/python -m pytest -p no:cacheprovider $(PYTEST_ARGS)

# Bug hunting: the property tests with fresh randomness and more examples, for at most EXPLORE_SECONDS.
# Stopping at the limit is not a failure; a falsified property is (hypothesis prints the example to pin).
test-explore: install
	HYPOTHESIS_PROFILE=explore timeout --signal=INT $(EXPLORE_SECONDS) \
	  $(BIN)/python -m pytest -m hypothesis $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 124 ] || [ $$rc -eq 130 ]; then echo "explore: time limit ($(EXPLORE_SECONDS) s) reached"; exit 0; fi; exit $$rc

# The zoo's whole matrix (tests/zoo): every model x layout family x feature, where `make test` runs a sample that
# covers each model, family and feature once (docs/models.md#the-zoo-researchers-models-through-every-feature).
test-zoo: install
	SHARDLAB_ZOO=full $(BIN)/python -m pytest tests/zoo $(PYTEST_ARGS)

# Equivalence at cluster scale: a shrunken Llama-3 under torchtitan's 405B layout (zero3+tp+sp+pp on
# Mesh(pp=8, dp=8, tp=8), interleaved 1F1B, 2 stages per rank) against one device on 512 simulated ranks in this
# process; prints its wall/CPU seconds and peak RSS. SCALE_ARGS="--world 64" for the 64-rank sibling.
SCALE_ARGS ?=
test-scale: install
	$(BIN)/python -m experiments.bench.scale $(SCALE_ARGS)

# Mutation drill: plant each bug listed in tests/mutant_catalog.py in a copy of the tree, run the tests meant to catch it,
# print the kill rate; fails on a survivor not in EQUIVALENT. MUTANTS_ARGS="--only ID ..." or "--list".
mutants: install
	$(BIN)/python -m tests.mutants $(MUTANTS_ARGS)

clean:
	rm -rf $(VENV) .venv-lock .venv-latest .venv-torch211 .pytest_cache .hypothesis .ruff_cache outputs multirun
