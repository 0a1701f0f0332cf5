#!/usr/bin/env bash
# The pretrained appearance beside the per-study appearance network on a GPU (docs/pretrained-appearance.md).
#
# 1. Compiles every kernel (`warmup`, which now holds the pretrained route's part) while pretraining weights on
#    a larger cohort (`pretrain --studies $STUDIES --seed 0`, seeds 1000.. only), and checks that pretraining
#    gives the same bytes twice (a small cohort, run twice).
# 2. On three studies never pretrained on (evaluation seeds < 1000): the icbm sample (seed 0), `sample --seed 7`
#    (icbm) and `sample --case phantom --seed 11`, fits with the default (standard) preset:
#      new      fit --appearance pretrained --weights <new weights>            (no appearance training)
#      new+ft   the same with --fine-tune-seconds $FT_SECONDS
#      network  fit (the per-study appearance network: today's default)
#      shipped  fit --appearance pretrained (the weights the package ships)
#    The first fit of a study is a pretrained one, so its boundary maps are computed afresh there.
# 3. frame-rate --size 1024 1024 of the network and pretrained runs, evaluate (PSNR / SSIM / Dice) of each run,
#    the model and latent-grid bytes, and each command's wall time (/usr/bin/time). The sample's fits and frame
#    times come first; the shipped weights' fits, the other frame times and the evaluations follow.
# Steps run in order of importance and are skipped (said in steps.txt) once $BUDGET_S seconds have passed, so
# the script stays under about 4 minutes.
#
# Output under $OUT: summary.md (the table), pretrained-16.safetensors (the new weights, to ship if better),
# pretrained.tar.gz (every command's output, train logs, metrics, timings).
set -u
shopt -s nullglob
N=${N:-python3 -m NeuralRaycastLib.app.entry}
OUT=${OUT:?set OUT to the folder for the results}
STUDIES=${STUDIES:-16}
FT_SECONDS=${FT_SECONDS:-2}
BUDGET_S=${BUDGET_S:-215}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
W=$(mktemp -d /tmp/pretrained-gpu.XXXXXX)
R=$W/results
mkdir -p "$R/logs" "$W/runs" "$W/studies" "$OUT"
WEIGHTS=$W/pretrained-$STUDIES.safetensors
START=$SECONDS

# step NAME COMMAND...: run it timed, its output in logs/NAME.*; skipped once the budget is spent.
step() {
    local name=$1
    shift
    if [ $((SECONDS - START)) -ge "$BUDGET_S" ]; then
        echo "$name: skipped (budget of $BUDGET_S s spent)" >> "$R/steps.txt"
        return 1
    fi
    /usr/bin/time -f "%e" -o "$R/logs/$name.wall" "$@" > "$R/logs/$name.out" 2> "$R/logs/$name.err"
    local rc=$?
    echo "$name: exit $rc, $(cat "$R/logs/$name.wall" 2>/dev/null | tail -1) s wall, at $((SECONDS - START)) s" \
        >> "$R/steps.txt"
    return $rc
}

$N info > "$R/info.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt" 2>&1
git -C "$ROOT" rev-parse HEAD > "$R/commit.txt" 2>&1

# 1. Warm-up and pretraining side by side (both mostly CPU: compiling, generating the cohort), the evaluation
#    studies written meanwhile.
step warmup $N warmup &
WARM=$!
step pretrain $N pretrain --studies "$STUDIES" --seed 0 --out "$WEIGHTS" &
PRE=$!
step sample-icbm0 $N sample "$W/studies/icbm0" --case icbm --seed 0
step sample-icbm7 $N sample "$W/studies/icbm7" --case icbm --seed 7
step sample-phantom11 $N sample "$W/studies/phantom11" --case phantom --seed 11
wait $WARM $PRE
step repro-a $N pretrain --studies 1 --steps 100 --seed 3 --out "$W/repro-a.safetensors"
step repro-b $N pretrain --studies 1 --steps 100 --seed 3 --out "$W/repro-b.safetensors"
if cmp -s "$W/repro-a.safetensors" "$W/repro-b.safetensors"; then echo same > "$R/reproducible.txt"
else echo DIFFERENT > "$R/reproducible.txt"; fi
sha256sum "$W"/repro-*.safetensors "$WEIGHTS" "$ROOT/NeuralRaycastLib/appearance/pretrained.safetensors" \
    >> "$R/reproducible.txt" 2>&1
[ -f "$WEIGHTS" ] || WEIGHTS=$ROOT/NeuralRaycastLib/appearance/pretrained.safetensors  # so the fits still run

# 2. The fits, study by study, then the 1024² frame times of the sample's runs; the shipped weights' fits, the
#    other frame times and the evaluations after them (skipped first where the budget runs out).
STUDY_NAMES="icbm0 icbm7 phantom11"
for s in $STUDY_NAMES; do
    study=$W/studies/$s
    step "fit-$s-new" $N fit "$study" --out "$W/runs/$s-new" --appearance pretrained --weights "$WEIGHTS"
    step "fit-$s-new+ft" $N fit "$study" --out "$W/runs/$s-new+ft" --appearance pretrained --weights "$WEIGHTS" \
        --fine-tune-seconds "$FT_SECONDS"
    step "fit-$s-network" $N fit "$study" --out "$W/runs/$s-network"
