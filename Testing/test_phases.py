"""Where a run's time and GPU memory go (train/phases.py), and the workstation bench's table of a fit."""

import math
import time

import pytest

from NeuralRaycastLib.bench.workstation import fit_rows, printed_phases
from NeuralRaycastLib.train.phases import PhaseClock


def test_each_phase_gets_its_time_and_the_largest_memory_sample_taken_while_it_ran():
    in_use = iter(range(100, 10_000))  # memory that keeps growing: each phase's peak is its last sample
    readings: list[int] = []

    def reader() -> int:
        readings.append(next(in_use))
        return readings[-1]

    clock = PhaseClock(reader, interval=0.001)
    with clock.phase("boundary maps"):
        pass
    first_end, taken = readings[-1], len(readings)
    with clock.phase("train"):
        deadline = time.monotonic() + 5
        while len(readings) < taken + 5 and time.monotonic() < deadline:  # several samples while it runs
            time.sleep(0.002)
    maps, train = clock.phases
    assert (maps.name, train.name) == ("boundary maps", "train")
    assert maps.peak_bytes == first_end  # the phase's end is sampled even when it is shorter than an interval
    assert train.peak_bytes == readings[-1] > maps.peak_bytes
    assert clock.seconds == pytest.approx(maps.seconds + train.seconds)
    assert clock.summary().startswith("boundary maps 0.0 s (0.0 GiB) · train ")


def test_a_phase_that_fails_is_still_recorded_and_a_device_without_memory_figures_is_not_sampled():
    calls = []
    clock = PhaseClock(lambda: calls.append(1))  # returns None: this device does not tell its memory
    with pytest.raises(ValueError), clock.phase("load"):
        raise ValueError("unreadable study")
    assert [(p.name, p.peak_bytes) for p in clock.phases] == [("load", None)]
    assert len(calls) == 1  # asked once, when the clock was made, and never again
    assert "GiB" not in clock.summary() and clock.summary().endswith("s in all")


def test_the_workstation_bench_tabulates_a_fits_phases_its_start_peak_memory_and_psnr():
    printed = ("done: 9.8 s\ntime: load 0.1 s (0.8 GiB) · boundary maps 2.0 s · train 9.9 s · reference views written "
               "4.8 s (3.2 GiB) · save 0.5 s; 17.3 s in all\n")
    assert printed_phases(printed) == {"load": 0.1, "boundary maps": 2.0, "train": 9.9,
                                       "reference views written": 4.8, "save": 0.5}
    log = {"phases": [{"name": "load", "seconds": 0.1, "peak_bytes": 1 << 30},
                      {"name": "boundary maps", "seconds": 2.0, "peak_bytes": 1 << 30},
                      {"name": "train", "seconds": 9.9, "peak_bytes": 3 << 30}],
           "memory": {"budget_bytes": 4 << 30, "budget_source": "--gpu-memory"}, "seconds": 9.9,
           "rows": [{"heldout_psnr": 30.0}, {"step": 5}, {"heldout_psnr": 41.5}]}
    rows = {row.metric: row for row in fit_rows("budget 4G", {"wall": 20.0, "log": log, "printed": printed},
                                                "standard", before=1 << 30)}
    assert rows["fit, budget 4G: save"].value == 0.5
    assert rows["fit, budget 4G: reference views written"].value == 4.8  # after train_log.json's record
    assert rows["fit, budget 4G: start and the rest"].value == pytest.approx(20.0 - 17.3)
    assert rows["fit, budget 4G: peak GPU memory"].value == 2.0  # the bench's own process's memory taken off
    assert "4.0 GiB (--gpu-memory)" in rows["fit, budget 4G: peak GPU memory"].notes
    assert rows["fit, budget 4G: held-out PSNR"].value == 41.5  # the last held-out figure, not the first
    no_memory = fit_rows("x", {"wall": 1.0, "log": {"phases": [{"name": "train", "seconds": 1.0}]}, "printed": ""},
                         "quick")
    assert not any(row.metric.endswith("peak GPU memory") for row in no_memory)
    assert math.isnan(next(row for row in no_memory if row.metric.endswith("held-out PSNR")).value)


def test_work_beside_a_phase_is_listed_with_it_and_counted_once():
    """The field made on a thread of its own while the boundary maps are computed: listed beside them, in the order
    the phases began, and left out of the total, which stays the run's own wall clock."""
    import threading

    clock = PhaseClock()
    started = threading.Event()

    def field() -> None:
        with clock.phase("field and kernels", beside="boundary maps"):
            started.set()
            time.sleep(0.05)

    with clock.phase("boundary maps"):
        time.sleep(0.01)
        thread = threading.Thread(target=field)
        thread.start()
        started.wait(5)
        thread.join()
    with clock.phase("field"):
        pass
    maps, beside, field_wait = clock.phases
    assert [p.name for p in clock.phases] == ["boundary maps", "field and kernels", "field"]
    assert beside.beside == "boundary maps" and maps.seconds > beside.seconds
    assert clock.seconds == pytest.approx(maps.seconds + field_wait.seconds)
    assert f" · field and kernels {beside.seconds:.1f} s beside boundary maps · field " in clock.summary()
    listed = clock.as_list()
    assert listed[1]["beside"] == "boundary maps" and "beside" not in listed[0]
    # the workstation bench's start is the wall less the run's own phases, not less the work beside them
    printed = f"time: {clock.summary()}\n"
    assert printed_phases(printed)["field and kernels"] == round(beside.seconds, 1)
    rows = {row.metric: row for row in fit_rows("x", {"wall": 5.0, "log": {"phases": listed}, "printed": printed},
                                                "quick")}
    assert rows["fit, x: start and the rest"].value == pytest.approx(5.0 - clock.seconds, abs=1e-3)
