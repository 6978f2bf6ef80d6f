# The two commands: `make demo` runs the main job, `make test` runs the tests.
# Both create (or reuse) .venv and install torch==2.13.0 (the CPU build) before qbench,
# so nothing pulls a multi-GB CUDA build of torch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
QBENCH := $(VENV)/bin/qbench
MODEL ?= smollm2-135m-instruct
STAMP := $(VENV)/.qbench-installed

.PHONY: setup demo demo-qwen test clean

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

# The main job on the model that can do the tasks: Qwen2.5-Coder-0.5B-Instruct with evals/qwen.yaml, whose GSM8K
# (chat format) and needle subsets are sized so that "not significant" means a difference under about 8 points.
# Far longer than the SmolLM2 demo on 2 cores (see the README); the report goes to artifacts/demo-qwen.
QWEN := qwen2.5-coder-0.5b-instruct
QRUNS := artifacts/runs/demo-qwen
QSUITE := evals/qwen.yaml
demo-qwen: $(STAMP)
	@date +%s > .demo-qwen-start
	@echo "[1/4] pull $(QWEN)"
	$(QBENCH) pull $(QWEN)
	@echo "[2/4] quantize: w8, w4g128, w4g128-h8e8 (head and embedding INT8 too), w4g128-awq"
	$(QBENCH) quantize $(QWEN) --recipe w8 --out artifacts/quant/qwen-w8
	$(QBENCH) quantize $(QWEN) --recipe w4g128 --out artifacts/quant/qwen-w4g128
	$(QBENCH) quantize $(QWEN) --recipe w4g128-h8e8 --out artifacts/quant/qwen-w4g128-h8e8
	$(QBENCH) quantize $(QWEN) --recipe w4g128-awq --calibration-samples 16 --out artifacts/quant/qwen-w4g128-awq
	@echo "[3/4] evaluate with $(QSUITE): fp baseline, then each variant against it"
	rm -rf $(QRUNS)
	$(QBENCH) eval $(QWEN) --suite $(QSUITE) --out $(QRUNS)/fp
	$(QBENCH) eval artifacts/quant/qwen-w8 --suite $(QSUITE) --out $(QRUNS)/w8 --baseline $(QRUNS)/fp
	$(QBENCH) eval artifacts/quant/qwen-w4g128 --suite $(QSUITE) --out $(QRUNS)/w4g128 --baseline $(QRUNS)/fp
	$(QBENCH) eval artifacts/quant/qwen-w4g128-h8e8 --suite $(QSUITE) --out $(QRUNS)/w4g128-h8e8 --baseline $(QRUNS)/fp
	$(QBENCH) eval artifacts/quant/qwen-w4g128-awq --suite $(QSUITE) --out $(QRUNS)/w4g128-awq --baseline $(QRUNS)/fp
	$(QBENCH) eval $(QWEN) --kv kv4 --suite $(QSUITE) --out $(QRUNS)/kv4 --baseline $(QRUNS)/fp
	@echo "[4/4] compare"
	$(QBENCH) compare $(QRUNS)/fp $(QRUNS)/w8 $(QRUNS)/w4g128 $(QRUNS)/w4g128-h8e8 $(QRUNS)/w4g128-awq $(QRUNS)/kv4 \
		--out artifacts/demo-qwen
	@echo "demo-qwen finished in $$(( $$(date +%s) - $$(cat .demo-qwen-start) )) s; the report: artifacts/demo-qwen/report.html"
	@rm -f .demo-qwen-start

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
