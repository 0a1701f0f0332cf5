#!/bin/bash
# The Gaussian branch on CUDA, on a GPU host: first the gradient tests (Testing/test_gaussian_gradients.py) on
# the CUDA device, one line per test, with every kernel launch waited for (CUDA_LAUNCH_BLOCKING=1) so that a
# fault is reported by the kernel that made it; then the standard preset's fit of the sample, evaluate and the
# frame times (tools/gpu/gaussians.sh, its fit cut at 90 s). Files under $OUT:
#   tests.txt                 pytest's whole output, then its exit status (124: the tests ran out of time)
#   fit/summary.txt           tools/gpu/gaussians.sh's figures (seconds per step, held-out PSNR, Dice, frames)
#   fit/gaussians.tar.gz      its raw outputs (fit log, train_log.json, metrics, GPU memory samples)
# The tests have 150 s, the fit 90 s (then evaluate and the frame rates, each with its own limit).
#
#   N="python3 -m NeuralRaycastLib.app.entry" OUT=/tmp/out bash tools/gpu/gaussians_cuda.sh
set -u
export PYTHONUNBUFFERED=1
N=${N:-python3 -m NeuralRaycastLib.app.entry}
OUT=${OUT:-$PWD/gaussians-cuda-out}
mkdir -p "$OUT/fit"

echo "== gradient tests on CUDA (CUDA_LAUNCH_BLOCKING=1, 150 s)"
start=$(date +%s)
NEURALRAYCAST_DEVICE=cuda CUDA_LAUNCH_BLOCKING=1 timeout -k 10 150 \
  python3 -m pytest -x -v -p no:cacheprovider Testing/test_gaussian_gradients.py > "$OUT/tests.txt" 2>&1
status=$?
echo "exit $status" >> "$OUT/tests.txt"
grep -E "::test_.* (PASSED|FAILED|ERROR|SKIPPED)|^(E |FAILED|ERROR)|CUDA_ERROR|[0-9]+ (passed|failed)" "$OUT/tests.txt" \
  | cut -c1-200 | head -40
echo "tests: exit $status after $(( $(date +%s) - start )) s$([ "$status" = 124 ] && echo ' (timed out)')"

echo "== standard fit of the sample (tools/gpu/gaussians.sh, GAUSS_FIT_S=90)"
GAUSS_FIT_S=90 N="$N" OUT="$OUT/fit" bash tools/gpu/gaussians.sh > /dev/null 2>&1
cat "$OUT/fit/summary.txt" 2>/dev/null || echo "no summary from tools/gpu/gaussians.sh"
# the fit's errors, where it stopped with one
tar -xzOf "$OUT/fit/gaussians.tar.gz" raw/fit.txt 2>/dev/null | grep -iE "error|traceback|exception" | cut -c1-200 | tail -5
