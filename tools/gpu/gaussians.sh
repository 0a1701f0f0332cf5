#!/bin/bash
# The Gaussian branch on the sample case, on a GPU host: the standard preset's fit (timed, with its peak host
# and GPU memory), evaluate (held-out PSNR / SSIM, Dice and surface distances per structure) and the live
# view's frame time at 1024² and 512². Everything lands under $OUT: summary.txt (the figures, one per line)
# and gaussians.tar.gz (the raw outputs: fit log with /usr/bin/time -v, metrics.json, frame rates, train_log,
# nvidia-smi's memory samples). Each command has its own time limit, so the whole stays within 4 minutes.
#
#   N="python3 -m NeuralRaycastLib.app.entry" OUT=/tmp/out [SAMPLE=STUDY_FOLDER] bash tools/gpu/gaussians.sh
set -u
N=${N:-python3 -m NeuralRaycastLib.app.entry}
OUT=${OUT:-$PWD/gaussians-out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
RAW=$WORK/raw
mkdir -p "$RAW"
SAMPLE=${SAMPLE:-$(ls -d ~/.cache/neuralraycast/samples/icbm-* 2>/dev/null | head -1)}
RUN=$WORK/run
{
  echo "sample: ${SAMPLE:-none}"
  date -u +"start: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
} > "$RAW/host.txt"
if [ -z "$SAMPLE" ]; then
  echo "no sample under ~/.cache/neuralraycast/samples (run '$N warmup' first)" | tee "$OUT/summary.txt"
  exit 1
fi

# GPU memory in use, sampled every 100 ms while the commands run (a lower bound of each peak).
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 100 > "$RAW/gpu_memory.csv" 2>&1 &
SMI=$!
mark() { date -u +"%s.%N $1" >> "$RAW/marks.txt"; }

# Past $GAUSS_FIT_S seconds (default 125) the fit is interrupted as Ctrl-C does: it stops at the next step and saves the state reached
# (train_log.json says "cancelled"), so the other figures still come; 20 s later it is killed.
mark fit
/usr/bin/time -v timeout -s INT -k 20 ${GAUSS_FIT_S:-125} $N fit "$SAMPLE" --representation gaussians --preset standard \
  --out "$RUN" > "$RAW/fit.txt" 2>&1
echo "exit $?" >> "$RAW/fit.txt"
mark evaluate
timeout 55 $N evaluate "$RUN" --json > "$RAW/evaluate.json" 2> "$RAW/evaluate.err"
echo "exit $?" >> "$RAW/evaluate.err"
mark frame-rate-1024
timeout 20 $N frame-rate "$RUN" --size 1024 1024 --frames 60 --json > "$RAW/frame_rate_1024.json" 2> "$RAW/frame_rate.err"
mark frame-rate-512
timeout 15 $N frame-rate "$RUN" --size 512 512 --frames 60 --json > "$RAW/frame_rate_512.json" 2>> "$RAW/frame_rate.err"
mark end
kill "$SMI" 2>/dev/null
wait "$SMI" 2>/dev/null
cp "$RUN/train_log.json" "$RUN/run.json" "$RAW/" 2>/dev/null

python3 - "$RAW" > "$OUT/summary.txt" <<'PY'
import json, re, sys
from datetime import datetime
from pathlib import Path

raw = Path(sys.argv[1])

def load(name):
    try:
        return json.loads((raw / name).read_text())
    except (OSError, ValueError):
        return None

print((raw / "host.txt").read_text().strip())
fit = (raw / "fit.txt").read_text(errors="replace") if (raw / "fit.txt").exists() else ""
for key, pattern in (("fit wall", r"Elapsed \(wall clock\) time.*: (\S+)"),
                     ("fit peak host memory (kB)", r"Maximum resident set size \(kbytes\): (\d+)"),
                     ("fit exit", r"^exit (\d+)")):
    found = re.search(pattern, fit, re.M)
    print(f"{key}: {found.group(1) if found else 'n/a'}")
log = load("train_log.json") or {}
print(f"train seconds (without held-out scoring): {log.get('seconds')}")
if log.get("seconds") and log.get("steps"):
    print(f"seconds per step: {log['seconds'] / log['steps']:.4f}")
print(f"steps: {log.get('steps')}, cancelled: {log.get('cancelled')}, Gaussians: {log.get('gaussians')}, "
      f"cap: {log.get('cap')}")
print(f"held-out PSNR during training: {log.get('scores')}")
metrics = load("evaluate.json") or {}
for key in ("heldout_psnr", "heldout_ssim", "gaussians", "model_bytes", "train_seconds", "device", "backend"):
    print(f"{key}: {metrics.get(key)}")
for key in ("dice", "mean_surface_distance_mm", "hd95_mm"):
    print(f"{key}: {json.dumps(metrics.get(key))}")
for size in (1024, 512):
    frames = load(f"frame_rate_{size}.json") or {}
    print(f"frame {size}²: {frames.get('ms_per_frame')} ms ({frames.get('frames_per_second')} frames/s; "
          f"first {frames.get('first_frame_s')} s)")
marks = [line.split(" ", 1) for line in (raw / "marks.txt").read_text().split("\n") if line]
phases = [(name, float(t)) for t, name in marks]
bounds = [(name, start, end) for (name, start), (_, end) in zip(phases, phases[1:])]
samples = []  # (epoch seconds, MiB)
for line in (raw / "gpu_memory.csv").read_text(errors="replace").splitlines():
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 2 and parts[1].isdigit():
        try:
            when = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        except ValueError:
            continue
        samples.append((when, int(parts[1])))
used = [mib for _, mib in samples]
print(f"GPU memory in use (MiB, nvidia-smi, whole GPU): at the start {used[0] if used else 'n/a'}, "
      f"peak {max(used) if used else 'n/a'}")
for name, start, end in bounds:
    inside = [mib for when, mib in samples if start <= when <= end]
    print(f"phase {name}: {end - start:.1f} s, peak GPU memory {max(inside) if inside else 'n/a'} MiB")
PY
tar -czf "$OUT/gaussians.tar.gz" -C "$WORK" raw
cat "$OUT/summary.txt"
rm -rf "$WORK"
