#!/usr/bin/env bash
# The CUDA check, one script for a machine with one NVIDIA GPU (at most GPU_CHECK_BUDGET seconds of steps, 450 by
# default, so that it fits a single 8-minute call; each step has its own limit too, cut to what is left):
#   bash bench/gpu_check.sh            # runs every step, prints one summary table, logs under $OUT
#   bash bench/gpu_check.sh --dry-run  # prints the steps only
#   bash bench/gpu_check.sh --more     # then the earlier round's steps (forced families, GEMM ablations) too
# Steps: environment; the CUDA tests (CUDA graphs, Triton kernels compiled for the GPU, kernel choice); the op bench
# in bf16 at Flux's real shapes with each fused op's bandwidth against a copy's (`bench ops --device cuda --json`);
# `wide` and `mid` Flux in bf16, each in one process: eager, mindiesd (its kernels chosen by measuring each site on
# the GPU: kernel_choice="auto"), mindiesd captured, Inductor default and reduce-overhead, with compile times; and
# last the record docs/gpu-results.json (written to $OUT/gpu-results.json: copy it to docs/ and commit it).
# Without a GPU it says so and exits 0 after the environment step.
# On this workplace's H200 image (torch in a venv, no network), from the repository root:
#   export PATH=/opt/torch/.venv/bin:$PATH OUT=/tmp/gc; bash bench/gpu_check.sh   (carry .whl/ with diffusers' wheels)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT_DIR"
DRY=0
MORE=0
BUDGET="${GPU_CHECK_BUDGET:-450}"
# the elementwise families declared not faster than eager on CUDA (uncaptured), forced on to measure them captured
FORCE_ELEMENTWISE="--force rms_norm --force norm_rope --force adalayernorm --force fast_gelu --force mul_add"
for arg in "$@"; do
  case $arg in --dry-run) DRY=1 ;; --more) MORE=1 ;; *) echo "gpu_check: unknown option $arg"; exit 2 ;; esac
done
MODEL_VS="--dtype bf16 --device cuda --capture --vs inductor --vs inductor-ro --markdown"

STEPS=(
  "tests|150|python -m pytest -rfE --tb=line -q -p no:cacheprovider tests/compile/test_cuda_graphs.py tests/ops/test_triton_kernels.py tests/compile/test_layout.py tests/compile/test_gemm.py tests/compile/test_python_runner.py tests/compile/test_kernel_choice.py"
  "ops_cuda_bf16|60|python -m mindiesd bench ops --device cuda --dtype bf16 --no-inductor --markdown --json $OUT_DIR/ops_cuda_bf16.json"
  "flux_wide_bf16|150|python -m mindiesd bench model --model flux --size wide $MODEL_VS --json $OUT_DIR/flux_wide_bf16.json"
  "flux_mid_bf16|80|python -m mindiesd bench model --model flux --size mid $MODEL_VS --json $OUT_DIR/flux_mid_bf16.json"
)
# after the steps, whatever they left (outside the budget): the record of this check
RESULTS="python -m mindiesd.benchmarks.gpu_results --ops $OUT_DIR/ops_cuda_bf16.json --models $OUT_DIR/flux_wide_bf16.json $OUT_DIR/flux_mid_bf16.json --out $OUT_DIR/gpu-results.json"
MORE_STEPS=(
  "flux_mid_bf16_forced_capture|50|python -m mindiesd bench model --model flux --size mid --dtype bf16 --device cuda --capture $FORCE_ELEMENTWISE --markdown --json $OUT_DIR/flux_mid_bf16_forced.json"
  "flux2_bf16_capture|40|python -m mindiesd bench model --model flux2 --size tiny --dtype bf16 --device cuda --capture --markdown --json $OUT_DIR/flux2_bf16.json"
  "flux_mid_bf16_gemm|60|python -m mindiesd bench model --model flux --size mid --dtype bf16 --device cuda --force merge_projections --force linear_gelu --ablate --markdown --json $OUT_DIR/flux_mid_bf16_gemm.json"
  "flux_mid_cat_linear|50|python -m mindiesd bench model --model flux --size mid --device cuda --force cat_linear --ablate --markdown --json $OUT_DIR/flux_mid_cat_linear.json"
)
(( MORE )) && STEPS+=("${MORE_STEPS[@]}")

if (( DRY )); then
  for step in "${STEPS[@]}"; do IFS='|' read -r name limit cmd <<<"$step"; echo "[$name, ${limit}s] $cmd"; done
  echo "[results, 30s] $RESULTS"
  exit 0
fi

{
  echo "== environment"
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not found"
  python - <<'PY'
import importlib.util, sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda build", torch.version.cuda)
print("cuda available:", torch.cuda.is_available(), "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
print("triton:", importlib.util.find_spec("triton") is not None)
PY
} 2>&1 | tee "$OUT_DIR/environment.txt"

# The project runs from this checkout (no install: the GPU image's torch may be older than the pinned one and
# nothing can be downloaded there). diffusers, where the image lacks it, comes as wheels in .whl/ (carried):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl diffusers==0.42.1 importlib_metadata
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! python -c "import diffusers" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  echo "== installing the carried wheels (.whl/) into /tmp/gpu_check_site"
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site .whl/*.whl 2>&1 | tail -3
  export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
fi
python -c "import mindiesd, diffusers" || echo "gpu_check: mindiesd or diffusers cannot be imported; the model steps will fail"
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible to torch (a CPU-only torch, or no GPU): nothing to measure"
  exit 0
fi

declare -a SUMMARY
budget_start=$(date +%s)
for step in "${STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$step"
  left=$(( BUDGET - ($(date +%s) - budget_start) ))
  if (( left < 20 )); then
    SUMMARY+=("| $name | skipped | 0s | the ${BUDGET}s budget is spent |")
    continue
  fi
  (( limit > left )) && limit=$left
  echo "== $name: $cmd"
  start=$(date +%s.%N)
  timeout "$limit" bash -c "$cmd" >"$OUT_DIR/$name.log" 2>&1
  rc=$?
  seconds=$(python -c "print(f'{$(date +%s.%N) - $start:.0f}')")
  tail -15 "$OUT_DIR/$name.log"
  case $rc in 0) status=ok ;; 124) status=timeout ;; *) status="failed($rc)" ;; esac
  key=$(grep -E "passed|failed" "$OUT_DIR/$name.log" | tail -1)
  [[ -z "$key" ]] && key=$(grep -E "^\| (flux|mul_add)|gpu_results:" "$OUT_DIR/$name.log" | tail -1 | cut -c1-160)
  SUMMARY+=("| $name | $status | ${seconds}s | ${key:-see $name.log} |")
done

echo "== results: $RESULTS"
timeout 30 bash -c "$RESULTS" 2>&1 | tee "$OUT_DIR/results.log"

echo
echo "== summary (logs in $OUT_DIR)"
echo "| step | status | time | key figure |"
echo "|---|---|---|---|"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT_DIR/summary.md"
