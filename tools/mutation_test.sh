#!/usr/bin/env bash
# Mutation testing of the metric, evaluation and study-loading modules against the fast tests (no training,
# no rendering, no GPU), for developers: see docs/mutation-testing.md. Nothing here is a runtime dependency.
#
#   tools/mutation_test.sh [work folder]
#
# mutmut runs from a virtual environment of its own ($MUTMUT_VENV, made on first use) that also sees the
# project's .venv packages; the working tree (tracked and untracked files) is copied into the work folder,
# mutated and tested there, so the checkout is never changed. Prints the score per module at the end.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d)}
venv=${MUTMUT_VENV:-${TMPDIR:-/tmp}/neuralraycast-mutmut}
project_python="$repo/.venv/bin/python"

if [ ! -x "$venv/bin/mutmut" ]; then
    "$project_python" -m venv "$venv"
    "$venv/bin/pip" install --quiet "mutmut==3.8.1"
    site=$("$project_python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    own=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$site" > "$own/neuralraycast_project.pth"  # numpy, scipy, nibabel, ... from the project's .venv
fi

mkdir -p "$work"
rm -rf "$work/mutants"  # results of an earlier run would be taken as this one's
git -C "$repo" ls-files -co --exclude-standard | grep -v '^\.venv$' | tar -C "$repo" -cf - -T - | tar -C "$work" -xf -
cat > "$work/setup.cfg" <<'CONFIG'
[mutmut]
source_paths = NeuralRaycastLib
only_mutate =
    NeuralRaycastLib/render/metrics.py
    NeuralRaycastLib/train/evaluate.py
    NeuralRaycastLib/grid.py
    NeuralRaycastLib/study/study.py
also_copy =
    Testing/
pytest_add_cli_args =
    -p
    no:cacheprovider
    -m
    not gpu
pytest_add_cli_args_test_selection =
    Testing/test_study_loaders.py
    Testing/test_study_sizes.py
    Testing/test_study_cache.py
    Testing/test_camera_metrics.py
    Testing/test_surface_distance.py
    Testing/test_image_loss.py
    Testing/test_metrics_pinned.py
    Testing/test_study_checks.py
CONFIG

cd "$work"
"$venv/bin/mutmut" run --max-children "${JOBS:-2}" > mutmut-run.log 2>&1 || { tail -c 2000 mutmut-run.log; exit 1; }
"$venv/bin/mutmut" results > survivors.txt 2>/dev/null || true
"$venv/bin/python" - <<'SCORE'
import json
from collections import Counter

from mutmut.stats import status_by_exit_code

modules = ["render/metrics", "train/evaluate", "grid", "study/study"]
total: Counter = Counter()
for module in modules:
    codes = json.load(open(f"mutants/NeuralRaycastLib/{module}.py.meta"))["exit_code_by_key"]
    counts = Counter(status_by_exit_code[code] for code in codes.values())
    total.update(counts)
    print(f"{module + '.py':22} {sum(counts.values()):5} mutants, {counts['killed']:5} killed, "
          f"{counts['survived']:4} survived, {counts['no tests']:4} not covered: "
          f"{counts['killed'] / sum(counts.values()):.1%}")
print(f"{'all':22} {sum(total.values()):5} mutants, {total['killed']:5} killed: "
      f"{total['killed'] / sum(total.values()):.1%}")
SCORE
echo "survivors: $work/survivors.txt (mutmut show <name> in $work for each one's change)"
