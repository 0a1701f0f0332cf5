"""Training Gaussians on the phantom's reference views: initialisation on the structures' surfaces, the loss
going down and the held-out picture getting better, pruning and densification under the cap, a time budget,
and cancel."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import phantom_prepared
from scipy.spatial import cKDTree

from NeuralRaycastLib.gaussians.geometry import JointStructures, StructureTrainConfig
from NeuralRaycastLib.gaussians.look import SPECULAR
from NeuralRaycastLib.gaussians.scene import GAUSSIAN_FLOATS, GaussianSet
from NeuralRaycastLib.gaussians.train import (
    TRUNCATED_MASS,
    GaussianAdam,
    GaussianTrainConfig,
    SurfaceSamples,
    adapt,
    budget_spent,
    even_layers,
    gaussian_cap,
    initial_gaussians,
    scene_for_study,
    schedule_fraction,
    score_views,
    train_gaussians,
)
from NeuralRaycastLib.gpu.device import GpuMemoryError
from NeuralRaycastLib.gpu.memory_budget import MIB, MemoryBudget
from NeuralRaycastLib.render.reference_views import render_reference_views

pytestmark = pytest.mark.gpu

#: Small enough for a CPU device: the phantom at 3 mm, 8 views of 64² (one held out).
CONFIG = GaussianTrainConfig(steps=40, initial=1500, eval_every=40, densify_every=20)


@pytest.fixture(scope="module")
def phantom_views(gpu):
    _, prepared = phantom_prepared(3.0)
    return prepared, render_reference_views(gpu, prepared, 8, 64, 64)


def test_initial_gaussians_lie_on_the_structures_surfaces(phantom_views):
    prepared, views = phantom_views
    gaussians = initial_gaussians(prepared, CONFIG, 1500)
    assert 1500 <= gaussians.count <= 1504
    ijk = np.round((gaussians.positions - prepared.affine[:3, 3]) @ np.linalg.inv(prepared.affine[:3, :3]).T)
    ijk = np.clip(ijk.astype(int), 0, np.array(prepared.boundary.shape[1:]) - 1)
    nearest = np.abs(prepared.boundary[:, ijk[:, 0], ijk[:, 1], ijk[:, 2]]).min(axis=0)
    assert (nearest < 2 * 3.0).all()
    # every structure gets some, the small tumour parts too
    for boundary in prepared.boundary:
        assert (np.abs(boundary[ijk[:, 0], ijk[:, 1], ijk[:, 2]]) < 3.0).sum() >= 10
    opacity = 1.0 / (1.0 + np.exp(-gaussians.density))
    assert ((opacity >= 0.01 - 1e-6) & (opacity <= 0.99 + 1e-6)).all()


def jittered_layer(evened: bool) -> np.ndarray:
    """The optical depth across a flat layer of Gaussians (the float64 reference's rays along its normal, at
    random points away from its edges): one Gaussian a cell of a 1 mm grid, off the cell's centre by up to 0.35
    mm, each of its own area (the cell's points nearest to it), eight tenths of its spacing wide and half a
    millimetre thick, of the density its area alone asks for, or evened (:func:`even_layers`)."""
    from gaussian_reference import render

    rng = np.random.default_rng(0)
    cells = np.stack(np.meshgrid(np.arange(20.0), np.arange(20.0), indexing="ij"), -1).reshape(-1, 2)
    centres = cells + rng.uniform(-0.35, 0.35, cells.shape)
    n = len(centres)
    fine = np.stack(np.meshgrid(*[np.linspace(-0.5, 19.5, 200)] * 2, indexing="ij"), -1).reshape(-1, 2)
    areas = np.bincount(cKDTree(centres).query(fine)[1], minlength=n) * (20.0 / 200) ** 2
    positions = np.concatenate([centres, np.zeros((n, 1))], axis=1)
    samples = SurfaceSamples(positions, np.tile([0.0, 0.0, 1.0], (n, 1)), areas, np.full(n, 0.5), np.zeros(n, int))
    width, thickness = 0.8 * np.sqrt(areas), np.full(n, 0.5)
    w = 0.5 * areas / ((2 * np.pi) ** 1.5 * width**2 * thickness * TRUNCATED_MASS)
    if evened:
        w = even_layers(samples, width, thickness, w, cap=0.99)
    values = GaussianSet(positions, np.log(np.stack([width, width, thickness], axis=1)),
                         np.tile([1.0, 0.0, 0.0, 0.0], (n, 1)), np.log(w / (1.0 - w)), np.zeros((n, 6, 3))).flat()
    points = rng.uniform(5.0, 14.0, (120, 2))
    rays = np.concatenate([points, np.full((len(points), 1), 5.0), np.tile([0.0, 0.0, -1.0], (len(points), 1))], 1)
    alpha = render(values[: GAUSSIAN_FLOATS * n].astype(np.float64), n, 1.0, rays, (-2.0, -2.0, -3.0),
                   (22.0, 22.0, 3.0), 0.05, 0.0)[:, 3]
    return -np.log(1.0 - alpha)


def test_evened_densities_make_a_jittered_layer_as_opaque_everywhere():
    """Gaussians spread one a cell but off its centre, as on a surface, each of the density its area alone asks
    for, leave the layer's optical depth uneven between them (the picture's speckle); evened, it varies several
    times less and keeps the crossing's depth on average."""
    plain, evened = jittered_layer(False), jittered_layer(True)
    assert np.std(evened) < 0.5 * np.std(plain), (np.std(plain), np.std(evened))
    assert abs(np.mean(evened) - 0.5) < 0.02 * 0.5, np.mean(evened)


