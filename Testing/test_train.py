"""Staged training on a tiny analytic phantom: the held-out views and the geometry come out right, and a
cancel keeps a usable state."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import analytic_prepared
from field_reference import tiny_config

from NeuralRaycastLib.field.field import GROUP_APPEARANCE, GROUP_GEOMETRY, GROUP_TABLE, FieldLayout, NeuralField
from NeuralRaycastLib.field.sdf_fit import Adam, FitConfig, SdfFitter, learning_rate_factor
from NeuralRaycastLib.render.image_loss import (
    albedo_consistency_and_gradient,
    geometry_loss_and_gradient,
    patch_loss_and_gradient,
)
from NeuralRaycastLib.render.patches import PatchSampler
from NeuralRaycastLib.render.reference_views import render_reference_views
from NeuralRaycastLib.render.sample_buffers import OUTPUTS
from NeuralRaycastLib.study.sample.phantom import Phantom
from NeuralRaycastLib.train.evaluate import geometry_metrics
from NeuralRaycastLib.train.presets import training_schedule
from NeuralRaycastLib.train.trainer import Trainer, TrainLog, field_renderer, score_views

pytestmark = pytest.mark.gpu

SPACING = 2.5


@pytest.fixture(scope="module")
def phantom_views(gpu):
    phantom = Phantom(brain_tilt_degrees=(0.0, 0.0, 0.0))  # exact SDFs: the tilt (for label maps) not needed
    low, high = phantom.bounds(6.0)
    sdfs = {name: (lambda p, name=name: phantom.sdf(name, p)) for name in phantom.structure_names}
    prepared = analytic_prepared(sdfs, SPACING, low, high)
    views = render_reference_views(gpu, prepared, 8, 40, 40, held_out_every=4)
    return prepared, views


def new_field(gpu, prepared, cooperative: bool | None = None) -> NeuralField:
    layout = FieldLayout.build(tiny_config(log2_table=14, coarsest_cells=8, finest_cell_mm=SPACING),
                               prepared.bounds, len(prepared.structures), 1)
    return NeuralField(gpu, layout, seed=1, cooperative=cooperative)


def test_reference_patches_are_the_views_g_buffers_in_the_renderers_output_order(phantom_views):
    """The trainer compares each rendered patch with the views' RGBA, normal and depth under it, channel for
    channel as the renderer outputs them (ReferenceViews.targets, which fills one array in threads)."""
    _, views = phantom_views
    targets = views.targets()
    assert targets.shape == (len(views.images), 40, 40, OUTPUTS) and targets.dtype == np.float32
    sampler = PatchSampler(targets, views.training, 8, seed=0)
    rows = sampler.sample(12)
    assert set(rows[:, 0]) <= set(views.training)
    for (view, x, y), patch in zip(rows, sampler.reference_patches(rows), strict=True):
        image = views.images[view]
        np.testing.assert_array_equal(patch[..., :4], image.rgba[y : y + 8, x : x + 8])
        np.testing.assert_array_equal(patch[..., 4:7], image.normal[y : y + 8, x : x + 8])
        np.testing.assert_array_equal(patch[..., 7], image.depth[y : y + 8, x : x + 8])


def test_patches_come_from_the_training_views_mostly_where_something_is_shown():
    """Patch corners lie inside the pictures, on training views only; about ``foreground_fraction`` of the
    patches are centred where the reference shows something, and a view showing nothing still gets patches
    (empty space is learnt too)."""
    reference = np.zeros((4, 64, 48, OUTPUTS), np.float32)
    reference[:, 20:40, 10:30, 3] = 1.0
    reference[2, ..., 3] = 0.0  # nothing shown
    sampler = PatchSampler(reference, [0, 2, 3], 8, foreground_fraction=0.8, seed=0)
    rows = sampler.sample(6000)
    assert rows.dtype == np.int32 and set(rows[:, 0]) == {0, 2, 3}
    assert rows[:, 1].min() >= 0 and rows[:, 1].max() <= 48 - 8 and rows[:, 2].min() >= 0 and rows[:, 2].max() <= 64 - 8
    centred = reference[rows[:, 0], rows[:, 2] + 4, rows[:, 1] + 4, 3] > 0
    shown = rows[:, 0] != 2
    assert 0.8 < centred[shown].mean() < 0.9  # 0.8 drawn on the foreground, some of the rest land on it too
    assert not centred[~shown].any() and 0.25 < (~shown).mean() < 0.42


def test_training_reproduces_held_out_views_and_the_segmentation(gpu, phantom_views):
    prepared, views = phantom_views
    field = new_field(gpu, prepared)
    config = replace(training_schedule("quick"), appearance_steps=15, joint_steps=15, eval_every=15)
    config = replace(config, geometry=replace(config.geometry, steps=120))
    trainer = Trainer(gpu, prepared, field, views, config)
    log = trainer.run()
    assert not log.cancelled and log.skipped_steps == 0
    scores = [row["heldout_psnr"] for row in log.rows if "heldout_psnr" in row]
    assert len(scores) == 2
    assert scores[-1] > 30.0, scores
    assert log.rays == 30 * config.patches * config.patch_size**2
    assert set(log.first_step_seconds) == {2, 3}  # kept apart: each loads its stage's kernels
    assert all(0 < log.first_step_seconds[s] <= log.stage_seconds[s] for s in (2, 3))
    geometry = geometry_metrics(field, prepared)
    for name in ("brain", "whole_tumor"):
        assert geometry[name]["dice"] > 0.9, geometry
        assert geometry[name]["mean_surface_distance_mm"] < SPACING, geometry


def test_rates_after_each_stages_first_step_leave_that_step_out():
    log = TrainLog(stage_rays={2: 100, 3: 50}, stage_steps={2: 10, 3: 5}, stage_seconds={2: 2.0, 3: 3.0},
                   first_step_seconds={2: 1.1, 3: 0.6})
    assert log.rays_per_second() == pytest.approx(150 / 5.0)
    assert log.rays_per_second(2, after_first_step=True) == pytest.approx(90 / 0.9)
    assert log.rays_per_second(after_first_step=True) == pytest.approx((90 + 40) / (0.9 + 2.4))
    assert TrainLog().rays_per_second(after_first_step=True) == 0.0  # nothing trained (a cancel in stage 1)


def test_finished_fields_pictures_place_and_shade_fewer_samples_and_look_the_same(gpu, phantom_views):
    """After training, the renderer places samples on the finer occupancy cells of ``render_cell_mm`` and shades
    down to ``render_shade_weight``: fewer samples and shaded segments per ray, the same picture."""
    from NeuralRaycastLib.bench.suites import work_per_ray

    prepared, views = phantom_views
    field = new_field(gpu, prepared)
    config = replace(training_schedule("quick"), occupancy_cell_mm=5.0, render_cell_mm=2.5, shade_weight=1e-3,
                     render_shade_weight=3e-3)
    trainer = Trainer(gpu, prepared, field, views, config)
    SdfFitter(gpu, prepared, field, replace(config.geometry, steps=120)).run()
    camera = views.cameras[views.held_out[0]]
    pictures, work = [], []
    for switch in (trainer.refresh_occupancy, trainer.use_picture_settings):
        switch()
        pictures.append(trainer.renderer.render(camera))
        work.append(work_per_ray(trainer.renderer, camera))
    assert trainer.renderer.occupancy.cell_mm == 2.5 and trainer.renderer.shade_weight == 3e-3
    (samples, shaded), (fewer_samples, fewer_shaded) = work
    assert fewer_samples < samples and fewer_shaded < shaded, work
    assert pictures[0].rgba[..., 3].max() > 0.5  # something is seen
    np.testing.assert_allclose(pictures[1].rgba, pictures[0].rgba, atol=0.01)


def test_cancel_keeps_a_finite_state(gpu, phantom_views):
    prepared, views = phantom_views
    field = new_field(gpu, prepared)
    config = replace(training_schedule("quick"), appearance_steps=5, joint_steps=5)
    config = replace(config, geometry=replace(config.geometry, steps=20, monitor_every=10))
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 25  # during stage 2

    log = Trainer(gpu, prepared, field, views, config).run(should_stop=stop)
    assert log.cancelled
    assert np.all(np.isfinite(field.parameters()))


def test_steps_the_device_cannot_hold_go_on_with_half_the_patches_and_stop_at_one_naming_what_to_lower(
        gpu, phantom_views, monkeypatch):
    """Out of device memory for a training step's rays, training goes on with half the patches a step, saying so
    and logging the patches used; where not even one patch fits, GpuMemoryError names what to lower."""
    from NeuralRaycastLib.gpu.device import GpuMemoryError
    from NeuralRaycastLib.render.sample_buffers import RayBatch

    prepared, views = phantom_views
    config = replace(training_schedule("quick"), appearance_steps=4, joint_steps=4, eval_every=4)
    config = replace(config, geometry=replace(config.geometry, steps=20, monitor_every=10))
    assert config.patches == 4 and config.patch_size == 16
    original = RayBatch.__init__
    limit = {"rays": 3 * 256}  # three patches' rays: a step of four cannot be held, one of two can

    def small_device(self, gpu, capacity, *args):
        if capacity > limit["rays"]:
            raise RuntimeError("createBuffer(rhi_desc) failed with error: out of memory (simulated)")
        original(self, gpu, capacity, *args)

    monkeypatch.setattr(RayBatch, "__init__", small_device)
    messages = []
    trainer = Trainer(gpu, prepared, new_field(gpu, prepared), views, config)
    log = trainer.run(lambda message, fraction: messages.append(message))
    assert not log.cancelled and log.skipped_steps == 0
    assert "the GPU could not hold a step of 4 patches: training on with 2" in messages
    assert log.memory["preset_patches"] == 4 and log.memory["patches"] == trainer.config.patches == 2
    assert log.rays == 8 * 2 * 256  # every step trained on two patches
    assert np.isfinite(log.last("heldout_psnr"))

    limit["rays"] = 100  # not one patch
    trainer = Trainer(gpu, prepared, new_field(gpu, prepared), views, config)
    with pytest.raises(GpuMemoryError) as raised:
        trainer.run()
    message = str(raised.value)
    assert message.startswith("the GPU could not hold the sample buffers of 256 rays")
    assert "even with 1 patch a step; raise --gpu-memory" in message and "--max-voxels" in message
    assert "\n" not in message


def shaded_phantom(gpu, prepared, views, cooperative: bool | None = None):
    """A field fitted to the phantom's surfaces, its renderer, and a weighted sum of a small view's rendered
    sums as a function of the parameters (with the weights, ∂sum/∂sums, for the backward pass)."""
    field = new_field(gpu, prepared, cooperative)
    SdfFitter(gpu, prepared, field, FitConfig(steps=60, batch=1 << 12, seed=1)).run()  # surfaces to shade
    renderer = field_renderer(gpu, prepared, field, 128)
    camera = replace(views.cameras[0], width=16, height=12)
    rng = np.random.default_rng(3)
    d_sums = np.zeros((camera.width * camera.height, OUTPUTS), np.float32)
    d_sums[:, :4] = rng.normal(size=(len(d_sums), 4))

    def weighted_sum(parameters) -> float:
        field.set_parameters(parameters)
        batch = renderer.camera_rays(camera)
        renderer.forward(batch)
        return float(np.sum(renderer.sums(batch).astype(np.float64) * d_sums))

    return field, renderer, d_sums, weighted_sum


def backward_gradients(field, renderer, d_sums, weighted_sum, geometry: bool) -> np.ndarray:
    weighted_sum(field.parameters())
    field.zero_gradients()
    renderer.backward(renderer.batch(len(d_sums)), d_sums, geometry=geometry)
    return field.gradients()


def assert_matches_finite_differences(weighted_sum, base, gradient, indices, step):
    for index in indices:
        offset = np.zeros_like(base)
        offset[index] = step
        numeric = (weighted_sum(base + offset) - weighted_sum(base - offset)) / (2 * step)
        assert numeric == pytest.approx(gradient[index], rel=5e-2), index
    weighted_sum(base)


def test_appearance_only_backward_is_the_appearance_part_of_the_full_one(gpu, phantom_views):
    """Stage 2's fast backward (geometry frozen) must give the appearance network exactly the gradient the
    full backward gives it, and that gradient must match finite differences of the rendered sums."""
    field, renderer, d_sums, weighted_sum = shaded_phantom(gpu, *phantom_views)
    base = field.parameters()
    gradients = {geometry: backward_gradients(field, renderer, d_sums, weighted_sum, geometry)
                 for geometry in (True, False)}
    appearance = field.layout.groups() == GROUP_APPEARANCE
    assert np.abs(gradients[False][appearance]).max() > 0
    np.testing.assert_array_equal(gradients[False][~appearance], 0.0)
    np.testing.assert_allclose(gradients[False][appearance], gradients[True][appearance], rtol=1e-4,
                               atol=1e-6 * np.abs(gradients[True][appearance]).max())
    largest = np.flatnonzero(appearance)[np.argsort(-np.abs(gradients[False][appearance]))[:4]]
    assert_matches_finite_differences(weighted_sum, base, gradients[False], largest, 1e-2)


def test_full_backward_trains_the_hash_table_not_the_geometry_network(gpu, phantom_views):
    """The images' gradient reaches the geometry through the hash table (checked against finite
    differences of the rendered sums); the geometry network's weights get none from it (they follow the
    SDF and Eikonal terms: NeuralRaycastLib/field_scene.py says why). With the per-thread networks: a step of
    1e-4 in a table entry is below the half-precision resolution of the tensor-core networks' inputs, so on
    CUDA their central differences measured rounding (-3.8, -3.1 and +0.3 against -2.5 on an H100 in three
    runs); test_cooperative_geometry.py checks the tensor-core render's gradients against the per-thread ones."""
    field, renderer, d_sums, weighted_sum = shaded_phantom(gpu, *phantom_views, cooperative=False)
    base = field.parameters()
    gradient = backward_gradients(field, renderer, d_sums, weighted_sum, geometry=True)
    groups = field.layout.groups()
    np.testing.assert_array_equal(gradient[groups == GROUP_GEOMETRY], 0.0)
    table = np.flatnonzero(groups == GROUP_TABLE)
    largest = table[np.argsort(-np.abs(gradient[table]))[:4]]
    assert np.abs(gradient[largest]).min() > 0
    assert_matches_finite_differences(weighted_sum, base, gradient, largest, 1e-4)


