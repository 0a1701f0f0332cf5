"""``bench --suite workstation``: what a clinician waits for, from Train to a saved run, on a GPU of their size.

``neuralraycast fit`` on the sample, each in a fresh process, from its study folder to the saved run folder,
with the study's boundary maps and reference views computed afresh (their cache folders cleared first; the
compiled kernels are kept): the wall clock of each phase of the run (train/phases.py: load, boundary maps,
compile, reference views, train, save), the peak GPU memory sampled in each, the process's start (imports and
the device) and the held-out PSNR, under the device's own budget and under 8 GiB and 4 GiB budgets.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..gpu.device import GpuContext, device_memory_in_use
from .report import BenchRow

#: The budgets a run is timed under: the device's own, then the workstation cards' sizes.
BUDGETS = (None, "8G", "4G")


def fit_command(study: str | Path, out: Path, backend: str, preset: str, budget: str | None) -> list[str]:
    """``neuralraycast fit`` as a user runs it (through this interpreter, so a clone's code is what runs)."""
    command = [sys.executable, "-m", "NeuralRaycastLib.app.entry", "fit", str(study), "--out", str(out),
               "--device", backend, "--preset", preset, "--overwrite"]
    return command + (["--gpu-memory", budget] if budget else [])


def timed_fit(command: list[str], out: Path) -> dict:
    """Run ``command`` (a fit into ``out``) and return its wall clock with the run's ``train_log.json``; a
    failed fit raises RuntimeError with the last line it printed."""
    from ..paths import clear_cache

    clear_cache(["prepared", "views"])  # the study's boundary maps and views computed afresh, as for a new study
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(nothing printed)"])[-1]
        raise RuntimeError(f"fit exited with {done.returncode}: {last}")
    log = json.loads((out / "train_log.json").read_text())
    return {"wall": wall, "log": log, "printed": done.stdout}


def printed_phases(printed: str) -> dict[str, float]:
    """Each phase's seconds from fit's closing ``time:`` line, which also has the phases that come after
    train_log.json's record is taken (the reference pictures written, the save)."""
    phases = {}
    for line in printed.splitlines():
        if line.startswith("time:"):
            for part in line[len("time:"):].split(";")[0].split("·"):
                words = part.split()
                if "s" in words:
                    at = words.index("s")
                    phases[" ".join(words[:at - 1])] = float(words[at - 1])
    return phases


def bench_workstation(gpu: GpuContext, prepared, quick: bool, progress) -> list[BenchRow]:
    """See the module docstring; ``quick`` uses the quick preset (slow devices)."""
    from ..study.sample import cached_sample

    study = cached_sample("icbm")
    preset = "quick" if quick else "standard"
    rows = []
    with tempfile.TemporaryDirectory(prefix="neuralraycast-workstation-") as scratch:
        for index, budget in enumerate(BUDGETS):
            name = f"budget {budget}" if budget else "device's budget"
            progress(f"workstation: fit under the {name}", index / len(BUDGETS))
            out = Path(scratch) / f"run-{index}"
            before = device_memory_in_use(gpu) or 0  # this bench's own process: not the fit's
            try:
                result = timed_fit(fit_command(study, out, gpu.backend, preset, budget), out)
            except RuntimeError as error:
                rows.append(BenchRow("workstation", f"fit, {name}", float("nan"), "s", str(error)[:200]))
                continue
            rows += fit_rows(name, result, preset, before)
    return rows


def budget_text(memory: dict) -> str:
    """The run's budget as train_log.json records it: its size and where it came from."""
    size = memory.get("budget_bytes")
    return "not recorded" if size is None else f"{size / 2**30:.1f} GiB ({memory.get('budget_source', '?')})"


def fit_rows(name: str, result: dict, preset: str, before: int = 0) -> list[BenchRow]:
    """One row per phase of a timed fit, its start and total, its peak memory and held-out PSNR (``before``:
    bytes in use on the GPU before the fit's process started, taken off its samples)."""
    log = result["log"]
    phases = [{**phase, "peak_bytes": None if phase.get("peak_bytes") is None else phase["peak_bytes"] - before}
              for phase in log.get("phases", [])]
    logged = {phase["name"] for phase in phases}
    phases += [{"name": name, "seconds": seconds, "peak_bytes": None}
               for name, seconds in printed_phases(result["printed"]).items() if name not in logged]
    rows = []
    for phase in phases:
        peak = phase.get("peak_bytes")
        rows.append(BenchRow("workstation", f"fit, {name}: {phase['name']}", phase["seconds"], "s",
                             "GPU memory not read" if peak is None
                             else f"peak GPU memory of the fit's process {peak / 2**30:.2f} GiB (sampled)"))
    # a phase beside another (train/phases.py) is in that one's seconds already
    start = result["wall"] - sum(phase["seconds"] for phase in phases if not phase.get("beside"))
    rows.append(BenchRow("workstation", f"fit, {name}: start and the rest", start, "s",
                         "imports, the device's open, reading the options, printing"))
    peaks = [phase["peak_bytes"] for phase in phases if phase.get("peak_bytes") is not None]
    memory = log.get("memory", {})
    rows.append(BenchRow("workstation", f"fit, {name}: wall", result["wall"], "s",
                         f"preset {preset}; fresh process, boundary maps and views computed afresh"))
    if peaks:
        rows.append(BenchRow("workstation", f"fit, {name}: peak GPU memory", max(peaks) / 2**30, "GiB",
                             f"largest sample of the phases; budget {budget_text(memory)}"))
    psnr = next((row["heldout_psnr"] for row in reversed(log.get("rows", [])) if "heldout_psnr" in row), None)
    rows.append(BenchRow("workstation", f"fit, {name}: held-out PSNR", float("nan") if psnr is None else psnr, "dB",
                         f"{log.get('seconds', float('nan')):.2f} s of training"))
    return rows