done
frame_rate() {  # frame_rate STUDY KIND
    [ -d "$W/runs/$1-$2" ] && step "frame-rate-$1-$2" $N frame-rate "$W/runs/$1-$2" --size 1024 1024 --frames 30 \
        --json
}
for kind in network new+ft new; do frame_rate icbm0 "$kind"; done
for s in $STUDY_NAMES; do
    step "fit-$s-shipped" $N fit "$W/studies/$s" --out "$W/runs/$s-shipped" --appearance pretrained
done
for s in icbm7 phantom11; do
    for kind in network new+ft; do frame_rate "$s" "$kind"; done
done
for s in $STUDY_NAMES; do
    for kind in new new+ft network shipped; do
        [ -d "$W/runs/$s-$kind" ] && step "evaluate-$s-$kind" $N evaluate "$W/runs/$s-$kind" --json
    done
done

# The table.
for run in "$W"/runs/*; do
    mkdir -p "$R/runs/$(basename "$run")"
    cp "$run"/*.json "$R/runs/$(basename "$run")/" 2>/dev/null
    ls -l "$run" > "$R/runs/$(basename "$run")/files.txt"
done
python3 - "$R" "$STUDY_NAMES" > "$OUT/summary.md" <<'EOF'
import json
import re
import sys
from pathlib import Path

results, studies = Path(sys.argv[1]), sys.argv[2].split()
logs = results / "logs"


def text(name: str) -> str:
    path = logs / name
    return path.read_text() if path.exists() else ""


def number(value, digits=2):
    return "—" if value is None else f"{value:.{digits}f}"


print("| study | appearance | held-out PSNR (fit / evaluate) | SSIM | fit wall s | study → renderable s | save s | "
      "fine-tune steps | 1024² ms/frame | model bytes | latent grid bytes | grid / model |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for study in studies:
    for kind in ("network", "shipped", "new", "new+ft"):
        name = f"{study}-{kind}"
        folder = results / "runs" / name
        if not folder.exists():
            print(f"| {study} | {kind} | not run | | | | | | | | | |")
            continue
        log = json.loads((folder / "train_log.json").read_text()) if (folder / "train_log.json").exists() else {}
        rows = log.get("rows", [])
        psnr = next((r["heldout_psnr"] for r in reversed(rows) if "heldout_psnr" in r), None)
        ssim = next((r["heldout_ssim"] for r in reversed(rows) if "heldout_ssim" in r), None)
        steps = next((r["fine_tune_steps"] for r in reversed(rows) if "fine_tune_steps" in r), None)
        metrics = (json.loads((folder / "metrics.json").read_text()) if (folder / "metrics.json").exists()
                   else {})
        try:
            evaluated = json.loads(text(f"evaluate-{name}.out") or "{}")
        except json.JSONDecodeError:
            evaluated = {}
        evaluated = evaluated or metrics
        wall = text(f"fit-{name}.wall").strip().splitlines()
        found = re.search(r"study to renderable model: ([0-9.]+) s", text(f"fit-{name}.out"))
        save = re.search(r"study to renderable model: .* save ([0-9.]+) s", text(f"fit-{name}.out"))
        try:
            frames = json.loads(text(f"frame-rate-{name}.out") or "{}")
        except json.JSONDecodeError:
            frames = {}
        listing = (folder / "files.txt").read_text() if (folder / "files.txt").exists() else ""
        sizes = {line.split()[-1]: int(line.split()[4]) for line in listing.splitlines() if len(line.split()) > 8}
        model, grid = sizes.get("model.safetensors", 0), sizes.get("appearance.safetensors", 0)
        print(f"| {study} | {kind} | {number(psnr)} / {number(evaluated.get('heldout_psnr'))} | {number(ssim, 4)} | "
              f"{wall[-1] if wall else '—'} | {found.group(1) if found else '—'} | "
              f"{save.group(1) if save else '—'} | {steps if steps is not None else '—'} | "
              f"{number(frames.get('ms_per_frame'), 1)} | {model:,} | {grid:,} | "
              f"{number(grid / model if grid and model else None)} |")
print()
print("Renderable time: the fit's phases less compile and the reference views (its printed breakdown is in "
      "logs/fit-*.out); save: that breakdown's save phase (model and latent grid written). Wall: the whole `fit` "
      "process, reference views and held-out score included. grid / model: appearance.safetensors bytes over "
      "model.safetensors bytes (the target: below 1).")
print()
print("```")
print((results / "steps.txt").read_text() if (results / "steps.txt").exists() else "")
print((results / "reproducible.txt").read_text() if (results / "reproducible.txt").exists() else "")
print(text("pretrain.out").strip().splitlines()[-1] if text("pretrain.out").strip() else "pretrain: no output")
print("```")
EOF
cp "$OUT/summary.md" "$R/"
[ -f "$W/pretrained-$STUDIES.safetensors" ] && cp "$W/pretrained-$STUDIES.safetensors" "$OUT/"
tar -czf "$OUT/pretrained.tar.gz" -C "$W" results
rm -rf "$W"
echo "done in $((SECONDS - START)) s; $OUT/summary.md"