def test_training_with_shadows_keeps_them_out_of_the_albedo(gpu, phantom_views):
    """References lit with key-light shadows: the field is shaded through meshes of its own surfaces
    (re-extracted as it trains), so it reproduces the shadowed pictures, and without the shadows its
    pictures match the unshadowed references: the shadows were not learned as colour."""
    prepared, plain = phantom_views
    shadowed = render_reference_views(gpu, prepared, 8, 40, 40, shadows=True, held_out_every=4)
    darker = np.concatenate([(p.rgb() - s.rgb()).max(axis=-1).ravel()
                             for p, s in zip(plain.images, shadowed.images, strict=True)])
    assert np.mean(darker > 0.05) > 0.02  # the shadows matter in these pictures

    field = new_field(gpu, prepared)
    config = replace(training_schedule("quick"), appearance_steps=25, joint_steps=10, eval_every=35, shadows=True,
                     mesh_every=4)
    config = replace(config, geometry=replace(config.geometry, steps=120))
    trainer = Trainer(gpu, prepared, field, shadowed, config)
    log = trainer.run()
    assert log.mesh_extractions == 1 + 2 + 1  # after stage 1, every 4 joint steps but the last, at the end
    assert log.mesh_seconds > 0
    assert log.last("heldout_psnr") > 30.0

    # Where the field reproduces a shadowed pixel, it must do so through the mask: without its shadows
    # that pixel looks like the lit reference. (A field with shadows baked into its albedo stays dark.)
    with_shadows = [trainer.renderer.render(camera).rgb() for camera in plain.cameras]
    trainer.renderer.set_mesh_shadows(None)
    without = [trainer.renderer.render(camera).rgb() for camera in plain.cameras]
    lit = np.stack([image.rgb() for image in plain.images])
    dark = np.stack([image.rgb() for image in shadowed.images])
    with_shadows, without = np.stack(with_shadows), np.stack(without)
    fitted_shadow = ((lit - dark).max(axis=-1) > 0.05) & (np.abs(with_shadows - dark).max(axis=-1) < 0.05)
    assert fitted_shadow.sum() >= 10
    assert np.abs(without - lit)[fitted_shadow].mean() < 0.5 * np.abs(without - dark)[fitted_shadow].mean()


