#!/usr/bin/env bash
# The neural render's frame times and the process's GPU memory with rendered bands laid out compact (their
# buffers sized by the samples the rays take): `bench --suite train` on the sample at the device's own budget
# and under `--gpu-memory 6G`. Prints the 512² and 1024² frame rows (times, passes, device kernels with their
# launches: one launch a band) and the GPU-memory row of each run. Then the pretrained route's live view: the icbm
# sample fitted with `fit --appearance pretrained` (seconds), its `frame-rate --size 1024 1024 --frames 30`, and
# the same frames one by one (tools/gpu/frame_trace.py: each frame's time, bands, whether it was drawn again,
# the buffers it made, the GPU memory in use; one frame's kernels) at the default budget and under `--gpu-memory 6G`. About three
# minutes after `warmup` of this tree. Writes under $OUT (3 files):
#
#   bench-default.md, bench-6G.md   each run's whole Markdown section and its progress lines
#   pretrained.txt                  the fit's lines, frame-rate's line and both frame traces
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

# The pretrained route's live view, frame by frame.
case "$N" in *" -m "*) python=${N%% -m *} ;; *) python=python3 ;; esac  # the interpreter $N runs
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log="$OUT/pretrained.txt"
echo ""
if ! $N sample "$work/icbm" > "$work/sample.txt" 2>&1; then
    echo "== sample failed =="; tail -n 5 "$work/sample.txt"; exit 1
fi
if ! $N fit "$work/icbm" --out "$work/run" --appearance pretrained > "$log" 2>&1; then
    echo "== pretrained fit failed =="; tail -n 5 "$log" | tr '\r' '\n' | tail -n 5; exit 1
fi
echo "== pretrained fit =="
grep -E '^(done|study to renderable)' "$log" || tail -n 3 "$log"
echo "== frame-rate of the pretrained run, 1024² ==" | tee -a "$log"
$N frame-rate "$work/run" --size 1024 1024 --frames 30 2>&1 | tail -n 1 | tee -a "$log"
for budget in default 6G; do
    options=()
    [ "$budget" = default ] || options=(--gpu-memory "$budget")
    echo "== frames one by one, budget $budget ==" | tee -a "$log"
    $python tools/gpu/frame_trace.py "$work/run" --size 1024 --frames 30 "${options[@]}" >> "$log" 2>&1 \
        || echo "frame trace failed" | tee -a "$log"
    grep -E '^(summary|kernels)' "$log" | tail -n 2
done
