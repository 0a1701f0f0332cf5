"""``neuralraycast pretrain``: the pretrained appearance's weights file, fitted across a generated cohort that
holds no evaluation seed, small, the same bytes from the same seed, and refused when altered."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from NeuralRaycastLib.app.cli import main
from NeuralRaycastLib.appearance.pretrain import (
    COHORT_SEED_BASE,
    MAX_WEIGHTS_BYTES,
    SHIPPED_WEIGHTS,
    PretrainConfig,
    WeightsFileError,
    cohort,
    read_weights,
)

SMOKE = ["--studies", "1", "--steps", "40", "--batch", "512"]


def test_the_cohort_holds_no_evaluation_seed_and_differs_by_seed():
    first, second = cohort(5, 0), cohort(5, 1)
    assert first[0][0] == "phantom" and {case for case, _ in first[1:]} == {"icbm"}
    seeds = [seed for _, seed in first + second]
    assert min(seeds) >= COHORT_SEED_BASE and len(set(seeds)) == len(seeds)


def test_the_shipped_weights_are_small_sound_and_say_the_command_that_makes_them():
    """``pretrain --out FILE --studies 16 --seed 0``, the other settings the defaults."""
    assert SHIPPED_WEIGHTS.stat().st_size <= MAX_WEIGHTS_BYTES
    config, parameters, metadata = read_weights(SHIPPED_WEIGHTS)
    assert np.isfinite(parameters).all() and config.inputs == 5 and config.structures == 4
    assert metadata["pretrain"] == asdict(PretrainConfig(studies=16, seed=0))
    assert metadata["cohort"] == [list(study) for study in cohort(16, 0)]
    assert metadata["final_loss"] < 0.01


@pytest.mark.gpu
def test_pretrain_writes_small_weights_that_the_same_seed_reproduces(tmp_path, capsys):
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert main(["pretrain", "--out", str(first), *SMOKE]) == 0
    assert main(["pretrain", "--out", str(second), *SMOKE]) == 0
    assert str(second) in capsys.readouterr().out
    assert first.read_bytes() == second.read_bytes()
    assert first.stat().st_size <= MAX_WEIGHTS_BYTES
    config, parameters, metadata = read_weights(first)
    assert parameters.shape == (config.count,) and np.isfinite(parameters).all()
    assert config.inputs == 5 and config.structures == 4
    assert metadata["cohort"] == [["phantom", COHORT_SEED_BASE]]
    assert metadata["final_loss"] < 0.6 * metadata["first_loss"]  # it learns

    # An existing weights file is kept unless --overwrite is given; the one line says so and names it.
    before = first.read_bytes()
    assert main(["pretrain", "--out", str(first), *SMOKE]) == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and str(first) in message and "--overwrite" in message
    assert first.read_bytes() == before

    # An altered weights file is refused by name, never half-loaded.
    data = bytearray(before)
    data[-5] ^= 0x40
    altered = tmp_path / "altered.safetensors"
    altered.write_bytes(bytes(data))
    with pytest.raises(WeightsFileError, match="altered.safetensors"):
        read_weights(altered)
    with pytest.raises(WeightsFileError, match="neuralraycast pretrain"):
        read_weights(tmp_path / "missing.safetensors")


@pytest.mark.parametrize(("steps", "seconds", "expected"), [(0, 0.3, range(3, 8)), (2, 30.0, range(2, 3)),
                                                            (0, 0.0, range(0, 1))])
def test_a_fine_tune_ends_at_its_step_limit_or_when_its_seconds_are_up(monkeypatch, steps, seconds, expected):
    """``fit --fine-tune STEPS --fine-tune-seconds S``: steps of 50 ms stop once S seconds have passed, or at the
    step limit where that comes first; neither given, none is taken (the renderer is not even set up)."""
    import time
    from types import SimpleNamespace

    from NeuralRaycastLib.appearance import latent_scene

    made, updates = [], []
    monkeypatch.setattr(latent_scene, "latent_renderer", lambda *args: made.append(args) or "renderer")
    monkeypatch.setattr(latent_scene, "FineTune", lambda latent: SimpleNamespace(step=lambda: updates.append(1)))

    def image_step(geometry: bool) -> dict[str, float]:
        assert not geometry  # the geometry stays as fitted
        time.sleep(0.05)
        return {"loss": 0.5}

    trainer = SimpleNamespace(config=SimpleNamespace(max_samples=8, occupancy_cell_mm=4.0, shade_weight=0.01),
                              gpu=None, prepared=None, field=None, image_step=image_step)
    start = time.perf_counter()
    losses = latent_scene.fine_tune(trainer, None, steps, seconds=seconds)
    assert len(losses) == len(updates) and len(losses) in expected, len(losses)
    assert time.perf_counter() - start < (seconds or 1.0) + 0.2
    assert (getattr(trainer, "renderer", None) == "renderer") == bool(made) == (expected.stop > 1)


def test_fine_tune_seconds_must_be_a_time_and_need_the_pretrained_route(phantom_study_dir, tmp_path, capsys):
    out = tmp_path / "run"
    for options, named in ((["--fine-tune-seconds", "2"], "--appearance pretrained"),
                           (["--appearance", "pretrained", "--fine-tune-seconds", "-1"], "fine-tune seconds"),
                           (["--appearance", "pretrained", "--fine-tune-seconds", "nan"], "fine-tune seconds")):
        assert main(["fit", str(phantom_study_dir), "--out", str(out), *options]) == 2
        message = capsys.readouterr().err.strip()
        assert "\n" not in message and named in message, message
    assert not out.exists()


def test_the_cohort_made_in_several_processes_is_the_cohort_made_in_one(tmp_path):
    """``pretrain`` generates and prepares its studies side by side where there are cores: the same studies, in the
    cohort's order, as one process makes (so the same seed still gives the same weights)."""
    from NeuralRaycastLib.appearance.pretrain import prepare_cohort

    config = PretrainConfig(studies=1, max_voxels=32)
    alone = prepare_cohort(config, tmp_path / "one", jobs=1)
    side_by_side = prepare_cohort(config, tmp_path / "two", jobs=2)
    assert len(alone) == len(side_by_side) == 1
    for a, b in zip(alone, side_by_side, strict=True):
        assert a.structures == b.structures and a.channel_names == b.channel_names
        np.testing.assert_array_equal(a.affine, b.affine)
        np.testing.assert_array_equal(a.boundary, b.boundary)
        np.testing.assert_array_equal(np.asarray(a.channels), np.asarray(b.channels))


