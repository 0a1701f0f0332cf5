"""The start-up probe behind ``bench --suite startup``: a run's start timed in a fresh process."""

from __future__ import annotations

import pytest

from NeuralRaycastLib.bench.startup import MILESTONES, start_in_process, timed_start


@pytest.mark.gpu
def test_start_up_milestones_in_a_fresh_process(tmp_path, gpu):
    from NeuralRaycastLib.study.sample import write_sample

    study = write_sample(tmp_path / "s", "fixture")
    result = timed_start(study, "quick", gpu.backend)
    seconds = [result["seconds"][name] for name in MILESTONES]
    assert result["preset"] == "quick"
    assert seconds[0] > 0 and all(a <= b for a, b in zip(seconds, seconds[1:], strict=False)), seconds


@pytest.mark.gpu
def test_start_up_milestones_in_a_process_with_the_device_open(tmp_path, gpu):
    """A second run in the same process (as in Slicer) goes through the same start, device and imports
    excepted."""
    from NeuralRaycastLib.study.sample import write_sample

    study = write_sample(tmp_path / "s", "fixture")
    seconds = start_in_process(gpu, study, "quick")
    assert list(seconds) == list(MILESTONES[2:])
    values = list(seconds.values())
    assert values[0] > 0 and all(a <= b for a, b in zip(values, values[1:], strict=False)), seconds


def test_a_failing_probe_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="start-up probe failed"):
        timed_start(tmp_path / "no-such-study")


def test_importing_the_cli_and_training_does_not_load_scipy():
    """scipy takes about a quarter second to import on a 2-core CPU: the CLI, the pipeline and training
    load it where they use it (preparing a new study, meshes, metrics), not when they are imported
    (``--help``, the start of every command)."""
    import subprocess
    import sys

    code = ("import sys; import NeuralRaycastLib.app.cli, NeuralRaycastLib.train.run_folder, "
            "NeuralRaycastLib.train.trainer, NeuralRaycastLib.bench.startup; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'scipy'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_the_first_occupancy_grid_does_not_load_scipy():
    """A trainer's first occupancy grid comes from the boundary maps (a study read from the cache): numpy
    interpolates them, so a second run does not wait for scipy."""
    import subprocess
    import sys

    code = ("import sys, types, numpy as np; from NeuralRaycastLib.field.field_render import boundary_occupancy; "
            "x = np.linspace(-8, 8, 17); d = np.sqrt(np.add.outer(np.add.outer(x**2, x**2), x**2)) - 5; "
            "p = types.SimpleNamespace(boundary=np.stack([d, d - 1]), affine=np.diag([1.0, 1, 1, 1])); "
            "p.affine[:3, 3] = -8; o = boundary_occupancy(p, np.array([[-8.0] * 3, [8.0] * 3]), 2.0, 0.25); "
            "print(0 < o.fraction < 1, sorted(m for m in sys.modules if m.split('.')[0] == 'scipy'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True []", done.stdout


def test_a_second_run_in_the_process_reuses_its_studys_first_occupancy_grid(monkeypatch):
    """The boundary occupancy of a prepared study (by its digest, box and cells) is computed once per process:
    the same grid again, a copy the caller may change; another cell size or study is computed afresh."""
    import types

    import numpy as np

    from NeuralRaycastLib.field import field_render as field_scene

    x = np.linspace(-8, 8, 17)
    d = np.sqrt(np.add.outer(np.add.outer(x**2, x**2), x**2)) - 5
    affine = np.diag([1.0, 1, 1, 1])
    affine[:3, 3] = -8
    box = np.array([[-8.0] * 3, [8.0] * 3])
    calls = []
    original = field_scene.Occupancy.from_distances
    monkeypatch.setattr(field_scene.Occupancy, "from_distances",
                        lambda *a, **k: calls.append(a[2]) or original(*a, **k))
    monkeypatch.setattr(field_scene, "_BOUNDARY_OCCUPANCIES", {})
    study = types.SimpleNamespace(boundary=np.stack([d, d - 1]), affine=affine, key="study-a")
    first = field_scene.boundary_occupancy(study, box, 2.0, 0.25)
    first.cells[:] = False
    again = field_scene.boundary_occupancy(study, box, 2.0, 0.25)
    assert calls == [2.0] and 0 < again.fraction < 1
    field_scene.boundary_occupancy(study, box, 4.0, 0.25)
    unnamed = types.SimpleNamespace(boundary=study.boundary, affine=affine, key="")
    field_scene.boundary_occupancy(unnamed, box, 2.0, 0.25)
    assert calls == [2.0, 4.0, 2.0]
