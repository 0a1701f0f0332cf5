"""From Train to a trained run through a fresh worker process and through one kept ready (``neuralraycast
standby``), as the Slicer module starts them, taking turns: the wall clock from the start of the worker (or the
job handed to the ready one) to its done event, and the route's own ``study to renderable model`` line. Each
fit's boundary maps and views are made afresh.

    python3 tools/gpu/standby_route.py STUDY [--rounds 3] [--network]

``--network``: the per-study appearance network (``fit`` without ``--appearance pretrained``) instead of the route.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--network", action="store_true")
    args = parser.parse_args()

    from NeuralRaycastLib.app.worker import WorkerProcess
    from NeuralRaycastLib.paths import clear_cache

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p),
               PYTHONUNBUFFERED="1")
    entry = [sys.executable, "-m", "NeuralRaycastLib.app.entry"]
    work = Path(tempfile.mkdtemp(prefix="standby-route-"))
    route = [] if args.network else ["--appearance", "pretrained"]

    def report(kind: str, index: int, seconds: float, worker: WorkerProcess, outcome) -> None:
        line = next((line for line in worker.printed if line.startswith("study to renderable")), "")
        done = next((line for line in worker.printed if line.startswith("done:")), "")
        print(f"{kind} {index}: {outcome.state}, {seconds:.2f} s from {'start' if kind == 'fresh' else 'job'} to "
              f"done; {done} {line}".rstrip(), flush=True)

    for index in range(1, args.rounds + 1):
        clear_cache(["prepared", "views"])
        fit = [args.study, "--out", str(work / f"fresh-{index}"), *route, "--progress-json"]
        worker = WorkerProcess([*entry, "fit", *fit], env=env)
        start = time.perf_counter()
        worker.start()
        outcome = worker.wait()
        report("fresh", index, time.perf_counter() - start, worker, outcome)

        clear_cache(["prepared", "views"])
        worker = WorkerProcess([*entry, "standby"], env=env)
        began = time.perf_counter()
        worker.start()
        while not worker.poll_ready():
            if not worker.running or worker.poll()[1] is not None:
                print(f"standby {index}: ended before it was ready: {worker.poll()[1]}")
                return 1
            time.sleep(0.01)
        ready = time.perf_counter() - began
        time.sleep(1.0)  # as a user would press Train some time after the module opened
        start = time.perf_counter()
        worker.send_job([args.study, "--out", str(work / f"standby-{index}"), *route])
        outcome = worker.wait()
        report("standby", index, time.perf_counter() - start, worker, outcome)
        print(f"  (ready {ready:.2f} s after its start: {worker.warmed})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
