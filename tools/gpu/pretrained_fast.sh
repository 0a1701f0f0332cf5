#!/usr/bin/env bash
# The pretrained route's time from study to renderable model on a GPU (issue target: at most 3 s with the kernels
# compiled), phase by phase, with what it reaches. On the icbm sample (`sample`, seed 0), with the kernels
# compiled beforehand (`warmup`):
#
#   0. one untimed fit, whose process loads the modules once and keeps those of generated source as files for Slang's
#      module cache (a `warmup` that finds its stamp compiles nothing, and leaves that to the first fit);
#   1. fit --appearance pretrained, the prepared-study cache emptied first (the boundary maps computed afresh),
#      twice (afresh-1, afresh-2: the spread of one figure); then once more with NEURALRAYCAST_FIELD_BESIDE_MAPS=1
#      (beside: the field made while the maps are computed, the maps' kernels and the SDF fit's calls set up ahead:
#      train/field_ahead.py), which says what that work gains or costs on the machine;
#   2. the same fit again, the maps from the cache;
#   3. for comparison, the same fit with the standard preset's whole geometry schedule (`--iterations 825`: the
#      600 steps of 65,536 points the route fitted before it took its own, shorter one), maps from the cache;
#   4. evaluate of the runs of 2 and 3 (held-out PSNR and SSIM, Dice), and frame-rate --size 1024 1024 of 2;
#   5. with BEFORE=<git revision> set, the untimed fit, one maps-afresh fit and the cached one again in that
#      revision's tree (exported with git archive), so a change's before and after are measured on one host in one
#      go (fits named before-...).
#
# Made beside the boundary maps, the field is listed on the "time:" line as "field and kernels ... beside boundary
# maps", left out of every sum, and the run's wait for it once the maps are done as "field"; the maps' kernels' first
# calls, where the maps' transforms run on the device, as "maps kernels ... beside boundary maps". Each fit's SDF
# first step (the fit's calls set up beside the maps, or in that step) is said after its lines.
#
# Prints each fit's "study to renderable model" and "time:" lines, the held-out PSNR and the 1024² frame time, and
# writes under $OUT (3 files):
#
#   summary.txt            what is printed
#   frame-rate.json        frame-rate's output for the run of 2
#   logs.tar.gz            every command's output, the runs' train_log.json and metrics.json
#
#   N="python3 -m NeuralRaycastLib.app.entry" OUT=/tmp/out [BEFORE=main] tools/gpu/pretrained_fast.sh
#
# BEFORE_TREE: a folder holding that revision's files, taken instead of `git archive` (a host without the history).
#
# About two minutes on an H100 host after `warmup` of this tree, under three with BEFORE (without the warm-up the
# first fit compiles the kernels first: its "compile" phase, left out of the route's sum but not out of the wall
# clock).
set -u
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
: "${OUT:?set OUT to the folder for the results}"
N=${N:-python3 -m NeuralRaycastLib.app.entry}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT" "$work/logs"
summary="$OUT/summary.txt"
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }

say "host: $(nproc) cores; gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo 'none found')"
say "commit: $(git rev-parse --short HEAD 2>/dev/null || echo 'working tree')"
$N sample "$work/icbm" > "$work/logs/sample.txt" 2>&1 || { say "sample failed:"; tail -n 5 "$work/logs/sample.txt" | tee -a "$summary"; exit 1; }