def fitted_trainer(gpu, phantom_views, **weights) -> Trainer:
    """A trainer whose field has surfaces (a short stage-1 fit) and the given loss weights."""
    prepared, views = phantom_views
    field = new_field(gpu, prepared)
    SdfFitter(gpu, prepared, field, FitConfig(steps=60, batch=1 << 12, seed=1)).run()
    trainer = Trainer(gpu, prepared, field, views, replace(training_schedule("quick"), **weights))
    trainer.refresh_occupancy()
    return trainer


def test_albedo_consistency_makes_each_structure_uniform(gpu, phantom_views):
    """L_shade: with a large weight, stage-2 steps pull every structure's albedo towards one colour."""
    spreads = {}
    for weight in (0.0, 20.0):
        trainer = fitted_trainer(gpu, phantom_views, albedo_consistency_weight=weight, rate_appearance=2e-2)
        rows = trainer.sampler.sample(4)
        adam = Adam(gpu, trainer.field, trainer.config.render_fit_config(20))
        for step in range(20):
            trainer.image_step(geometry=False)
            adam.step(learning_rate_factor(step, adam.config), (0.0, 0.0, 1.0))
        batch = trainer.renderer.patch_rays(trainer._cameras, rows, trainer.config.patch_size)
        trainer.renderer.forward(batch)
        segments = trainer.renderer.segment_albedo(batch)
        assert len(segments.slots) > 100
        spreads[weight] = albedo_consistency_and_gradient(segments.albedo, segments.weight)[0]
    assert spreads[20.0] < 0.5 * spreads[0.0], spreads


