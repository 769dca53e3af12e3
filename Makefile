# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast test-nightly rehearsal lint clean

setup: $(STAMP)

# The CPU build of torch goes in first, from PyTorch's CPU index, so the project's `torch>=2.11` is already met
# (a plain `pip install torch` on Linux pulls PyPI's multi-GB CUDA build); where that index cannot be reached
# (no retries: seconds), the configured index's torch.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --retries 0 torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
		|| $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m ray_jobs.pretrain

test: $(STAMP)
	$(PY) -m pytest -q

# The 100-step demo end to end (the quick start's `make demo`, ~4 min here); `make test` runs a 4-step one.
test-nightly: $(STAMP)
	$(PY) -m pytest -q --nightly -m nightly

# The lent GPU machine minus the GPU (docs/gpu.md): a venv of the image's packages, a cold start, the check's CPU
# dry run (~5.5 min). CI runs it after the suite; it is also part of test-nightly.
rehearsal: $(STAMP)
	$(PY) -m pytest -q --nightly tests/test_gpu_check.py::test_rehearsal_on_the_image_packages_and_the_bundle

# The lent GPU machine's wheels (docs/gpu.md): Ray and what it needs that the image lacks, for its python 3.12,
# built into gpu-bundle/ (a package index needed here), then installed offline by a dry run of the machine's own pip
# line. A phony target: the folder is its output.
.PHONY: gpu-bundle
gpu-bundle: $(STAMP)
	PYTHON=$(PY) bash bench/gpu_bundle.sh --python-version 3.12 --output gpu-bundle

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not ray"

lint: $(STAMP)
	$(VENV)/bin/ruff check minilm ray_jobs bench tests

clean:
	rm -rf $(VENV) .pytest_cache
