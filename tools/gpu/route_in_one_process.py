"""The pretrained route (``fit --appearance pretrained``) several times in one process, its boundary maps and views
afresh each time: the first run pays this process's first calls of every kernel (slangpy builds each call's data
once a process), the later ones show the route in a process that has made them already (a worker kept waiting for
the next study, a researcher's second study in one console).

    python3 tools/gpu/route_in_one_process.py STUDY [--runs 3] [--out FOLDER]

Prints each run's ``study to renderable model`` line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=None, help="where the run folders go (default: a temporary folder)")
    args = parser.parse_args()

    from NeuralRaycastLib.app.cli import main as cli
    from NeuralRaycastLib.paths import clear_cache

    base = Path(args.out or tempfile.mkdtemp(prefix="route-"))
    for index in range(args.runs):
        clear_cache(["prepared", "views"])
        printed = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(printed):
            code = cli(["fit", args.study, "--out", str(base / f"run-{index + 1}"), "--appearance", "pretrained"])
        wall = time.perf_counter() - start
        line = next((line for line in printed.getvalue().splitlines() if line.startswith("study to renderable")),
                    "no route line")
        print(f"run {index + 1}: exit {code}, {wall:.2f} s in the call; {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