def test_normal_and_depth_terms_descend(gpu, phantom_views):
    """L_norm and L_depth reach the geometry: a small step against their gradient lowers them. The step's
    loss, computed on the device, is the numpy definition's on the rendered patches and their references."""
    trainer = fitted_trainer(gpu, phantom_views, image_weight=0.0, normal_weight=1.0, depth_weight=1.0,
                             depth_scale_mm=SPACING)
    rows = trainer.sampler.sample(4)
    field = trainer.field
    start = field.parameters()
    field.zero_gradients()
    terms = trainer.image_step(geometry=True, rows=rows)
    assert terms["normal"] > 0 and terms["depth"] > 0

    size = trainer.config.patch_size
    batch = trainer.renderer.batch(len(rows) * size**2)
    sums = trainer.renderer.sums(batch).reshape(len(rows), size, size, OUTPUTS)
    targets = trainer.sampler.reference_patches(rows)
    loss, expected, gradient = geometry_loss_and_gradient(sums, targets, 1.0, 1.0, SPACING)
    expected.update(patch_loss_and_gradient(sums[..., :4], targets[..., :4])[1])
    assert terms == pytest.approx({"loss": loss, **expected}, rel=1e-4, abs=1e-7)
    d_sums = np.asarray(batch.d_sums.to_numpy())[: sums.size].reshape(sums.shape)
    # where the expected depth equals the reference's to float32 rounding, the sign of their difference (the
    # depth term's gradient) is a tie that float32 and float64 may break differently: those pixels' depth
    # gradients are left out of the comparison
    alpha = np.maximum(sums[..., 3].astype(np.float64), 1e-12)
    tie = np.abs(sums[..., 7] / alpha - targets[..., 7]) <= 1e-6 * np.abs(targets[..., 7]) + 1e-7
    for channel in (3, 7):
        d_sums[..., channel] = np.where(tie, gradient[..., channel], d_sums[..., channel])
    np.testing.assert_allclose(d_sums, gradient, rtol=1e-4, atol=1e-5 * np.abs(gradient).max())
    gradient = field.gradients()
    assert np.abs(gradient[field.layout.groups() != GROUP_APPEARANCE]).max() > 0
    field.set_parameters(start - 1e-3 * gradient / np.abs(gradient).max())
    field.zero_gradients()
    after = trainer.image_step(geometry=True, rows=rows)
    assert after["loss"] < terms["loss"], (terms, after)


