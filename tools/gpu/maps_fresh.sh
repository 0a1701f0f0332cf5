#!/usr/bin/env bash
# The boundary maps of a fresh process on this machine, before (commit $BEFORE, default e590435) and after this
# branch's changes (the map libraries imported whole before the device opens, the prepared study written to the
# cache behind, the surface filter's coefficients found without a Python loop): the "boundary maps" phase of three
# `fit`s of the sample, each in a fresh process from empty prepared-study and view caches (as `bench --suite
# workstation` runs them; the kernels stay compiled), the two trees taking turns; and `tools/maps_timeline.py --runs
# 2 --device` of the sample (run 1 in a fresh process against run 2 in the same one: where a first run's time goes).
# Takes about two minutes. Writes under $OUT (4 files):
#
#   summary.txt                 the host, each fit's phases (load, boundary maps), its start (the wall clock less
#                               its phases: imports, the device's open) and wall, each timeline's runs
#   timeline-{before,after}.txt tools/maps_timeline.py's output (the last run's steps)
#   fresh.tar.gz                the fits' logs and train_log.json files, the timelines' steps of every run as JSON
#
#   N="python3 -m NeuralRaycastLib.app.entry" OUT=/tmp/out tools/gpu/maps_fresh.sh
#
# FITS (default 3) sets the fits per tree; FIT_OPTIONS adds options to each fit (a quick try on a machine without a
# GPU: FIT_OPTIONS="--iterations 2 --views 4 --size 32"). Where commit $BEFORE is not in this checkout, only the
# current code is measured.
set -euo pipefail

BEFORE=${BEFORE:-e590435}
FITS=${FITS:-3}
FIT_OPTIONS=${FIT_OPTIONS:-}
. "$(dirname "$0")/measure_common.sh"
with_tree() { local tree=$1; shift; PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" "$@"; }

say "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), python $($PY -V 2>&1)"
say "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo 'none found')"
say "after: $(git rev-parse --short HEAD 2>/dev/null || echo 'working tree'); NEURALRAYCAST_DEVICE_MAPS=${NEURALRAYCAST_DEVICE_MAPS:-unset}"

trees=("after:$repo")
if git archive "$BEFORE" NeuralRaycastLib shaders 2>/dev/null | (mkdir -p "$work/before" && tar -x -C "$work/before"); then
    trees=("before:$work/before" "${trees[@]}")
    say "before: $BEFORE"
else
    say "before: commit $BEFORE not in this checkout; only the current code is measured"
fi
with_tree "$repo" $N sample "$work/sample" > /dev/null 2>&1

# The fits, the trees taking turns: each one's phases from its train_log.json.
for round in $(seq 1 "$FITS"); do
    for entry in "${trees[@]}"; do
        name=${entry%%:*}; tree=${entry#*:}
        with_tree "$tree" $N cache --clear prepared views > /dev/null
        out="$work/run-$name-$round"
        start=$(date +%s%N)
        if ! with_tree "$tree" $N fit "$work/sample" --out "$out" $FIT_OPTIONS > "$work/logs/fit-$name-$round.txt" 2>&1; then
            say "fit $name #$round failed:"; tail -n 5 "$work/logs/fit-$name-$round.txt" | tee -a "$summary"; continue
        fi
        wall=$(( ($(date +%s%N) - start) / 1000000 ))
        cp "$out/train_log.json" "$work/json/fit-$name-$round-train_log.json"
        $PY - "$out/train_log.json" "$name #$round" "$wall" "$work/logs/fit-$name-$round.txt" <<'EOF' | tee -a "$summary"
import json, re, sys
phases = {phase["name"]: phase["seconds"] for phase in json.load(open(sys.argv[1])).get("phases") or []}
wall = int(sys.argv[3]) / 1000
in_all = [float(found) for found in re.findall(r"([0-9.]+) s in all", open(sys.argv[4]).read())]
start = f"{wall - in_all[-1]:.2f} s" if in_all else "not printed"
print(f"fit {sys.argv[2]}: boundary maps {phases.get('boundary maps', float('nan')):.2f} s (load "
      f"{phases.get('load', float('nan')):.2f} s, compile {phases.get('compile', float('nan')):.2f} s; "
      f"start and the rest {start}; wall {wall:.1f} s)")
EOF
        rm -rf "$out"
    done
done
say ""
$PY - "$work/json" <<'EOF' | tee -a "$summary"
import json, statistics, sys
from pathlib import Path
for name in ("before", "after"):
    maps = [json.loads(path.read_text())["phases"] for path in sorted(Path(sys.argv[1]).glob(f"fit-{name}-*"))]
    maps = [next(phase["seconds"] for phase in phases if phase["name"] == "boundary maps") for phases in maps]
    if maps:
        print(f"boundary maps phase, {name}: {' / '.join(f'{value:.2f}' for value in maps)} s "
              f"(median {statistics.median(maps):.2f} s)")
EOF

# The timelines: a fresh process's first preparation against its second, the device's transforms as fit takes them.
for entry in "${trees[@]}"; do
    name=${entry%%:*}; tree=${entry#*:}
    say ""
    say "== $name: tools/maps_timeline.py --runs 2 --device =="
    with_tree "$tree" $PY tools/maps_timeline.py "$work/sample" --runs 2 --device --json "$work/json/timeline-$name.json" \
        > "$OUT/timeline-$name.txt" 2>&1 || { say "timeline ($name) failed:"; tail -n 5 "$OUT/timeline-$name.txt" | tee -a "$summary"; continue; }
    grep -E '^(device|study|run [0-9]+:)' "$OUT/timeline-$name.txt" | tee -a "$summary"
    $PY - "$work/json/timeline-$name.json" <<'EOF' | tee -a "$summary"
import json, sys
for number, run in enumerate(json.load(open(sys.argv[1])), 1):
    steps = run["steps"]
    def latest(name):
        return max((step for step in steps if step["step"] == name), key=lambda step: step["start"], default=None)
    mask, last_map = latest("_brain_mask_and_tidiness"), latest("signed_distance")
    transforms = sorted((step for step in steps if step["step"] == "squared_distance_transform"),
                        key=lambda step: step["start"])
    line = f"  run {number}: brain mask done at {mask['end']:.2f} s; the last map {last_map['start']:.2f}-{last_map['end']:.2f} s"
    if transforms:
        line += f"; the first device transform {transforms[0]['end'] - transforms[0]['start']:.3f} s"
    print(line)
EOF
done

cp "$work/logs"/fit-*.txt "$work/json/" 2>/dev/null || true
tar -czf "$OUT/fresh.tar.gz" -C "$work" json
echo "written: $(ls "$OUT")"
