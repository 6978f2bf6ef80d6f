# The two commands: `make demo` runs the main job, `make test` runs the tests.
# Both create (or reuse) .venv and install torch==2.13.0 (the CPU build) before qbench,
# so nothing pulls a multi-GB CUDA build of torch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
QBENCH := $(VENV)/bin/qbench
MODEL ?= smollm2-135m-instruct
STAMP := $(VENV)/.qbench-installed

.PHONY: setup demo test clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(QBENCH) pull $(MODEL)
	$(QBENCH) generate $(MODEL) --chat --max-new-tokens 48 "Explain in two sentences why a KV cache speeds up text generation."
	$(QBENCH) quantize $(MODEL) --recipe w8 --out artifacts/quant/w8
	$(QBENCH) quantize $(MODEL) --recipe w4g64 --out artifacts/quant/w4g64
	$(QBENCH) quantize $(MODEL) --recipe w4g64-head --out artifacts/quant/w4g64-head
	$(QBENCH) bench $(MODEL) --variant artifacts/quant/w8 --variant artifacts/quant/w4g64 \
		--variant artifacts/quant/w4g64-head --out artifacts/bench/$(MODEL).json

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