# fit NAME WHAT OPTIONS...: a pretrained fit of the sample into run-NAME (in the tree $tree); its time lines and
# held-out PSNR said.
tree=$repo
fit() {
    local name=$1 what=$2 start wall
    shift 2
    start=$(date +%s%N)
    if ! (cd "$tree" && $N fit "$work/icbm" --out "$work/run-$name" --appearance pretrained "$@") \
            > "$work/logs/fit-$name.txt" 2>&1; then
        say "fit $name failed:"; tail -n 5 "$work/logs/fit-$name.txt" | tr '\r' '\n' | tail -n 5 | tee -a "$summary"
        return 1
    fi
    wall=$(( ($(date +%s%N) - start) / 1000000 ))
    say ""
    say "== fit $name ($what): ${wall} ms wall for the whole command =="
    tr '\r' '\n' < "$work/logs/fit-$name.txt" | grep -E '^(study to renderable model|time|done):' | tee -a "$summary"
    cp "$work/run-$name/train_log.json" "$work/logs/train_log-$name.json" 2>/dev/null
    python3 -c 'import json, sys; print("SDF fit first step: %.3f s" % json.load(open(sys.argv[1]))["sdf_first_step_seconds"])' \
        "$work/run-$name/train_log.json" 2>/dev/null | tee -a "$summary"
}

# evaluate NAME: held-out PSNR / SSIM and the Dice table of run-NAME.
evaluate() {
    if ! $N evaluate "$work/run-$1" > "$work/logs/evaluate-$1.txt" 2>&1; then
        say "evaluate $1 failed:"; tail -n 5 "$work/logs/evaluate-$1.txt" | tee -a "$summary"
        return 1
    fi
    say ""
    say "== evaluate $1 =="
    tr '\r' '\n' < "$work/logs/evaluate-$1.txt" | grep -E -A5 '^held-out PSNR' | tee -a "$summary"
    cp "$work/run-$1/metrics.json" "$work/logs/metrics-$1.json" 2>/dev/null
}

fit untimed "its modules loaded once, the generated ones kept for the module cache (not a measurement)"
for take in 1 2; do
    $N cache --clear prepared > /dev/null 2>&1
    fit "afresh-$take" "boundary maps computed afresh"
done
export NEURALRAYCAST_FIELD_BESIDE_MAPS=1  # the field made while the maps are computed (train/field_ahead.py)
$N cache --clear prepared > /dev/null 2>&1
fit beside "boundary maps computed afresh, the field made beside them"
unset NEURALRAYCAST_FIELD_BESIDE_MAPS
fit cached "boundary maps from the cache"
fit whole-geometry "the whole 600-step geometry, maps from the cache" --iterations 825
evaluate cached
evaluate whole-geometry

if [ -n "${BEFORE:-}" ]; then
    tree="$work/before"
    mkdir -p "$tree"
    if { [ -n "${BEFORE_TREE:-}" ] && cp -r "$BEFORE_TREE"/. "$tree"; } || git archive "$BEFORE" | tar -x -C "$tree"; then
        say ""
        say "== before: $BEFORE ($(git rev-parse --short "$BEFORE" 2>/dev/null || echo "from $BEFORE_TREE")) =="
        # N must take the package from the folder it runs in (python3 -m, no PYTHONPATH naming this tree)
        say "package run there: $(cd "$tree" && ${N%% -m *} -c 'import NeuralRaycastLib; print(NeuralRaycastLib.__file__)' 2>&1)"
        fit before-untimed "before: its modules loaded once (not a measurement)"
        $N cache --clear prepared > /dev/null 2>&1
        fit before-afresh "before: boundary maps computed afresh"
        fit before-cached "before: boundary maps from the cache"
    else
        say "before: git archive $BEFORE failed"
    fi
    tree=$repo
fi

if $N frame-rate "$work/run-cached" --size 1024 1024 --frames 30 --json > "$OUT/frame-rate.json" \
        2> "$work/logs/frame-rate.err"; then
    say ""
    say "== frame-rate of the cached run, 1024² =="
    python3 - "$OUT/frame-rate.json" <<'PYEOF' | tee -a "$summary"
import json, sys
data = json.load(open(sys.argv[1]))
keys = [key for key in data if any(word in key for word in ("ms", "fps", "frame", "size", "bands"))]
for key in keys or list(data):
    print(f"  {key}: {data[key]}")
PYEOF
else
    say "frame-rate failed:"; tail -n 5 "$work/logs/frame-rate.err" | tee -a "$summary"
fi
tar -czf "$OUT/logs.tar.gz" -C "$work" logs
