# Sourced by the GPU scripts that measure this checkout (and a revision before it) into $OUT: the repository's root
# as the working folder, the command lines ($N, $PY), a scratch folder ($work, removed on exit) and say(), which
# prints a line and keeps it in $OUT/summary.txt.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
: "${OUT:?set OUT to the folder for the results}"
N=${N:-python3 -m NeuralRaycastLib.app.entry}
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT" "$work/logs" "$work/json"
summary="$OUT/summary.txt"
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
