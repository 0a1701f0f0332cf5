#!/usr/bin/env bash
# The boundary maps' time on this machine, before (commit f0102c0) and after this branch's changes: preparing
# the sample and a BraTS-sized (240×240×155) copy of it without the cache, step by step (tools/maps_timeline.py),
# and the "boundary maps" phase of a `fit` of the sample whose prepared-study cache was emptied first (the
# kernels stay compiled). Everything is written under $OUT (4 files):
#
#   summary.txt                 prepare wall/processor per run and the fit phases, before and after
#   timeline-{before,after}.txt each step's thread, start, end, wall and own processor time (sample, last run)
#   timelines.tar.gz            every run's steps of both studies as JSON, all timelines as text, the fits' logs
#                               and train_log.json
#
#   N="python3 -m NeuralRaycastLib.app.entry" OUT=/tmp/out tools/gpu/maps.sh
#
# MAPS_FIT=0 leaves the fits out (a machine without a GPU: the two-core figure). The code before is taken from
# this checkout's history (commit $BEFORE, default f0102c0), or from BEFORE_TREE, a folder holding NeuralRaycastLib/
# and shaders/ of it; with neither, only the current code is measured.
set -euo pipefail

BEFORE=${BEFORE:-f0102c0}
. "$(dirname "$0")/measure_common.sh"

say "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), python $($PY -V 2>&1)"
say "after: $(git rev-parse --short HEAD 2>/dev/null || echo 'working tree')"
say "candidate search: $($PY -c 'import pykdtree.kdtree, importlib.metadata as m; print("pykdtree", m.version("pykdtree"))' 2>/dev/null \
    || echo "scipy's cKDTree (pykdtree not installed)")"

# The code before, beside this tree (its shaders too: the fit compiles nothing new, as they are the same).
trees=("after:$repo")
if [ -n "${BEFORE_TREE:-}" ]; then
    trees=("before:$BEFORE_TREE" "${trees[@]}")
elif git archive "$BEFORE" NeuralRaycastLib shaders 2>/dev/null | (mkdir -p "$work/before" && tar -x -C "$work/before"); then
    trees=("before:$work/before" "${trees[@]}")
else
    say "before: commit $BEFORE not in this checkout; only the current code is measured"
fi

# The studies: the sample, and the sample resampled to a BraTS-sized grid (the sample is 197×233×189 at 1 mm).
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" $N sample "$work/sample" > /dev/null 2>&1
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" $PY tools/resample_study.py "$work/sample" "$work/brats" 0.8208,0.9708,1.2194 > /dev/null
shape() { $PY -c "import nibabel, sys; print(nibabel.load(sys.argv[1]).shape)" "$(ls "$1"/*t1.nii* | head -1)"; }
say "studies: sample $(shape "$work/sample"), BraTS-sized $(shape "$work/brats")"

for entry in "${trees[@]}"; do
    name=${entry%%:*}; tree=${entry#*:}
    for study in sample brats; do
        say ""
        say "== $name, prepare without the cache, $study =="
        PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" $PY tools/maps_timeline.py "$work/$study" --runs 2 --json "$work/json/$name-$study.json" \
            > "$work/logs/timeline-$name-$study.txt" 2>&1
        grep -E '^(study|run [0-9]+:)' "$work/logs/timeline-$name-$study.txt" | tee -a "$summary"
        # the steps of the longest way: the brain's, and when the maps were done
        grep -E '^(head_mask|_brain_mask_and_tidiness|mask_and_boundary_maps|_derived_from_maps|write_entry) ' \
            "$work/logs/timeline-$name-$study.txt" | tail -n 4 | tee -a "$summary" || true
    done
    cp "$work/logs/timeline-$name-sample.txt" "$OUT/timeline-$name.txt"
done

# fit of the sample from an empty prepared-study cache: its phases (train_log.json) for each tree
. "$repo/tools/gpu/fit_phases.sh"
fit_phases

tar -czf "$OUT/timelines.tar.gz" -C "$work" json logs
echo "written: $(ls "$OUT")"
