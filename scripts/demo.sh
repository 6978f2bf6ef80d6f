#!/usr/bin/env bash
# The main job, timed step by step: pull a model, quantize it, evaluate the fp baseline and every variant
# against it with one suite, and write the compare report. Prints what each step took at the end.
#
#   scripts/demo.sh MODEL SUITE REPORT_DIR VARIANT...
#
# A VARIANT is a recipe name (recipes/NAME.yaml, quantized into artifacts/quant/MODEL/NAME), or fp+KV for
# the fp weights with the KV-cache recipe KV given at eval time (--kv KV). Runs go to a new folder,
# artifacts/runs/MODEL-DATE, so the report always matches the code and no earlier run is touched. Recipes that calibrate (AWQ, GPTQ) use
# $CALIBRATION windows (default 16, to fit the time budget; the recipe's own default is larger).
#
# RUNS=artifacts/runs/MODEL-DATE continues an interrupted demo in that folder instead: each eval resumes from
# the items its run already holds (a finished one only reloads), and a quantization whose artifact the same
# qbench code already made from the same model and recipe is kept (quantize --reuse; commits that changed only
# documentation or tests count as the same code). The report's Code and
# Machine lines then name every commit and machine that computed a run.
set -euo pipefail
[ $# -ge 4 ] || { echo "usage: scripts/demo.sh MODEL SUITE REPORT_DIR VARIANT..." >&2; exit 2; }
model=$1 suite=$2 report=$3; shift 3
qbench=${QBENCH:-.venv/bin/qbench}
calibration=${CALIBRATION:-16}
quant=artifacts/quant/$model runs=${RUNS:-artifacts/runs/$model-$(date +%Y%m%d-%H%M%S)}
if [ -n "${RUNS:-}" ] && [ ! -d "$RUNS" ]; then
    echo "RUNS=$RUNS: no such folder; give the runs folder of the demo to continue, or unset RUNS" >&2
    exit 2
fi
timings=()
start=$(date +%s)

step() {  # step LABEL COMMAND...: run it, remember how long it took
    local label=$1 t0
    shift
    echo "== $label"
    t0=$(date +%s)
    "$@"
    timings+=("$(printf '%6d s  %s' $(( $(date +%s) - t0 )) "$label")")
}

step "pull $model" "$qbench" pull "$model"
for v in "$@"; do
    case $v in
        fp+*) ;;
        *) extra=()
           if grep -Eq 'method:\s*(awq|gptq)' "recipes/$v.yaml" 2>/dev/null; then
               extra=(--calibration-samples "$calibration")
           fi
           [ -n "${RUNS:-}" ] && extra+=(--reuse)
           step "quantize $v" "$qbench" quantize "$model" --recipe "$v" --out "$quant/$v" "${extra[@]}" ;;
    esac
done
step "eval fp (baseline)" "$qbench" eval "$model" --suite "$suite" --out "$runs/fp"
names=("$runs/fp")
for v in "$@"; do
    case $v in
        fp+*) step "eval $v" "$qbench" eval "$model" --kv "${v#fp+}" --suite "$suite" --out "$runs/$v" \
                  --baseline "$runs/fp" ;;
        *) step "eval $v" "$qbench" eval "$quant/$v" --suite "$suite" --out "$runs/$v" --baseline "$runs/fp" ;;
    esac
    names+=("$runs/$v")
done
step "compare" "$qbench" compare "${names[@]}" --out "$report"
echo
echo "time per step:"
printf '%s\n' "${timings[@]}"
echo "demo ($model, $suite) finished in $(( $(date +%s) - start )) s; the report: $report/report.html (and report.md)"
