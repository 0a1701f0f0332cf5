#!/usr/bin/env bash
# The boundary maps with and without the device's distance transform (shaders/distance_transform.slang) on a GPU
# host: preparing the sample (197×233×189, 1 mm) and a BraTS-sized copy of it (240×240×155, anisotropic) without
# the cache, step by step (tools/maps_timeline.py, with and without --device); the maps compared voxel by voxel;
# the brain's two transforms timed alone on each; and the "boundary maps" phase of a `fit` of the sample from an
# empty prepared-study cache, before this branch (commit $BEFORE, CPU transforms) and after (device transforms).
#
#   N="python3 -m NeuralRaycastLib.app.entry" OUT=/tmp/out tools/gpu/maps_device.sh
#
# Writes under $OUT:
#   summary.txt        the host, each prepare's wall and processor time, the maps' differences, the transforms'
#                      own times and the fits' phases
#   timelines.tar.gz   every run's steps as JSON and text, the fits' logs and train_log.json files
#
# MAPS_FIT=0 leaves the fits out. BEFORE (default f058e74, this branch's base) names the code before; where that
# commit is not in the checkout, only the current code's fit is timed.
set -euo pipefail

BEFORE=${BEFORE:-f058e74}
. "$(dirname "$0")/measure_common.sh"

say "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), python $($PY -V 2>&1)"
say "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'none found')"
say "commit: $(git rev-parse --short HEAD 2>/dev/null || echo 'working tree')"

PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" $N sample "$work/sample" > /dev/null 2>&1
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" $PY tools/resample_study.py "$work/sample" "$work/brats" 0.8208,0.9708,1.2194 > /dev/null

for study in sample brats; do
    for where in processor device; do
        flag=$([ "$where" = device ] && echo --device || true)
        say ""
        say "== prepare without the cache, $study, transforms on the $where =="
        PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" $PY tools/maps_timeline.py "$work/$study" --runs 2 $flag \
            --json "$work/json/$study-$where.json" > "$work/logs/timeline-$study-$where.txt" 2>&1
        grep -E '^(study|device|run [0-9]+:)' "$work/logs/timeline-$study-$where.txt" | tee -a "$summary"
        grep -E '^(head_mask|_voxel_signed_distance|mask_and_boundary_maps) ' \
            "$work/logs/timeline-$study-$where.txt" | head -n 4 | tee -a "$summary" || true
    done
    say ""
    say "== $study: maps with the device's transforms against the processor's, and the brain's transforms alone =="
    PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" $PY - "$work/$study" <<'EOF' 2>&1 | tee -a "$summary"
import sys
import time

import numpy as np

from NeuralRaycastLib.gpu.device import open_device
from NeuralRaycastLib.study import preprocess
from NeuralRaycastLib.study.device_distance import distance_transform
from NeuralRaycastLib.study.study import load_study

study = load_study(sys.argv[1])
gpu = open_device()
mask = preprocess._brain_mask(study)
distance_transform(gpu, mask[:8, :8, :8], study.spacing)  # the kernel built before it is timed
for name, where in (("edt, all cores", None), ("device", gpu)):
    for side, outside in (("inside", mask), ("outside", ~mask)):
        times = []
        for _ in range(3):
            began = time.perf_counter()
            preprocess._distance_transform(outside, study.spacing, where)
            times.append(time.perf_counter() - began)
        print(f"  brain {side} transform, {name}: best of 3 {min(times):.3f} s")
on_cpu = preprocess.prepare(study, use_cache=False)
on_device = preprocess.prepare(study, use_cache=False, gpu=gpu)
for index, structure in enumerate(on_cpu.structures):
    difference = np.abs(on_cpu.boundary[index] - on_device.boundary[index])
    print(f"  {structure.name}: max |difference| {difference.max():.5f} mm, "
          f"{int((difference > 0).sum())} of {difference.size} voxels differ")
print(f"  masks equal: {np.array_equal(on_cpu.mask, on_device.mask)}, "
      f"P(x) max |difference| {float(np.abs(on_cpu.probability - on_device.probability).max()):.2e}")
EOF
done

# fit of the sample from an empty prepared cache: its phases (train_log.json), before and after
trees=("after:$repo")
if git archive "$BEFORE" NeuralRaycastLib shaders 2>/dev/null | (mkdir -p "$work/before" && tar -x -C "$work/before"); then
    trees=("before:$work/before" "${trees[@]}")
else
    say "before: commit $BEFORE not in this checkout; only the current code's fit is timed"
fi
. "$repo/tools/gpu/fit_phases.sh"
fit_phases

tar -czf "$OUT/timelines.tar.gz" -C "$work" json logs
echo "written: $(ls "$OUT")"