def test_training_improves_the_held_out_picture(gpu, phantom_views):
    prepared, views = phantom_views
    config = replace(CONFIG, densify_until=0.0)  # pruning only, as the quick and standard schedules
    first = score_views(scene_for_study(gpu, prepared, initial_gaussians(prepared, config, 1500), config),
                        views, views.held_out)["heldout_psnr"]
    messages = []
    scene, log = train_gaussians(gpu, prepared, views, config, progress=lambda m, f: messages.append((m, f)))
    assert log.steps == 40 and not log.cancelled
    assert np.mean([loss for _, loss in log.losses[-10:]]) < 0.9 * np.mean([loss for _, loss in log.losses[:3]])
    (step, last), = log.scores
    assert step == 40
    # flat Gaussians spread evenly over the surfaces, coloured as the reference views draw their surfaces, start
    # near 30 dB (23 dB coloured by the pixels they fall on, lower still as round blobs at random), and the
    # steps take them further (29.93 -> 30.48 dB on lavapipe; 29.89 dB if they also grew at step 20)
    assert first >= 27.0 and last > first, (first, last)
    assert messages[-1][1] == 1.0 and "held-out PSNR" in messages[-1][0]
    assert [step for step, _ in log.counts] == [20]


def test_cancel_keeps_the_state_reached(gpu, phantom_views):
    prepared, views = phantom_views
    calls = []
    scene, log = train_gaussians(gpu, prepared, views, GaussianTrainConfig(steps=40, initial=300, eval_every=0),
                                 should_stop=lambda: calls.append(1) or len(calls) > 3)
    assert log.cancelled and log.steps == 3
    assert np.isfinite(scene.parameters()).all()


def test_structure_weights_trained_with_the_pictures_follow_the_gaussians(gpu, phantom_views):
    """With ``structure_weight`` the occupancy loss trains the structure weights (a logit and a slope per Gaussian
    and structure) during the picture steps: the log holds them for the Gaussians at the end, and the loss falls."""
    prepared, views = phantom_views
    config = GaussianTrainConfig(steps=12, initial=300, eval_every=6, structure_weight=3.0, structure_points=1024)
    scene, log = train_gaussians(gpu, prepared, views, config)
    assert log.structures.shape == (scene.count, 2 * len(prepared.structures))
    assert np.isfinite(log.structures).all() and log.structures[:, len(prepared.structures):].any()
    (_, first), (_, last) = log.structure_losses
    assert last < first, log.structure_losses


