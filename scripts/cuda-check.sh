#!/usr/bin/env bash
# The CUDA path, on a machine with an NVIDIA GPU: the engine against transformers on the GPU (eagerly and
# with decode graphs, inference/decode_graphs.py), then the offline benchmark in float32 and bfloat16,
# eager and with decode graphs, one after another. Writes check.log, tests.log and one JSON per benchmark
# run into the folder given (default: cuda-check). Uses the python3 on PATH, whose torch must see the GPU
# and which must hold the project's dependencies (transformers for the reference); installs nothing.
set -u
out=${1:-cuda-check}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log="$out/check.log"
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$py" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda,
                                   torch.cuda.get_device_name(0))"
} 2>&1 | tee "$log"

tests() {  # the equivalence tests with the engine on the GPU (the reference stays on the CPU)
    LLMSRE_TEST_DEVICE=cuda timeout "$1" "$py" -m pytest -q -p no:cacheprovider -o addopts="-ra --durations=15" \
        "${@:2}" 2>&1 | tee -a "$out/tests.log" | tail -n 25 | tee -a "$log"
}
bench() {  # dtype, eager|graphs, timeout, extra flags...
    local dtype=$1 mode=$2 limit=$3 flags=("${@:4}")
    [ "$mode" = graphs ] && flags+=(--decode-graphs)
    echo "== offline benchmark: $dtype, $mode" | tee -a "$log"
    timeout "$limit" "$py" -m inference.bench offline --device cuda --dtype "$dtype" --no-progress \
        --json "$out/offline-$dtype-$mode.json" "${flags[@]}" 2>&1 | tee -a "$log"
    echo "(exit ${PIPESTATUS[0]})" | tee -a "$log"
}

echo "== decode graphs against transformers, on the GPU" | tee -a "$log"
tests 150 tests/inference/test_decode_graphs.py
bench float32 eager 130 --hf-one-at-a-time-requests 8
bench float32 graphs 75 --skip-hf
bench bfloat16 eager 75 --skip-hf
bench bfloat16 graphs 75 --skip-hf
echo "== the engine against transformers, on the GPU" | tee -a "$log"
tests 120 tests/inference/test_engine_equivalence.py
date -u | tee -a "$log"
