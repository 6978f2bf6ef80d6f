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

# The main job: pull, quantize five variants, evaluate six against the fp baseline with the quick suite,
# and write the compare report to artifacts/demo (committed). Runs start fresh so the report matches the code.
RUNS := artifacts/runs/demo
QUICK := evals/quick.yaml
demo: $(STAMP)
	@date +%s > .demo-start
	@echo "[1/4] pull $(MODEL)"
	$(QBENCH) pull $(MODEL)
	@echo "[2/4] quantize: w8, w4g128 (RTN), w4g128-awq (16 calibration windows, to fit the budget), w4g128-kv4"
	$(QBENCH) quantize $(MODEL) --recipe w8 --out artifacts/quant/w8
	$(QBENCH) quantize $(MODEL) --recipe w4g128 --out artifacts/quant/w4g128
	$(QBENCH) quantize $(MODEL) --recipe w4g128-awq --calibration-samples 16 --out artifacts/quant/w4g128-awq
	$(QBENCH) quantize $(MODEL) --recipe w4g128-kv4 --out artifacts/quant/w4g128-kv4
	@echo "[3/4] evaluate with $(QUICK): fp baseline, then each variant against it"
	rm -rf $(RUNS)
	$(QBENCH) eval $(MODEL) --suite $(QUICK) --out $(RUNS)/fp
	$(QBENCH) eval artifacts/quant/w8 --suite $(QUICK) --out $(RUNS)/w8 --baseline $(RUNS)/fp
	$(QBENCH) eval artifacts/quant/w4g128 --suite $(QUICK) --out $(RUNS)/w4g128 --baseline $(RUNS)/fp
	$(QBENCH) eval artifacts/quant/w4g128-awq --suite $(QUICK) --out $(RUNS)/w4g128-awq --baseline $(RUNS)/fp
	$(QBENCH) eval $(MODEL) --kv kv4 --suite $(QUICK) --out $(RUNS)/kv4 --baseline $(RUNS)/fp
	$(QBENCH) eval artifacts/quant/w4g128-kv4 --suite $(QUICK) --out $(RUNS)/w4g128-kv4 --baseline $(RUNS)/fp
	@echo "[4/4] compare"
	$(QBENCH) compare $(RUNS)/fp $(RUNS)/w8 $(RUNS)/w4g128 $(RUNS)/w4g128-awq $(RUNS)/kv4 $(RUNS)/w4g128-kv4 \
		--out artifacts/demo
	@echo "demo finished in $$(( $$(date +%s) - $$(cat .demo-start) )) s; the report: artifacts/demo/report.html (and report.md)"
	@rm -f .demo-start

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