def test_a_time_budget_ends_the_run_once_spent_and_sets_its_schedule(gpu, phantom_views):
    """With ``seconds``, the run ends before a step that would pass the budget (not a cancel), scores the held-out views
    there, and its schedule follows the time where that is further along than the steps. The budget starts after
    the first step, which compiles the step's kernels on a machine that has not yet."""
    prepared, views = phantom_views
    config = GaussianTrainConfig(steps=1000, initial=300, eval_every=500, seconds=1e-6)
    scene, log = train_gaussians(gpu, prepared, views, config)
    assert log.steps <= 2 and not log.cancelled
    assert [step for step, _ in log.scores] == [log.steps]
    assert log.first_step_seconds > 0 and log.seconds < log.first_step_seconds  # the first step kept apart
    assert np.isfinite(scene.parameters()).all()
    timed = GaussianTrainConfig(steps=100, seconds=10.0)
    assert schedule_fraction(timed, 10, 5.0) == 0.5  # the time is further along
    assert schedule_fraction(timed, 60, 5.0) == 0.6  # the steps are
    assert schedule_fraction(GaussianTrainConfig(steps=100), 10, 5.0) == 0.1  # no budget: the steps alone
    # A run stops while another step as long as its longest still fits, so that it never passes the budget.
    assert not budget_spent(timed, 10, 9.0, 0.9) and budget_spent(timed, 10, 9.2, 0.9)
    assert budget_spent(timed, 100, 1.0, 0.1)  # its steps taken
    assert not budget_spent(GaussianTrainConfig(steps=100), 99, 1e6, 1e6)  # no budget: the steps alone


def test_the_standard_schedule_ends_at_thirty_seconds_unless_steps_are_asked_for():
    """On a GPU slower than the one its steps were sized on, the standard preset still trains 30 s at most; a run
    given its steps (``--iterations``) takes them all."""
    from NeuralRaycastLib.gaussians.run import gaussian_schedule
    from NeuralRaycastLib.train.presets import RunSettings

    assert gaussian_schedule(RunSettings("standard")).seconds == 30.0
    asked = gaussian_schedule(RunSettings("standard", iterations=500))
    assert asked.steps == 500 and asked.seconds is None
    assert gaussian_schedule(RunSettings("quick")).seconds is None


