for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig; export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
# Cooperative vectors on the GPU's Vulkan driver, beside CUDA, on one machine:
#  probe.txt         tools/coop_probe.py vulkan: cooperative-matrix tiles, then the SDF fit's network shape on
#                    cooperative vectors against the per-thread network (points/s and errors against numpy)
#  bench-*.json      `bench --suite sdf_fit --json` on Vulkan (the fit's network as the device's features pick it),
#                    on Vulkan with cooperative vectors off (NEURALRAYCAST_COOPVEC=0) and on CUDA
#  info-vulkan.txt   `info --device vulkan` (the device's features, the network path taken)
# Each step has its own time limit, so the whole stays under four minutes; a step that fails leaves its error in
# its file and the others still run. Everything is in $OUT/coopvec.tar.gz.
set -u
export PYTHONUNBUFFERED=1
N=${N:-"python3 -m NeuralRaycastLib.app.entry"}
R=$(mktemp -d)
timeout 30 $N info --device vulkan > "$R/info-vulkan.txt" 2>&1
timeout 60 python3 tools/coop_probe.py vulkan 4096 1048576 > "$R/probe.txt" 2>&1
timeout 60 $N bench --device vulkan --suite sdf_fit --json > "$R/bench-vulkan.json" 2> "$R/bench-vulkan.log"
NEURALRAYCAST_COOPVEC=0 timeout 50 $N bench --device vulkan --suite sdf_fit --json \
    > "$R/bench-vulkan-per-thread.json" 2> "$R/bench-vulkan-per-thread.log"
timeout 30 $N bench --device cuda --suite sdf_fit --json > "$R/bench-cuda.json" 2> "$R/bench-cuda.log"
tar -C "$R" -czf "$OUT/coopvec.tar.gz" .
grep -h "points/s\|error\|failed" "$R/probe.txt" | head -20
