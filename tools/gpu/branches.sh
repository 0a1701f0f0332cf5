#!/usr/bin/env bash
# The two representations side by side on a GPU host: `neuralraycast bench --suite branches` on the icbm sample
# at full resolution, the field with the standard preset and the Gaussians with theirs, trained on the same
# reference views, each read back from its run folder and scored by its own `evaluate`.
#
# Needs $N (the command line, e.g. N="python3 -m NeuralRaycastLib.app.entry") and $OUT (a folder); run it from the
# repository root after `neuralraycast warmup`. Writes to $OUT:
#   branches.json  the report: one row per figure and branch ("column" names the branch)
#   branches.md    the same as Markdown: the rows, then the side-by-side table (a column per branch)
#   branches.log   the progress lines, and the error if the suite did not finish
#   device.txt     the commit, the GPU and its driver
set -uo pipefail
: "${N:?set N to the command line, e.g. N='python3 -m NeuralRaycastLib.app.entry'}"
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
{
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
} > "$OUT/device.txt"
# Within the host's four minutes: the suite itself stops at 225 s and the log says how far it got.
timeout 225 $N bench --suite branches --json --append "$OUT/branches.md" \
    --command-line "neuralraycast bench --suite branches --json" > "$OUT/branches.json" 2> "$OUT/branches.log"
status=$?
echo "exit status $status" >> "$OUT/branches.log"
exit "$status"