def test_meshes_for_training_shadows_on_a_coarser_grid_shadow_alike(gpu, phantom_views):
    """Training re-meshes the learned surfaces on every n-th voxel (``mesh_grid_mm``): far fewer triangles,
    nearly the same shadowed pictures as meshes on the study's grid."""
    from NeuralRaycastLib.render.metrics import psnr
    from NeuralRaycastLib.train.trainer import learned_mesh_shadows

    trainer = fitted_trainer(gpu, phantom_views)
    prepared, views = phantom_views
    pictures, triangles = [], []
    for grid_mm in (0.0, 2 * SPACING):
        shadows = learned_mesh_shadows(gpu, prepared, trainer.field, trainer.style, grid_mm)
        triangles.append(len(shadows.bvh.triangle_ids))
        trainer.renderer.set_mesh_shadows(shadows)
        pictures.append(np.concatenate([trainer.renderer.render(camera).rgb() for camera in views.cameras[:4]]))
    trainer.renderer.set_mesh_shadows(None)
    unshadowed = np.concatenate([trainer.renderer.render(camera).rgb() for camera in views.cameras[:4]])
    print(f"triangles {triangles}; PSNR coarse vs fine {psnr(pictures[1], pictures[0]):.2f} dB, "
          f"shadows' own effect {psnr(unshadowed, pictures[0]):.2f} dB")
    assert triangles[1] < 0.4 * triangles[0]
    assert psnr(pictures[1], pictures[0]) > psnr(unshadowed, pictures[0]) + 6.0


