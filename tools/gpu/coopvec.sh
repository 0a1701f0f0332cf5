for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig; export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
# Cooperative vectors on the GPU's Vulkan driver, beside CUDA, on one machine. Everything is in
# $OUT/coopvec.tar.gz:
#  info-vulkan.txt       `info --device vulkan`: the device's features (cooperative_vector among them)
#  probe.txt             tools/coop_probe.py vulkan: cooperative-matrix tiles, then the SDF fit's network shape on
#                        cooperative vectors against the per-thread network: points/s, and errors against numpy
#                        (forward; forward + backward with the weights' gradients summed in half and in float)
#  bench-vulkan.json     `bench --suite sdf_fit --json` on Vulkan: the fit's geometry network on cooperative vectors
#                        (chosen from the device's features; the weights' gradients summed in half), with the row
#                        "points/s with the per-thread network" (the same steps as NEURALRAYCAST_COOPVEC=0 runs)
#  bench-cuda.json       the same on CUDA (tensor-core networks, and its own per-thread row)
#  tests.txt             Testing/test_coopvec.py on the Vulkan device: the fit on cooperative vectors (fallback,
#                        float sums, half sums) against the per-thread fit and central differences
#  warmup-cuda.log       `warmup --device cuda`: every kernel of the demo and fit compiled on CUDA (its "fit" and
#                        "joint" parts once crashed while compiling with the cooperative vectors' code in them)
# Each step has its own time limit (the whole stays under six minutes); a step that fails or runs out of time
# leaves its error in its .log and the others still run. The last lines printed are the probe's summary and the
# points/s of each bench.
set -u
export PYTHONUNBUFFERED=1
N=${N:-"python3 -m NeuralRaycastLib.app.entry"}
R=$(mktemp -d)
timeout 15 $N info --device vulkan > "$R/info-vulkan.txt" 2>&1
timeout 50 python3 tools/coop_probe.py vulkan 4096 1048576 > "$R/probe.txt" 2>&1
timeout 75 $N bench --device vulkan --suite sdf_fit --json > "$R/bench-vulkan.json" 2> "$R/bench-vulkan.log"
timeout 40 $N bench --device cuda --suite sdf_fit --json > "$R/bench-cuda.json" 2> "$R/bench-cuda.log"
NEURALRAYCAST_DEVICE=vulkan timeout 50 python3 -m pytest -q Testing/test_coopvec.py -p no:cacheprovider \
    > "$R/tests.txt" 2>&1
timeout 90 $N warmup --device cuda > "$R/warmup-cuda.log" 2>&1; echo "warmup --device cuda: exit $?" >> "$R/warmup-cuda.log"
tar -C "$R" -czf "$OUT/coopvec.tar.gz" .
grep -h "points/s\|error\|failed" "$R/probe.txt" | cut -c1-200 | head -20
python3 - "$R"/bench-*.json <<'PY'
import json, sys
sys.path.insert(0, "tools/gpu")
from bench_rows import rows  # noqa: E402
for path in sys.argv[1:]:
    try:
        found = [r for r in rows(json.load(open(path))) if "points/s" in str(r["metric"])]
    except ValueError as error:
        found, error_text = [], str(error)
        print(f"{path.rsplit('/', 1)[-1]}: no JSON ({error_text[:80]})")
    for r in found:
        print(f"{path.rsplit('/', 1)[-1]}: {r['metric']}: {r['value']:.4g}; {str(r.get('notes', ''))[:90]}")
PY
tail -3 "$R/tests.txt"
tail -1 "$R/warmup-cuda.log"
