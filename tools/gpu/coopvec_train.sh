for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig; export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
# Training and the neural render through Vulkan, with the geometry network on cooperative vectors in the SDF fit
# and both networks on them in the renderer's kernels, beside CUDA's tensor-core kernels, on one machine:
# `bench --suite train` on each device, their training rays/s (stages 2 and 3) and 1024² render rows side by side,
# and Vulkan's step phases.
# Output under $OUT:
#  bench-vulkan.json, bench-cuda.json   `bench --device D --suite train --json`
#  logs.tar.gz                          each step's standard error, `info --device vulkan`, and tests.txt:
#                                       Testing/test_coopvec.py's render, training-step, frozen-backward and
#                                       appearance-network tests on the Vulkan device
# Each step has its own time limit (at most about nine minutes in all, most of it the two benches); a step that fails or
# runs out of time leaves its error in its log and the others still run. Printed last: each row on Vulkan and on
# CUDA, and Vulkan's speed as a percentage of CUDA's (rays/s: Vulkan / CUDA; frame times: CUDA / Vulkan).
set -u
export PYTHONUNBUFFERED=1
N=${N:-"python3 -m NeuralRaycastLib.app.entry"}
OUT=${OUT:?set OUT to the folder for the results}
R=$(mktemp -d)
timeout 15 $N info --device vulkan > "$R/info-vulkan.txt" 2>&1
grep -i "cooperative" "$R/info-vulkan.txt" | head -3
# the Vulkan kernels (the fit's and renderer's module on cooperative vectors among them) compiled ahead, as a run
# does before training; a bench would otherwise compile them itself, outside its training time but inside its limit
timeout 120 $N warmup --device vulkan > "$R/warmup-vulkan.log" 2>&1; echo "warmup --device vulkan: exit $?"
timeout 130 $N bench --device vulkan --suite train --json > "$OUT/bench-vulkan.json" 2> "$R/bench-vulkan.log"
echo "bench --device vulkan: exit $?"
timeout 110 $N bench --device cuda --suite train --json > "$OUT/bench-cuda.json" 2> "$R/bench-cuda.log"
echo "bench --device cuda: exit $?"
# the render's and a training step's agreement with the per-thread kernels on this device (its cooperative vectors
# and their fallback), and the frozen backward's and the appearance network's central differences
NEURALRAYCAST_DEVICE=vulkan timeout 150 python3 -m pytest -q -p no:cacheprovider Testing/test_coopvec.py \
    -k "render or frozen or appearance_network" > "$R/tests.txt" 2>&1
tar -C "$R" -czf "$OUT/logs.tar.gz" .
tail -n 2 "$R/bench-vulkan.log" "$R/bench-cuda.log" | cut -c1-200
echo "tests on Vulkan: $(tail -1 "$R/tests.txt")"
python3 - "$OUT/bench-vulkan.json" "$OUT/bench-cuda.json" <<'PY'
import json
import sys


sys.path.insert(0, "tools/gpu")
from bench_rows import rows  # noqa: E402


def table(path):
    try:
        with open(path) as file:
            return {r["metric"]: r for r in rows(json.load(file))}
    except (OSError, ValueError) as error:
        print(f"{path.rsplit('/', 1)[-1]}: no JSON ({str(error)[:80]})")
        return {}


vulkan, cuda = table(sys.argv[1]), table(sys.argv[2])
wanted = [m for m in {**cuda, **vulkan} if "training rays/s" in m or m.startswith("neural render 1024")
          or m == "total training time" or m == "held-out PSNR at the end"]
print(f"{'row':58} {'Vulkan':>12} {'CUDA':>12} {'Vulkan/CUDA':>12}")
for metric in wanted:
    v, c = (table_.get(metric, {}).get("value") for table_ in (vulkan, cuda))
    unit = (vulkan.get(metric) or cuda.get(metric)).get("unit", "")
    share = ""
    if isinstance(v, (int, float)) and isinstance(c, (int, float)) and v > 0 and c > 0:
        faster_is_larger = unit == "1/s"
        share = f"{100 * (v / c if faster_is_larger else c / v):.0f} %" if unit in ("1/s", "ms", "s") else ""
    shown = [("-" if not isinstance(x, (int, float)) else f"{x:,.0f}" if abs(x) >= 1e4 else f"{x:.4g}")
             for x in (v, c)]
    print(f"{metric[:58]:58} {shown[0]:>12} {shown[1]:>12} {share:>12}  {unit}")
for name, found in (("Vulkan", vulkan), ("CUDA", cuda)):
    note = found.get("training rays/s (render stages)", {}).get("notes", "")
    print(f"{name}: {str(note)[:160]}")
for metric in ("stage-2 step phases", "stage-3 step phases"):  # where a step's time goes on Vulkan
    row = vulkan.get(metric, {})
    print(f"Vulkan {metric}: {row.get('value', '-')} ms: {str(row.get('notes', ''))[:300]}")
PY