def test_step_profile_names_every_phase_and_leaves_the_field_as_it_was(gpu, phantom_views):
    """The bench's breakdown of a joint step: each phase timed, the field's parameters untouched."""
    trainer = fitted_trainer(gpu, phantom_views)
    before = trainer.field.parameters()
    phases = trainer.profile_steps(joint=True, steps=2)
    for name in ("rays", "distances", "work lists", "normals and appearance", "composite", "image loss",
                 "composite backward", "scene backward: distances", "scene backward: normals and appearance",
                 "SDF and Eikonal terms", "Adam"):
        assert phases[name] > 0, name
    # the forward's and the scene backward's passes are listed: their totals as well would count them twice
    assert "forward" not in phases and "scene backward" not in phases
    np.testing.assert_array_equal(trainer.field.parameters(), before)


def test_held_out_views_are_rendered_in_the_training_steps_buffers(gpu, phantom_views):
    """Evaluating while training renders the views in bands of a step's rays, so the step's buffers serve them
    and no larger ones are made (under a memory budget, larger ones with the steps' gradients on top set the
    peak); the scores are those of a render in whole-view bands."""
    prepared, views = phantom_views
    config = replace(training_schedule("quick"), patches=2)
    trainer = Trainer(gpu, prepared, new_field(gpu, prepared), views, config)
    rays = config.patches * config.patch_size**2
    trainer.image_step(geometry=False)
    buffers = trainer.renderer.batch(1)
    scores = trainer.evaluate_views()
    assert trainer.renderer.batch(1) is buffers and buffers.capacity == rays
    whole = score_views(trainer.renderer, views, views.held_out)
    assert scores["heldout_psnr"] == pytest.approx(whole["heldout_psnr"], abs=1e-3)
    assert scores["heldout_ssim"] == pytest.approx(whole["heldout_ssim"], abs=1e-5)
