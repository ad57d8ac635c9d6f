#!/usr/bin/env bash
# Every figure of docs/benchmarks.md's section "GPU: H200, real model shapes with random weights", in one run on a
# CUDA machine (its steps, run separately on an H200, took about 8 minutes in all), from this repository's root,
# with a python that imports torch, triton, transformers >= 5.24 and this repository's src (e.g. PYTHONPATH=src):
#
#   bash benchmarks/gpu_figures.sh OUT
#
# Each step is bounded by `timeout` and writes into OUT as it goes, so a lease that ends early keeps what finished:
#   1. pytest_value_norm_triton.log, pytest_cuda.log: the kernel against the float32 products under every tile
#      config, and the CUDA path against the CPU's references;
#   2. value_norm_kernel_llama8b.json: one layer's value-norm paths (gpu_selection_cost.py --parts kernel);
#   3. llama8b_shape.json: time to first token, KV and peak memory at Llama-3.1-8B's shape, 32k tokens, batch 1, 4;
#   4. layer_cost_llama8b.json: each piece's cost per layer (--parts layers);
#   5. qwen_shape.json: the same as 3 at Qwen2.5-0.5B's shape, 8k and 32k;
#   6. decode_paths_qwen.json (a diagnosis, not in the docs yet): decode steps of the head-wise methods per attention
#      path, with CUDA's expandable segments, to tell an allocator effect from a path's cost (the first H200 run saw
#      0.5-1.1 s a token for one head-wise method per run, 0.02-0.06 s for the others).
# Settings: CKV_PYTHON (python3), CKV_STEP_SECONDS (a multiplier of every step's time limit, 1).
set -uo pipefail

OUT="${1:?usage: bash benchmarks/gpu_figures.sh OUT}"
PYTHON="${CKV_PYTHON:-python3}"
SCALE="${CKV_STEP_SECONDS:-1}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
started=$(date +%s)

step() {  # step SECONDS LOG COMMAND...: one bounded step, its output in OUT/LOG
    local seconds=$(($1 * SCALE)) log="$OUT/$2"
    shift 2
    echo "[$(($(date +%s) - started)) s] $*"
    timeout "$seconds" "$@" >"$log" 2>&1 || echo "  exit $? (see $log)"
    tail -n 3 "$log"
}

nvidia-smi --query-gpu=name,driver_version --format=csv >"$OUT/environment.txt" 2>&1
"$PYTHON" - >>"$OUT/environment.txt" 2>&1 <<'VERSIONS'
import torch, triton, transformers
print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__)
VERSIONS
cat "$OUT/environment.txt"

step 180 pytest_value_norm_triton.log "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_value_norm_triton.py
step 120 pytest_cuda.log "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_norm_screen.py -k cuda
step 90 kernel.log "$PYTHON" benchmarks/gpu_selection_cost.py --shape llama-3.1-8b --tokens 32768 --batch 1 \
    --parts kernel --out "$OUT/value_norm_kernel_llama8b.json"
step 170 llama8b_shape.log "$PYTHON" benchmarks/gpu_speed_memory.py --shape llama-3.1-8b --lengths 32768 \
    --batch-sizes 1,4 --repeats 3 --decode-steps 2 --methods full,snapkv,critical-snapkv,critical-adakv \
    --out "$OUT/llama8b_shape.json"
step 70 layer_cost.log "$PYTHON" benchmarks/gpu_selection_cost.py --shape llama-3.1-8b --tokens 32768 --batch 1 \
    --parts layers --repeats 2 --out "$OUT/layer_cost_llama8b.json"
step 140 qwen_shape.log "$PYTHON" benchmarks/gpu_speed_memory.py --shape qwen2.5-0.5b --lengths 8192,32768 \
    --batch-sizes 1,4 --repeats 3 --decode-steps 2 --methods full,snapkv,critical-snapkv,adakv,critical-adakv \
    --out "$OUT/qwen_shape.json"
step 90 decode_paths.log env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$PYTHON" benchmarks/gpu_speed_memory.py \
    --shape qwen2.5-0.5b --lengths 8192 --batch-sizes 1 --repeats 2 --decode-steps 8 \
    --methods snapkv,adakv,adakv@attention=padded,adakv@attention=segments,critical-adakv \
    --out "$OUT/decode_paths_qwen.json"
echo "[$(($(date +%s) - started)) s] done: $OUT"
