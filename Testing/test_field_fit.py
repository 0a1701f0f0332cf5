"""Stage-1 fit on the analytic phantom (about 64³ voxels), judged against its exact signed distances."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import phantom_prepared
from field_reference import tiny_config

from NeuralRaycastLib.field.field import FieldLayout, NeuralField
from NeuralRaycastLib.field.sdf_fit import FitConfig, SdfFitter, band_errors, fit_sdf, set_up_fit_calls
from NeuralRaycastLib.study.preprocess import StudyOutline
from NeuralRaycastLib.study.sample.phantom import Phantom, voxel_centres

pytestmark = pytest.mark.gpu

SPACING = 2.5  # mm: the phantom's box is 59 x 72 x 53 voxels


@pytest.fixture(scope="module")
def phantom_setup():
    phantom, prepared = phantom_prepared(SPACING)
    points = voxel_centres(prepared.affine, prepared.study.shape).reshape(-1, 3)
    exact = np.stack([phantom.sdf(name, points) for name in phantom.structure_names], axis=-1)
    near = np.abs(exact).min(axis=1) < 3 * SPACING
    return prepared, points[near], exact[near]


def make_field(gpu, prepared) -> NeuralField:
    config = tiny_config(log2_table=14, coarsest_cells=8, finest_cell_mm=SPACING)
    layout = FieldLayout.build(config, prepared.bounds, len(prepared.structures), len(prepared.channel_names))
    return NeuralField(gpu, layout, seed=1)


def test_sdf_fit_reaches_a_voxel_near_the_surfaces(gpu, phantom_setup):
    prepared, points, exact = phantom_setup
    field = make_field(gpu, prepared)
    before = band_errors(field, points, exact, 3 * SPACING)
    messages = []
    result = fit_sdf(gpu, prepared, field, FitConfig(steps=240, batch=4096, monitor_every=40, seed=2),
                     progress=lambda message, fraction: messages.append((message, fraction)))
    after = band_errors(field, points, exact, 3 * SPACING)
    print(f"fit: {result.points_per_second / 1e3:.1f} k points/s; before {before}; after {after}")
    assert not result.cancelled and result.steps == 240
    assert result.losses[-1][1] < 0.1 * result.losses[0][1]
    assert after["mean_abs_error_mm"] < 0.25 * before["mean_abs_error_mm"]
    assert after["mean_abs_error_mm"] <= SPACING  # within one voxel, within three voxels of the surfaces
    assert after["mean_gradient_error"] <= 0.1
    assert messages[-1][1] == 1.0 and all(0.0 <= f <= 1.0 for _, f in messages)
    # Normals of the fitted brain surface agree with the exact ones (the rounded box's gradient).
    brain = np.abs(exact[:, 0]) < SPACING
    normals = field.normals(points[brain])[:, 0]
    eps = 1e-3
    phantom = Phantom()
    exact_normals = np.stack(
        [(phantom.sdf("brain", points[brain] + eps * a) - phantom.sdf("brain", points[brain] - eps * a)) / (2 * eps)
         for a in np.eye(3)], axis=-1)
    assert np.mean(np.sum(normals * exact_normals, axis=-1)) > 0.97


def test_fit_can_be_cancelled_and_is_reproducible(gpu, phantom_setup):
    prepared = phantom_setup[0]
    config = FitConfig(steps=50, batch=512, monitor_every=1, seed=7)
    runs = []
    for _ in range(2):
        field = make_field(gpu, prepared)
        asked = []

        def should_stop(asked=asked) -> bool:
            asked.append(1)
            return len(asked) > 3

        result = SdfFitter(gpu, prepared, field, config).run(should_stop=should_stop)
        assert result.cancelled and result.steps == 3
        runs.append(result.losses)
    # Same seed, same points: the losses agree up to the order of the atomic additions.
    np.testing.assert_allclose([loss for _, loss in runs[0]], [loss for _, loss in runs[1]], rtol=1e-4)


def test_the_fits_calls_set_up_beside_the_maps_leave_the_field_as_it_was(gpu, phantom_setup):
    """A run sets up its SDF fit's calls while the boundary maps are still made, from the study's outline alone
    (train/field_ahead.py): the field's parameters and gradients are then bit for bit as they were, so the fit that
    follows is the one a run without it makes."""
    prepared = phantom_setup[0]
    config = FitConfig(steps=4, batch=512, monitor_every=1, seed=5)
    plain, set_up = make_field(gpu, prepared), make_field(gpu, prepared)
    values, gradients = set_up.values.to_numpy().copy(), set_up.grads.to_numpy().copy()
    set_up_fit_calls(gpu, set_up, config, StudyOutline(prepared.study, prepared.structures, prepared.bounds))
    np.testing.assert_array_equal(set_up.values.to_numpy().view(np.uint32), values.view(np.uint32))
    np.testing.assert_array_equal(set_up.grads.to_numpy().view(np.uint32), gradients.view(np.uint32))
    assert set_up.active_levels == plain.active_levels
    losses = [SdfFitter(gpu, prepared, field, config).run().losses for field in (plain, set_up)]
    assert losses[0][0] == losses[1][0]  # before any step: the same sum of the same values
    # Later ones agree up to the order of the atomic additions (as two plain fits do).
    np.testing.assert_allclose([loss for _, loss in losses[0]], [loss for _, loss in losses[1]], rtol=1e-4)


def test_fit_step_profile_names_every_phase_and_keeps_training(gpu, phantom_setup):
    """The bench's breakdown of a fit step: every phase timed, and the profiled steps are ordinary steps."""
    prepared = phantom_setup[0]
    field = make_field(gpu, prepared)
    fitter = SdfFitter(gpu, prepared, field, FitConfig(steps=50, batch=2048, seed=3))
    before = fitter.loss()
    phases = fitter.profile_steps(steps=4)
    # with tensor-core networks (CUDA), their weights go out to the tiled layout and their gradients come back
    tiled = {"weights to tensor-core layout", "tensor-core gradients back"} if field.cooperative else {"settings"}
    assert set(phases) == tiled | {"fit kernel (forward + backward)", "Adam"}
    assert all(seconds > 0 for seconds in phases.values())
    assert fitter.step_index == 5  # one step that may compile, then the four timed
    assert fitter.loss() < before


