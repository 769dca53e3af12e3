# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast test-nightly lint bench clean

setup: $(STAMP)

# The CPU build of torch goes in first so the project's `torch>=2.6` is already met
# (a plain `pip install torch` can pull a multi-GB CUDA build).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 || $(PY) -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m ray_jobs.pretrain

test: $(STAMP)
	$(PY) -m pytest -q

# The 100-step demo end to end (the quick start's `make demo`, ~4 min here); `make test` runs a 4-step one.
test-nightly: $(STAMP)
	$(PY) -m pytest -q --nightly -m nightly

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not ray"

lint: $(STAMP)
	$(VENV)/bin/ruff check minilm ray_jobs bench tests

clean:
	rm -rf $(VENV) .pytest_cache