def test_pruning_and_densification_keep_the_moments_and_the_cap(gpu, phantom_views):
    prepared, views = phantom_views
    config = GaussianTrainConfig(densify_fraction=0.5)
    gaussians = initial_gaussians(prepared, config, 40)
    n = gaussians.count
    gaussians.density[:5] = -10.0  # near transparent: dropped
    gaussians.log_scales[5] = np.log(100.0)  # far larger than any structure's detail: dropped
    scene = scene_for_study(gpu, prepared, gaussians, config)
    adam = GaussianAdam(gpu, scene, config, 3.0)
    moments = np.arange(GAUSSIAN_FLOATS * n + 4, dtype=np.float32)
    adam.reset(moments, moments)
    gradient = np.zeros(n)
    gradient[[10, 11, 12]] = [3.0, 2.0, 1.0]
    before = scene.gaussians()
    logits = np.arange(n * 4, dtype=np.float32).reshape(n, 4)  # two structures: logits, then slopes
    joint = JointStructures(scene, logits, 1.0, StructureTrainConfig())
    joint.set_weights(logits, m=logits + 0.5, v=logits + 0.25)
    cap = n - 6 + 2  # room for two more
    kept, grown = adapt(scene, adam, gradient, np.ones(n), config, 3.0, cap, np.random.default_rng(0), densify=True)
    assert scene.count == cap
    np.testing.assert_array_equal(kept, np.arange(6, n))
    np.testing.assert_array_equal(grown, [10, 11])
    # the structure weights trained with the pictures follow their Gaussians; the copies' moments start at zero
    joint.follow(kept, grown)
    after_logits, after_m, _ = joint.state()
    np.testing.assert_array_equal(after_logits, logits[[*range(6, n), 10, 11]])
    np.testing.assert_array_equal(after_m[: n - 6], logits[6:] + 0.5)
    assert not after_m[n - 6 :].any()
    after = scene.gaussians()
    kept = np.arange(6, n)
    np.testing.assert_array_equal(after.colours[: n - 6], before.colours[kept])
    m, _ = adam.moments()
    np.testing.assert_array_equal(m.colours[: n - 6], GaussianSet.from_flat(moments, n).colours[kept])
    assert not m.colours[n - 6 :].any()
    # the two with the largest gradients grew: copies of Gaussians 10 and 11, with their looks
    np.testing.assert_array_equal(after.colours[n - 6 :], before.colours[[10, 11]])
    assert before.looks[:, SPECULAR].all()  # (every structure of the phantom has a specular weight)
    np.testing.assert_array_equal(after.looks, before.looks[[*range(6, n), 10, 11]])
    # each pair keeps the original's mass (density times volume: a layer's optical depth) and thickness, split in
    # the Gaussian's plane
    def mass(gaussians, i):
        return np.exp(gaussians.log_scales[i].astype(np.float64).sum()) / (1.0 + np.exp(-float(gaussians.density[i])))

    for copy, source in enumerate([10, 11]):
        assert mass(after, source - 6) + mass(after, n - 6 + copy) == pytest.approx(mass(before, source), rel=1e-4)
        assert after.log_scales[n - 6 + copy, 2] == before.log_scales[source, 2]
        offset = after.positions[n - 6 + copy] - before.positions[source]
        assert abs(offset @ before.rotation_matrices()[source][:, 2]) < 1e-4 * np.linalg.norm(offset) + 1e-5
    assert np.isin(scene.cell_lists()[0], np.arange(scene.count)).all()


def test_pruning_keeps_an_even_layer_of_wide_faint_gaussians(gpu, phantom_views):
    """Wide Gaussians overlap many to a point, so that evening the layers leaves each a small share of its layer's
    optical depth; pruning drops only the near transparent (a depth through the Gaussian under ``prune_depth``), so
    a freshly evened layer loses none of them (a threshold on the density logit's sigmoid dropped a quarter of the
    4 mm phantom's at this spread, and its held-out view fell from 40.9 to 34.2 dB)."""
    prepared, _ = phantom_views
    config = GaussianTrainConfig(spread=1.2)
    gaussians = initial_gaussians(prepared, config, 300)
    assert (1.0 / (1.0 + np.exp(-gaussians.density)) < 0.01).any(), "some should be faint by their logit alone"
    scene = scene_for_study(gpu, prepared, gaussians, config)
    adam = GaussianAdam(gpu, scene, config, 3.0)
    count = scene.count
    kept, grown = adapt(scene, adam, np.zeros(count), np.ones(count), config, 3.0, count, np.random.default_rng(0),
                        densify=False)
    assert len(kept) == count and not len(grown)


def test_the_cap_follows_the_memory_budget():
    config = GaussianTrainConfig(initial=50_000, max_gaussians=1_000_000)
    assert gaussian_cap(MemoryBudget(64 << 30, "--gpu-memory"), config) == 1_000_000
    small = gaussian_cap(MemoryBudget(64 * MIB, "--gpu-memory"), config)
    assert 20_000 < small < 100_000  # 40 % of 64 MiB at about a kilobyte a Gaussian
    with pytest.raises(GpuMemoryError, match=r"budget of 4 MiB \(--gpu-memory\) holds"):
        gaussian_cap(MemoryBudget(4 * MIB, "--gpu-memory"), config)
