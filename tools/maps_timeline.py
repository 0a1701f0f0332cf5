"""Where the boundary maps' time goes: every step of preparing a study (brain mask, each structure's label tidying,
distance transforms, smoothed surface, exact distances near it, far field, P(x) and the rest), with the thread it
ran in, when it started and ended (seconds from the start) and the processor time its own thread spent (the
rest of a step's wall clock is waiting, or work it handed to other threads). The longest chain of steps is the
wall clock of the maps: what to shorten first.

    python tools/maps_timeline.py STUDY [--runs N] [--json FILE] [--device]

``--device`` opens the GPU device first and takes the distance transforms there, as ``fit`` does; the device's
transforms are then listed as ``distance_transform`` (each a thread's wait for the device).
"""

from __future__ import annotations

import argparse
import functools
import json
import threading
import time
from pathlib import Path

STEPS = {
    "NeuralRaycastLib.study.preprocess": ["head_mask", "_brain_mask_and_tidiness", "_thresholded_head", "tidy_label",
                                          "signed_distance", "_voxel_signed_distance", "_smoothed_surface",
                                          "_contour_surface", "_smooth_near_surface",
                                          "_far_field", "disagreement", "smoothed_label", "mask_and_boundary_maps",
                                          "_distance_transform", "_derived_from_maps", "_derived_from_mask",
                                          "_rounded_probability", "write_entry", "normalise_channel"],
    "NeuralRaycastLib.study.device_distance": ["squared_distance_transform"],
    "NeuralRaycastLib.mesh.surface_distance": ["smooth_surface", "candidate_search", "mesh_distances",
                                               "mesh_pieces", "agree_with_labels", "candidates_after_move"],
}


def instrument(state: dict, steps: dict[str, list[str]] | None = None) -> None:
    """Wrap each step of ``steps`` (default :data:`STEPS`: module name to the names of its steps) where its callers
    look it up (the module's own names), to record it in ``state["records"]`` with times from ``state["start"]``."""
    import importlib

    lock = threading.Lock()
    for module_name, names in (STEPS if steps is None else steps).items():
        module = importlib.import_module(module_name)
        for name in names:
            function = getattr(module, name, None)
            if function is None:
                continue

            def wrapped(*args, __function=function, __name=name, **kwargs):
                began, cpu = time.perf_counter(), time.thread_time()
                try:
                    return __function(*args, **kwargs)
                finally:
                    row = {"step": __name, "thread": threading.current_thread().name,
                           "start": began - state["start"], "end": time.perf_counter() - state["start"],
                           "cpu": time.thread_time() - cpu}
                    with lock:
                        state["records"].append(row)

            setattr(module, name, functools.wraps(function)(wrapped))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study")
    parser.add_argument("--runs", type=int, default=2, help="runs; the last one is listed (the first imports)")
    parser.add_argument("--json", type=Path, help="also write every run's steps here")
    parser.add_argument("--device", action="store_true", help="take the distance transforms on the GPU device")
    args = parser.parse_args()
    gpu = None
    if args.device:
        from NeuralRaycastLib.gpu.device import open_device

        began = time.perf_counter()
        gpu = open_device()
        print(f"device {gpu.report.adapter} ({gpu.backend}) opened in {time.perf_counter() - began:.2f} s")
    from NeuralRaycastLib.study.study import load_study

    began = time.perf_counter()
    study = load_study(args.study)
    print(f"study {' × '.join(map(str, study.shape))} voxels, spacing {list(map(float, study.spacing))}, "
          f"read in {time.perf_counter() - began:.2f} s")
    from NeuralRaycastLib.study import preprocess

    state: dict = {}
    instrument(state)
    runs = []
    for run in range(args.runs):
        state["records"], state["start"] = [], time.perf_counter()
        cpu = time.process_time()
        preprocess.prepare(study, use_cache=False, gpu=gpu)
        wall, cpu = time.perf_counter() - state["start"], time.process_time() - cpu
        runs.append({"wall": wall, "processor": cpu, "steps": sorted(state["records"], key=lambda r: r["start"])})
        print(f"run {run + 1}: prepare {wall:.2f} s wall, {cpu:.2f} s processor time")
    last = runs[-1]
    print(f"\nrun {len(runs)}, steps by start (s from the start of prepare):")
    print(f"{'step':32s} {'thread':28s} {'start':>7s} {'end':>7s} {'wall':>7s} {'own cpu':>8s}")
    for row in last["steps"]:
        if row["step"] == "_distance_transform":
            continue
        print(f"{row['step']:32s} {row['thread'][:28]:28s} {row['start']:7.3f} {row['end']:7.3f} "
              f"{row['end'] - row['start']:7.3f} {row['cpu']:8.3f}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
