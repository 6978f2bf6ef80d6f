# The two commands: `make demo` runs the main job, `make test` runs the tests.
# Both create (or reuse) .venv and install torch==2.13.0 (the CPU build) before qbench,
# so nothing pulls a multi-GB CUDA build of torch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
QBENCH := $(VENV)/bin/qbench
STAMP := $(VENV)/.qbench-installed

.PHONY: setup demo demo-smollm2 test clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# The main job, on the model that can do the tasks: Qwen2.5-Coder-0.5B-Instruct with evals/qwen.yaml (GSM8K-CoT
# in the chat format on 300 items, needle at 4k tokens, KLD, PPL). Variants: w8, w4g128 (RTN), the same
# with an INT8 head and INT8 embedding (h8e8), w4g128-awq, the mix `qbench tune` chose for a KLD budget of 0.05
# (recipes/qwen2.5-coder-tune-kld0.05.yaml), and the fp weights with a K4V4 cache. The report goes to
# artifacts/demo (committed); scripts/demo.sh prints the time of every step.
demo: $(STAMP)
	QBENCH=$(QBENCH) bash scripts/demo.sh qwen2.5-coder-0.5b-instruct evals/qwen.yaml artifacts/demo \
		w8 w4g128 w4g128-h8e8 w4g128-awq qwen2.5-coder-tune-kld0.05 fp+kv4

# The second, faster section: SmolLM2-135M-Instruct with the quick suite (no task signal: it scores 0 on
# GSM8K), report in artifacts/demo-smollm2; smollm2-tune-kld0.1 is the mix `qbench tune` chose for a KLD budget of 0.1.
demo-smollm2: $(STAMP)
	QBENCH=$(QBENCH) bash scripts/demo.sh smollm2-135m-instruct evals/quick.yaml artifacts/demo-smollm2 \
		w8 w4g128 w4g128-awq smollm2-tune-kld0.1 fp+kv4 w4g128-kv4

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
