"""What the work beside the boundary maps costs them: one `fit` of a study in this process, its caches cleared,
with every maps step timed (tools/maps_timeline.py's steps), each step of the field's thread timed, every wait for
and hold of the device's lock (GpuContext.lock) recorded by thread, and the interpreter lock watched: a thread that
sleeps a millisecond at a time and, when it wakes late, notes how late and where the other threads stood (a call
that keeps the interpreter lock that long holds every other thread's Python, the maps' among them).

    python3 tools/gpu/beside_contention.py STUDY [--fit-option ...] [--json FILE]

Set NEURALRAYCAST_FIELD_BESIDE_MAPS=1 for the field made beside the maps (by default it is made after them). Prints
the maps' steps, the field thread's steps, the lock's waits over 2 ms, the interpreter's late wake-ups over 4 ms
with the frames they found, and totals.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from maps_timeline import STEPS, instrument  # noqa: E402

FIELD_STEPS = {
    "NeuralRaycastLib.train.field_ahead": ["NeuralField", "set_up_fit_calls", "check_run_fits"],
    "NeuralRaycastLib.train.warmup": ["warm_up_maps"],
}


class TimedLock:
    """An RLock that records how long each thread waited for it and held it (outermost holds only)."""

    def __init__(self, inner, state: dict) -> None:
        self.inner, self.state, self.local = inner, state, threading.local()

    def __enter__(self):
        depth = getattr(self.local, "depth", 0)
        began = time.perf_counter()
        self.inner.acquire()
        if depth == 0:
            self.local.got = time.perf_counter()
            self.state["lock"].append({"thread": threading.current_thread().name, "wait": self.local.got - began,
                                       "at": began - self.state["start"], "hold": None,
                                       "where": _caller()})
            self.local.row = self.state["lock"][-1]
        self.local.depth = depth + 1
        return self

    def __exit__(self, *exc):
        self.local.depth -= 1
        if self.local.depth == 0:
            self.local.row["hold"] = time.perf_counter() - self.local.got
        self.inner.release()
        return False

    def acquire(self, *args, **kwargs) -> bool:  # (untimed: the package takes the lock through `with`)
        return self.inner.acquire(*args, **kwargs)

    def release(self) -> None:
        self.inner.release()


def _caller() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if "NeuralRaycastLib" in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].name}" if frames else "?"


def watch_interpreter(state: dict, stop: threading.Event) -> None:
    """Sleep 1 ms at a time; a wake-up more than 4 ms late is noted with where the other threads stood."""
    me = threading.get_ident()
    names = {}
    while not stop.is_set():
        before = time.perf_counter()
        time.sleep(0.001)
        late = time.perf_counter() - before - 0.001
        if late > 0.004:
            names.update({t.ident: t.name for t in threading.enumerate()})
            where = {}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = [f for f in traceback.extract_stack(frame) if "NeuralRaycastLib" in f.filename
                         or "maps_timeline" in f.filename]
                where[names.get(ident, str(ident))] = (f"{Path(stack[-1].filename).name}:{stack[-1].lineno} "
                                                       f"{stack[-1].name}" if stack else "(outside the package)")
            state["late"].append({"at": before - state["start"], "late": late, "where": where})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study")
    parser.add_argument("--fit-option", action="append", default=[])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from NeuralRaycastLib.app.entry import main as entry
    from NeuralRaycastLib.gpu import device as device_module

    state: dict = {"records": [], "lock": [], "late": [], "start": time.perf_counter()}
    instrument(state, {**STEPS, **FIELD_STEPS})  # the maps' steps and the field thread's
    opened = device_module.open_device

    def open_timed(*a, **k):
        gpu = opened(*a, **k)
        object.__setattr__(gpu, "lock", TimedLock(gpu.lock, state))
        return gpu

    device_module.open_device = open_timed
    for module_name in ("NeuralRaycastLib.app.cli", "NeuralRaycastLib.train.run"):
        module = __import__(module_name, fromlist=["_"])
        if hasattr(module, "open_device"):
            module.open_device = open_timed
    entry(["cache", "--clear", "prepared", "views"])
    stop = threading.Event()
    watcher = threading.Thread(target=watch_interpreter, args=(state, stop), daemon=True, name="watch")
    with tempfile.TemporaryDirectory() as scratch:
        state["start"] = time.perf_counter()
        watcher.start()
        code = entry(["fit", args.study, "--out", f"{scratch}/run", *args.fit_option])
        stop.set()
        watcher.join()
        log = json.loads(Path(f"{scratch}/run/train_log.json").read_text()) if code == 0 else {}
    phases = "; ".join(f"{p['name']} {p['seconds']:.2f}" for p in log.get("phases", []))
    print(f"fit returned {code}; phases: {phases}")
    print(f"\n{'step':32s} {'thread':24s} {'start':>7s} {'end':>7s} {'wall':>7s}")
    for row in sorted(state["records"], key=lambda r: r["start"]):
        if row["step"] != "_distance_transform":
            print(f"{row['step']:32s} {row['thread'][:24]:24s} {row['start']:7.3f} {row['end']:7.3f} "
                  f"{row['end'] - row['start']:7.3f}")
    print("\ndevice lock, waits over 2 ms (s from the start):")
    for row in state["lock"]:
        if row["wait"] > 0.002:
            print(f"  {row['at']:7.3f} {row['thread'][:24]:24s} waited {1e3 * row['wait']:7.1f} ms "
                  f"(then held {1e3 * (row['hold'] or 0):6.1f} ms) at {row['where']}")
    holds: dict[str, float] = {}
    for row in state["lock"]:
        holds[row["thread"]] = holds.get(row["thread"], 0.0) + (row["hold"] or 0.0)
    waits: dict[str, float] = {}
    for row in state["lock"]:
        waits[row["thread"]] = waits.get(row["thread"], 0.0) + row["wait"]
    print("  held in all: " + "; ".join(f"{k} {v:.3f} s" for k, v in holds.items()))
    print("  waited in all: " + "; ".join(f"{k} {v:.3f} s" for k, v in waits.items()))
    print("\ninterpreter lock, wake-ups over 4 ms late:")
    for row in state["late"]:
        print(f"  {row['at']:7.3f} late {1e3 * row['late']:6.1f} ms; " + "; ".join(
            f"{k[:20]}: {v}" for k, v in row["where"].items()))
    print(f"  in all {sum(r['late'] for r in state['late']):.3f} s late over {len(state['late'])} wake-ups")
    if args.json:
        args.json.write_text(json.dumps(state | {"start": 0.0}, indent=1, default=str))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