def test_field_queries_run_in_chunks_the_memory_budget_holds(gpu, phantom_setup, monkeypatch):
    """Under a small GPU memory budget the field's distances and gradients come in chunks of points whose
    buffers fit the budget's share, and are the values of one query over all the points."""
    import slangpy as spy

    from NeuralRaycastLib.gpu.memory_budget import MIB, MemoryBudget

    prepared, points, _exact = phantom_setup
    field = make_field(gpu, prepared)
    whole = field.distances(points), field.distance_gradients(points[:3000])
    sizes = []
    original = spy.Tensor.from_numpy

    def counted(device, array):
        sizes.append(array.size)
        return original(device, array)

    monkeypatch.setattr(gpu, "memory", MemoryBudget(1 * MIB, "--gpu-memory"))
    monkeypatch.setattr(spy.Tensor, "from_numpy", counted)
    chunked = field.distances(points), field.distance_gradients(points[:3000])
    per_point = 4 * (3 + field.structures)  # a point and its distances
    assert max(sizes) // 3 * per_point <= (1 * MIB) // 4 < len(points) * per_point  # in more than one chunk
    np.testing.assert_array_equal(chunked[0], whole[0])
    np.testing.assert_array_equal(chunked[1], whole[1])


def test_the_occupancy_grid_query_is_the_distances_at_its_corners(gpu, phantom_setup, monkeypatch):
    """field_occupancy asks the device for min_k |s_k| at the grid's corners (made there, chunked under a
    small budget); the values and the occupied cells are those of the distances at the same points, inside
    the field's box and beyond it."""
    from NeuralRaycastLib.field.field_render import field_occupancy
    from NeuralRaycastLib.gpu.memory_budget import MIB, MemoryBudget
    from NeuralRaycastLib.render.occupancy import Occupancy
    from NeuralRaycastLib.render.style import BAND_WIDTHS

    prepared, _points, _exact = phantom_setup
    field = make_field(gpu, prepared)
    box = np.asarray(prepared.bounds, np.float64) + np.array([[-7.0, -3.0, -5.0], [4.0, 6.0, 2.0]])  # past the box
    cell = 3.7
    cells = Occupancy.grid_cells(box, cell)
    corners = (int(cells[0]) + 1, int(cells[1]) + 1, int(cells[2]) + 1)
    axes = [box[0, a] + np.arange(corners[a]) * cell for a in range(3)]
    z, y, x = np.meshgrid(axes[2], axes[1], axes[0], indexing="ij")
    expected = np.abs(field.distances(np.stack([x, y, z], axis=-1).reshape(-1, 3))).min(axis=1)
    monkeypatch.setattr(gpu, "memory", MemoryBudget(1 * MIB, "--gpu-memory"))  # in chunks
    got = field.nearest_on_grid(box[0], cell, corners)
    assert got.shape == (corners[2], corners[1], corners[0])
    np.testing.assert_allclose(got.reshape(-1), expected, rtol=1e-5, atol=1e-4)
    occupancy = field_occupancy(field, box, cell, epsilon_mm=0.5)
    reference = Occupancy.from_distances(field.distances, box, cell, BAND_WIDTHS * 0.5, 1.5)
    assert occupancy.cells.shape == reference.cells.shape and occupancy.fraction > 0
    assert np.mean(occupancy.cells != reference.cells) < 1e-3
    with pytest.raises(ValueError, match="corner values of shape"):
        Occupancy.from_nearest(got[:-1], box, cell, 1.0)


def test_the_fits_band_is_every_voxel_near_a_surface_in_index_order():
    """band_voxels: the voxels with |B_k| below the band (edges excluded, either sign), structure by structure, in
    the order np.argwhere gives them, as int32 (i, j, k)."""
    from types import SimpleNamespace

    from NeuralRaycastLib.field.sdf_fit import band_voxels

    rng = np.random.default_rng(5)
    boundary = rng.uniform(-8.0, 8.0, (3, 5, 7, 4)).astype(np.float32)
    boundary[0, 1, 2, 3], boundary[1, 0, 0, 0], boundary[2, 4, 6, 3] = 5.0, -5.0, -0.0
    voxels, offsets, counts = band_voxels(SimpleNamespace(boundary=boundary), 5.0)
    expected = [np.argwhere(np.abs(b) < 5.0) for b in boundary]
    assert counts == [len(e) for e in expected] and offsets == [0, counts[0], counts[0] + counts[1]]
    assert voxels.dtype == np.int32 and np.array_equal(voxels, np.concatenate(expected))