def test_the_latent_grid_keeps_only_the_bricks_a_shaded_point_can_reach():
    """Brick slots from min |s| at the grid's vertices: every corner of a cell with a corner within reach of a
    surface is stored, bricks holding none are not (the file holds a band, not the box), slots numbered in order;
    other slots refused."""
    from NeuralRaycastLib.appearance.latent import BRICK, GridLayout, LatentConfigError, check_slots
    from NeuralRaycastLib.appearance.latent_scene import brick_slots

    grid = GridLayout.over(np.array([[0.0, 0.0, 0.0], [39.0, 39.0, 39.0]]), 1.0)
    position = grid.positions()
    nearest = np.abs(np.linalg.norm(position - 20.0, axis=1) - 12.0).reshape(grid.dims[::-1])
    slots = brick_slots(nearest, 2.5)
    stored = grid.stored_indices(slots)
    assert slots.shape == grid.bricks[::-1] and check_slots(grid, slots) is not None
    assert np.all(stored[nearest.ravel() <= 2.5] >= 0)
    near = np.argwhere(nearest <= 2.5)
    for corner in np.ndindex(2, 2, 2):  # the corners of the cells on either side of a vertex within reach
        z, y, x = np.minimum(near + corner, np.array(nearest.shape) - 1).T
        assert np.all(stored.reshape(nearest.shape)[z, y, x] >= 0)
        z, y, x = np.maximum(near - corner, 0).T
        assert np.all(stored.reshape(nearest.shape)[z, y, x] >= 0)
    assert 0 < (slots >= 0).sum() * BRICK**3 < 0.5 * grid.vertices
    middle = 20 // BRICK
    assert slots[middle, middle, middle] == -1 and slots[0, 0, 0] == -1  # the sphere's middle, the box's corner
    assert np.unique(stored[stored >= 0]).size == (stored >= 0).sum()
    with pytest.raises(LatentConfigError, match="in order"):
        check_slots(grid, np.where(slots >= 0, slots + 1, -1))
    with pytest.raises(LatentConfigError, match="bricks"):
        check_slots(grid, slots[:-1])
