#!/usr/bin/env bash
# The neural render's frame times and the process's GPU memory with rendered bands laid out compact (their
# buffers sized by the samples the rays take): `bench --suite train` on the sample at the device's own budget
# and under `--gpu-memory 6G`. Prints the 512² and 1024² frame rows (times, passes, device kernels with their
# launches: one launch a band) and the GPU-memory row of each run; writes under $OUT (2 files):
#
#   bench-default.md, bench-6G.md   each run's whole Markdown section and its progress lines
#
#   N="python3 -m NeuralRaycastLib.app.entry" OUT=/tmp/out tools/gpu/render_memory.sh
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
: "${OUT:?set OUT to the folder for the results}"
N=${N:-python3 -m NeuralRaycastLib.app.entry}
mkdir -p "$OUT"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo 'working tree')"
for budget in default 6G; do
    options=()
    [ "$budget" = default ] || options=(--gpu-memory "$budget")
    out="$OUT/bench-$budget.md"
    start=$(date +%s)
    if ! $N bench --suite train "${options[@]}" > "$out" 2>&1; then
        echo "== $budget: bench failed =="
        tail -n 15 "$out"
        continue
    fi
    echo ""
    echo "== budget $budget: $(( $(date +%s) - start )) s =="
    grep -E '^\| train \| (neural render (512|1024)²|GPU memory)' "$out" || tail -n 15 "$out"
done
