"""The differentiable renderer: the whole ray integral's gradient against finite differences, its forward
pass against the reference renderer (one image formation model), and inverse rendering from patches."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import analytic_prepared

from NeuralRaycastLib.render.camera import Camera, orbit_cameras
from NeuralRaycastLib.render.image_loss import patch_loss_and_gradient
from NeuralRaycastLib.render.neural_render import (
    BAND_HEADROOM,
    MIN_SEGMENT_WEIGHT,
    ROOM_HEADROOM,
    SHADE_WEIGHT,
    DiffRenderer,
)
from NeuralRaycastLib.render.occupancy import Occupancy
from NeuralRaycastLib.render.patches import PatchSampler, pack_cameras
from NeuralRaycastLib.render.reference_render import ReferenceRenderer, hybrid_shadows
from NeuralRaycastLib.render.sample_buffers import KEPT_FLOATS, OUTPUTS, RayBatch, address
from NeuralRaycastLib.render.scene import WorkLists
from NeuralRaycastLib.render.style import Lighting, RenderStyle, StructureStyle
from NeuralRaycastLib.study.sample.phantom import sphere_sdf
from NeuralRaycastLib.study.structures import Structure

#: two overlapping spheres: centre, radius, albedo, specular
SPHERES = np.array([[0, 0, 0, 10, 0.8, 0.3, 0.2, 0.3], [4, -9, 3, 5, 0.2, 0.7, 0.4, 0.1]], np.float32)
STRUCTURES = [Structure("a", (1,), (1.0, 0.0, 0.0)), Structure("b", (2,), (0.0, 1.0, 0.0))]
BOX = np.array([[-20.0, -20.0, -20.0], [20.0, 20.0, 20.0]])
STYLE = RenderStyle({"a": StructureStyle(0.6), "b": StructureStyle(0.8)}, Lighting())


class Spheres:
    """The analytic sphere scene (shaders/sphere_scene.slang) with its parameters on the device."""

    def __init__(self, gpu, values: np.ndarray) -> None:
        import slangpy as spy

        self.structures = np.asarray(values).size // 8
        self.module = gpu.load_module("sphere_scene", self.structures)
        self.values = spy.Tensor.from_numpy(gpu.device, np.asarray(values, np.float32).ravel())
        self.grads = spy.Tensor.zeros_like(self.values)
        self.struct = {"params": {"values": self.values.storage.device_address,
                                  "grads": self.grads.storage.device_address}, "count": self.structures}

    def distances(self, grid, buffers: dict) -> None:
        self.module.sphereDistances(grid, self.struct, buffers)

    def surface(self, grid, buffers: dict) -> None:
        self.module.sphereSurface(grid, self.struct, buffers)

    def backward(self, lists: WorkLists, buffers: dict, timings=None) -> None:
        self.module.sphereBackwardSurface(WorkLists.launch(lists.shaded), self.struct, buffers)
        self.module.sphereBackwardDistances(WorkLists.launch(lists.touched), self.struct, buffers)


def sphere_occupancy(cell_mm: float = 4.0, band_mm: float = 4.0) -> Occupancy:
    """Cells near the spheres' surfaces: samples only there, as a trained field's renders place them."""
    def both(points: np.ndarray) -> np.ndarray:
        return np.stack([sphere_sdf(points, sphere[:3], sphere[3]) for sphere in SPHERES], axis=1)

    return Occupancy.from_distances(both, BOX, cell_mm=cell_mm, band_mm=band_mm)


def sphere_renderer(gpu, values: np.ndarray, occupancy: Occupancy | None = None, structures=STRUCTURES,
                    style: RenderStyle = STYLE, min_weight: float = MIN_SEGMENT_WEIGHT,
                    shade_weight: float = SHADE_WEIGHT):
    import slangpy as spy

    settings = {"epsilon": 1.0, "step": 0.5, "shadowStep": 1.0,
                "boxMin": spy.float3(*BOX[0]), "boxMax": spy.float3(*BOX[1])}
    everywhere = Occupancy(np.ones((1, 1, 1), bool), BOX[0], 40.0)
    scene = Spheres(gpu, values)
    renderer = DiffRenderer(gpu, scene, style.shader_look(structures, ["t1"]), style.shader_lighting(), settings,
                            occupancy or everywhere, max_samples=128, min_weight=min_weight,
                            shade_weight=shade_weight)
    return renderer, scene


@pytest.mark.parametrize(("shade_weight", "for_backward"), [(0.0, False), (0.05, False), (0.05, True)])
def test_ray_integral_gradient_matches_finite_differences(gpu, shade_weight, for_backward):
    """L = Σ W · (colour, opacity, normal, depth sums) over a small image; every parameter checked, with
    every segment shaded and with most of them taking a shaded neighbour's surface values; after a forward
    pass that kept what the backward needs, or one that did not (the backward composites again)."""
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 6, 5)
    weights = np.random.default_rng(0).normal(size=(camera.height * camera.width, 8))

    def loss(values: np.ndarray) -> float:
        renderer, _scene = sphere_renderer(gpu, values, min_weight=0.0, shade_weight=shade_weight)
        batch = renderer.camera_rays(camera)
        renderer.forward(batch)
        return float((weights * renderer.sums(batch)).sum())

    values = SPHERES.ravel().astype(np.float64)
    renderer, scene = sphere_renderer(gpu, values, min_weight=0.0, shade_weight=shade_weight)
    batch = renderer.camera_rays(camera)
    renderer.forward(batch, for_backward=for_backward)
    borrowed = int((batch.samples.to_numpy().reshape(-1, 2)[:, 1] == 3.0).sum())
    assert (borrowed > 2 * batch.lists.shaded) if shade_weight else borrowed == 0
    renderer.backward(batch, weights)
    analytic = scene.grads.to_numpy()
    numeric = np.zeros_like(values)
    h = 1e-2
    for i in range(len(values)):
        plus, minus = values.copy(), values.copy()
        plus[i] += h
        minus[i] -= h
        numeric[i] = (loss(plus) - loss(minus)) / (2 * h)
    assert np.abs(numeric).max() > 1.0  # the loss depends on the parameters
    np.testing.assert_allclose(analytic, numeric, rtol=2e-2, atol=2e-2 * np.abs(numeric).max())


def test_albedo_gradient_under_mesh_shadows_matches_finite_differences(gpu):
    """With the key light shadowed by meshes, the colour's gradient with respect to each sphere's albedo and
    specular weight (which move no surface, so every shadow stays where it is) is that of the shadowed picture."""
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 16, 12)
    sdfs = {"a": lambda p: sphere_sdf(p, SPHERES[0, :3], SPHERES[0, 3]),
            "b": lambda p: sphere_sdf(p, SPHERES[1, :3], SPHERES[1, 3])}
    shadows = hybrid_shadows(gpu, analytic_prepared(sdfs, 1.0, *BOX), STYLE)
    weights = np.zeros((camera.height * camera.width, OUTPUTS))
    weights[:, :3] = np.random.default_rng(1).normal(size=(len(weights), 3))  # the colour alone

    def rendered(values: np.ndarray):
        renderer, scene = sphere_renderer(gpu, values, min_weight=0.0, shade_weight=0.0)
        renderer.set_mesh_shadows(shadows)
        batch = renderer.camera_rays(camera)
        renderer.forward(batch, for_backward=True)
        return renderer, scene, batch

    values = SPHERES.ravel().astype(np.float64)
    renderer, scene, batch = rendered(values)
    shaded = batch.shaded_slots.to_numpy()[: batch.lists.shaded]
    assert (batch.visibility.to_numpy()[shaded] < 0.5).mean() > 0.05, "the key light casts no shadow here"
    renderer.backward(batch, weights)
    analytic = scene.grads.to_numpy().reshape(SPHERES.shape)[:, 4:8]
    numeric = np.zeros_like(analytic)
    h = 1e-2
    for k in range(len(SPHERES)):
        for i in range(4):
            plus, minus = values.copy(), values.copy()
            plus[k * 8 + 4 + i] += h
            minus[k * 8 + 4 + i] -= h
            loss = [float((weights * r.sums(b)).sum()) for r, _s, b in (rendered(plus), rendered(minus))]
            numeric[k, i] = (loss[0] - loss[1]) / (2 * h)
    assert np.abs(numeric).max() > 1.0
    np.testing.assert_allclose(analytic, numeric, rtol=1e-2, atol=1e-2 * np.abs(numeric).max())


def _segment_depths(renderer, batch) -> tuple[np.ndarray, np.ndarray]:
    """Optical depth of every segment of the last forward (rays, max_samples - 1; 0 where not linked) and
    each segment's slot."""
    n, m, k = renderer.ray_count, renderer.max_samples, renderer.scene.structures
    counts = renderer.sample_counts(batch)
    # sample j of ray r in slot j · n + r (shaders/sample_buffers.slang)
    samples = batch.samples.to_numpy()[: m * n * 2].reshape(m, n, 2).transpose(1, 0, 2)
    distance = batch.distances.to_numpy()[: m * n * k].reshape(m, n, k).transpose(1, 0, 2).astype(np.float64)
    inside = 1.0 / (1.0 + np.exp(np.clip(distance / renderer.epsilon, -60, 60)))
    depth = (np.asarray(renderer.look["opticalDepth"][:k]) * np.abs(np.diff(inside, axis=1))).sum(axis=-1)
    linked = (samples[:, :-1, 1] != 0) & (np.arange(1, m)[None, :] < counts[:, None])
    slot = np.arange(m - 1)[None, :] * n + np.arange(n)[:, None]
    return np.where(linked, depth, 0.0), slot


def _runs(row: np.ndarray) -> list[np.ndarray]:
    """Indices of each run of True in a row."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], row.astype(int), [0]])))
    return [np.arange(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True)]


@pytest.mark.parametrize(("min_weight", "shade_weight"), [(0.0, 0.0), (1e-3, 0.0), (1e-4, 1e-2)])
def test_work_lists_hold_the_segments_compositing_reads(gpu, min_weight, shade_weight):
    """Normals, appearance and the backward pass run only on the work lists. A segment is composited where
    it is not empty and adds more than the minimum weight to its pixel (transmittance × opacity, counting
    the composited segments before it) until the transmittance has run out (here an opaque sphere ends
    most rays). It is shaded where it adds more than the shade weight, and every run of composited
    segments has a shaded one (its heaviest, where none adds that much); the others borrow. The touched
    list holds exactly the samples at the ends of the composited segments, the sampled list every placed
    sample (each ray's entries of every list in sample order), each shaded segment finds its surface values
    through its slot, and the marks compositing reads are these."""
    opaque = RenderStyle({"a": StructureStyle(0.99999), "b": StructureStyle(0.8)}, Lighting())
    # 23 × 19 pixels: the listing kernels' tiles of 8 × 4 cut at the edges
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 23, 19)
    renderer, _scene = sphere_renderer(gpu, SPHERES, style=opaque, min_weight=min_weight, shade_weight=shade_weight)
    batch = renderer.camera_rays(camera)
    renderer.forward(batch)
    depth, slot = _segment_depths(renderer, batch)
    listed = batch.shaded_slots.to_numpy()[: batch.lists.shaded]
    touched = batch.touched_slots.to_numpy()[: batch.lists.touched]
    assert len(set(listed)) == len(listed) and len(set(touched)) == len(touched)
    marks = batch.samples.to_numpy().reshape(-1, 2)[: slot.max() + 1, 1]
    composited = np.flatnonzero((marks == 2.0) | (marks == 3.0))
    assert set(np.flatnonzero(marks == 2.0)) == set(listed)
    rays = renderer.ray_count  # a ray's next sample is `rays` slots on
    assert set(touched) == set(composited) | {s + rays for s in composited}
    counts = renderer.sample_counts(batch)
    sampled = batch.sampled_slots.to_numpy()[: batch.lists.sampled]
    placed = np.concatenate([np.arange(c) * rays + r for r, c in enumerate(counts)])
    assert batch.lists.sampled == counts.sum() > 0 and set(sampled) == set(placed)
    for lists in (sampled, listed, touched):  # each ray's entries in the order of its samples
        order = np.argsort(lists % rays, kind="stable")
        same_ray = np.diff(lists[order] % rays) == 0
        assert np.all(np.diff(lists[order])[same_ray] > 0)
    np.testing.assert_array_equal(batch.surface_entry.to_numpy()[listed], np.arange(len(listed)))

    # weights recomputed here in float64 differ from the shader's float32 ones (insideness near 1 cancels)
    tolerance = 1e-3
    is_composited, is_shaded = np.isin(slot, composited), np.isin(slot, listed)
    tau = np.where(is_composited, depth, 0.0)
    before = np.exp(-(np.cumsum(tau, axis=1) - tau))
    weight = before * (1.0 - np.exp(-depth))
    assert np.all(depth[is_composited] > 1e-6) and np.all(weight[is_composited] > min_weight * (1 - tolerance))
    alive = before > 1e-4 * (1 + tolerance)
    left_out = ~is_composited & alive & (depth > 1e-6)
    assert np.all(weight[left_out] <= min_weight * (1 + tolerance) + 1e-12)
    assert np.all(is_shaded[is_composited & (weight > shade_weight * (1 + tolerance))])
    borrowing = is_composited & ~is_shaded
    assert np.all(weight[borrowing] <= shade_weight * (1 + tolerance))
    for row in range(len(slot)):
        for run in _runs(is_composited[row]):
            assert is_shaded[row, run].any()
            if not (weight[row, run] > shade_weight * (1 + tolerance)).any():
                heaviest = weight[row, run][is_shaded[row, run]]
                assert len(heaviest) == 1 and heaviest[0] >= weight[row, run].max() * (1 - tolerance)
    if shade_weight:
        assert borrowing.sum() > is_shaded.sum()
    else:
        assert not borrowing.any()
    if min_weight:  # faint segments were left out (behind the opaque sphere all are faint)
        assert left_out.sum() > 0.1 * is_composited.sum()
    else:  # the opaque sphere cut many rays short
        assert (~is_composited & (depth > 1e-6) & ~alive).sum() > 100


def test_a_rendered_band_lists_what_a_training_batch_does_but_the_touched_samples(gpu):
    """A rendered view's bands (no backward pass follows) skip the touched list and nothing else: the same
    shaded and sampled lists, the same marks, the same sums as a batch made for training."""
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 23, 19)
    renderer, _scene = sphere_renderer(gpu, SPHERES, shade_weight=1e-2)
    kept = []
    for backward_follows in (True, False):
        batch = renderer.camera_rays(camera)
        renderer.forward(batch, backward_follows=backward_follows)
        kept.append((batch.lists, batch.shaded_slots.to_numpy()[: batch.lists.shaded].copy(),
                     batch.samples.to_numpy().copy(), renderer.sums(batch).copy()))
    (trained, shaded, marks, sums), (rendered, band_shaded, band_marks, band_sums) = kept
    assert trained.touched > trained.shaded > 0 and rendered.touched == 0
    assert (rendered.shaded, rendered.sampled) == (trained.shaded, trained.sampled)
    np.testing.assert_array_equal(np.sort(band_shaded), np.sort(shaded))  # (waves append in any order)
    np.testing.assert_array_equal(band_marks, marks)
    np.testing.assert_array_equal(band_sums, sums)


def test_segment_albedo_is_the_scenes_and_its_gradient_reaches_the_scene(gpu):
    """The albedo losses' input (segment_albedo) is each shaded segment's albedo as the shading pass stored
    it: here the spheres' own colours. A gradient added to it between the two halves of the backward
    (add_albedo_gradient) reaches the spheres' albedo parameters, once per shaded segment."""
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 23, 19)
    renderer, scene = sphere_renderer(gpu, SPHERES)
    batch = renderer.camera_rays(camera)
    renderer.forward(batch, for_backward=True)
    segments = renderer.segment_albedo(batch)
    shaded = len(segments.slots)
    assert shaded == batch.lists.shaded > 100
    for k in range(len(STRUCTURES)):
        np.testing.assert_array_equal(segments.albedo[:, k], np.tile(SPHERES[k, 4:7], (shaded, 1)))
    renderer.composite_backward(batch, np.zeros((renderer.ray_count, OUTPUTS)))  # the image adds nothing
    d_albedo = np.zeros((shaded, len(STRUCTURES), 3), np.float32)
    d_albedo[:, 0, 0] = 1.0
    d_albedo[:, 1, 2] = 2.0
    renderer.add_albedo_gradient(batch, segments, d_albedo)
    renderer.scene_backward(batch)
    expected = np.zeros_like(SPHERES)
    expected[0, 4], expected[1, 6] = shaded, 2.0 * shaded
    np.testing.assert_allclose(scene.grads.to_numpy().reshape(SPHERES.shape), expected, atol=1e-6)


def test_faint_segments_left_out_change_no_8_bit_colour(gpu):
    """With the default minimum weight, the segments left out change no pixel by as much as one step of
    8-bit colour, and fewer segments are shaded."""
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 32, 24)
    shaded, images = [], []
    for min_weight in (0.0, MIN_SEGMENT_WEIGHT):
        renderer, _scene = sphere_renderer(gpu, SPHERES, min_weight=min_weight, shade_weight=0.0)
        batch = renderer.camera_rays(camera)
        renderer.forward(batch)
        shaded.append(batch.lists.shaded)
        images.append(renderer.render(camera))
    assert shaded[1] < 0.7 * shaded[0]
    difference = np.abs(images[1].rgba - images[0].rgba)
    assert 0 < difference.max() < 1 / 255


def test_faint_segments_borrowing_a_neighbours_surface_values_shade_fewer_and_change_little(gpu):
    """With the default shade weight the faint tails of each crossing take the surface values of a shaded
    segment of it: far fewer segments are shaded (so evaluate normals and appearance), the opacity is
    unchanged and no colour moves by more than about one 8-bit step (here, with shells two voxels wide)."""
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 32, 24)
    shaded, images = [], []
    for shade_weight in (0.0, SHADE_WEIGHT):
        renderer, _scene = sphere_renderer(gpu, SPHERES, shade_weight=shade_weight)
        batch = renderer.camera_rays(camera)
        renderer.forward(batch)
        shaded.append(batch.lists.shaded)
        images.append(renderer.render(camera))
    assert shaded[1] < 0.7 * shaded[0]
    np.testing.assert_allclose(images[1].rgba[..., 3], images[0].rgba[..., 3], atol=1e-6)
    difference = np.abs(images[1].rgba[..., :3] - images[0].rgba[..., :3])
    assert 0 < difference.max() < 1.5 / 255


def test_a_scene_of_more_structures_than_four_renders_the_same(gpu):
    """Kernels are compiled for four structure slots where a scene's structures fit, else for eight: three more
    spheres, all outside the view's box, leave every pixel of the G-buffer as it was."""
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 32, 24)
    far = np.array([[60.0 + 10 * k, 60.0, 60.0, 2.0, 0.5, 0.5, 0.5, 0.2] for k in range(3)], np.float32)
    more = [*STRUCTURES, *(Structure(f"far{k}", (3 + k,), (0.5, 0.5, 0.5)) for k in range(3))]
    style = RenderStyle({s.name: StructureStyle(0.7) for s in more}, Lighting())
    images = []
    for spheres, structures, slots in ((SPHERES, STRUCTURES, 4), (np.concatenate([SPHERES, far]), more, 8)):
        renderer, _scene = sphere_renderer(gpu, spheres, structures=structures, style=style)
        assert renderer.composite_module.structureSlots() == renderer.lists_module.structureSlots() == slots
        images.append(renderer.render(camera))
    assert (images[0].rgba[..., 3] > 0.5).any()
    np.testing.assert_allclose(images[1].rgba, images[0].rgba, atol=1e-6)
    np.testing.assert_allclose(images[1].depth, images[0].depth, atol=1e-4)
    np.testing.assert_allclose(images[1].normal, images[0].normal, atol=1e-5)


def test_a_view_rendered_in_bands_is_the_g_buffer_of_its_rays_sums(gpu):
    """render() keeps the bands' sums on the device and makes the G-buffer there: the same as each ray's sums
    finished on the host (colour and opacity as they are, unit normal, depth over opacity, 0 where empty)."""
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 32, 24)
    renderer, _scene = sphere_renderer(gpu, SPHERES)
    band = 7 * camera.width  # 24 rows: three bands of 7 and one of 3
    sums = np.zeros((camera.height, camera.width, 8))
    for first, rows, batch in renderer.camera_bands(camera, band):
        sums[first:first + rows] = renderer.sums(batch).reshape(rows, camera.width, 8)
    image = renderer.render(camera, band)
    alpha = sums[..., 3]
    assert (alpha == 0).any() and (alpha > 0.5).any()
    np.testing.assert_allclose(image.rgba, sums[..., :4], atol=1e-6)
    length = np.linalg.norm(sums[..., 4:7], axis=-1, keepdims=True)
    np.testing.assert_allclose(image.normal, np.where(length > 0, sums[..., 4:7] / np.maximum(length, 1e-30), 0.0),
                               atol=1e-5)
    np.testing.assert_allclose(image.depth, np.where(alpha > 0, sums[..., 7] / np.maximum(alpha, 1e-30), 0.0),
                               rtol=1e-5, atol=1e-4)


def test_the_picture_made_on_the_device_is_the_views_straight_alpha_bytes_bottom_row_first(gpu):
    """render_picture (the live view's) packs on the device what rgba_bytes makes of render()'s colour plane."""
    from NeuralRaycastLib.render.live_view import rgba_bytes

    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 32, 24)
    renderer, _scene = sphere_renderer(gpu, SPHERES)
    expected = rgba_bytes(renderer.render(camera).rgba)
    picture = renderer.render_picture(camera)
    assert picture.shape == (24, 32, 4) and picture.dtype == np.uint8
    assert (expected[..., 3] == 0).any() and (expected[..., 3] > 0).any()  # background and covered pixels
    assert not np.array_equal(expected, expected[::-1])  # so the rows' order is tested too
    assert np.abs(picture.astype(int) - expected.astype(int)).max() <= 1  # rounding of the division apart
    assert (picture != expected).mean() < 0.01


def test_rendering_bands_fit_the_memory_budget_and_keep_no_gradients(gpu, monkeypatch):
    """A view renders in bands whose buffers, sized by the samples their rays took, fit BAND_BYTES (the same
    picture as in one band), and a rendering batch holds no gradient buffers until a backward pass asks for
    them, then only for its rays."""
    from NeuralRaycastLib.render import neural_render

    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 32, 24)
    renderer, _scene = sphere_renderer(gpu, SPHERES)
    whole = renderer.render(camera, camera.width * camera.height)
    (_rays, _slots, need), = renderer.band_work
    budget = need // 3  # a third of what the view takes in one band
    monkeypatch.setattr(neural_render, "BAND_BYTES", (budget, budget, budget))
    renderer._batch = None
    banded = renderer.render(camera)
    batch = renderer._batch
    assert len(renderer.band_work) >= 3
    assert all(need <= budget for _rays, _slots, need in renderer.band_work)
    assert batch.distance_grads is None and batch.surface_grads is None
    assert batch.touched_capacity < camera.width * camera.height // 10  # no backward follows a rendered band
    most = max(slots for _rays, slots, _need in renderer.band_work)
    held = RayBatch.band_bytes(batch.capacity, batch.slot_capacity, batch.surface_capacity, renderer.scene.structures,
                               renderer.segment_words())
    assert most <= batch.slot_capacity and held <= budget  # the room kept for the next view within the band's share
    np.testing.assert_array_equal(banded.rgba, whole.rgba)
    band = renderer.camera_rays(camera, 0, 2)  # fewer rays than the batch holds, as a training step's
    renderer.forward(band)
    renderer.backward(band, np.ones((2 * camera.width, 8)))
    assert batch.distance_grads is not None and batch.surface_grads is not None
    slots = 2 * camera.width * renderer.max_samples  # gradient buffers for the rays trained, not the capacity
    assert batch.distance_grads.shape[0] == slots * renderer.scene.structures
    assert batch.kept.shape[0] == slots * KEPT_FLOATS


def test_bands_grow_with_the_gpus_memory_and_keep_each_buffer_creatable(gpu, monkeypatch):
    """On a GPU a band takes a tenth of its memory, between 1 and 3 GiB (1 GiB where the memory cannot be read),
    and never so many rays that the slots' buffer would reach MAX_BUFFER_BYTES: before any view was counted
    at ``max_samples`` a ray, then at the samples a band's rays took."""
    from types import SimpleNamespace

    from NeuralRaycastLib.gpu.memory_budget import MemoryBudget
    from NeuralRaycastLib.render import neural_render

    renderer, _scene = sphere_renderer(gpu, SPHERES)
    per_ray = RayBatch.bytes_per_ray(renderer.max_samples, renderer.scene.structures)
    renderer.gpu = SimpleNamespace(report=SimpleNamespace(software=False), memory=MemoryBudget(76 << 30, "test"))
    for total, band in ((80 << 30, 3 << 30), (15 << 30, 3 << 29), (8 << 30, 1 << 30), (None, 1 << 30)):
        monkeypatch.setattr(neural_render, "device_memory_total", lambda gpu, total=total: total)
        renderer._device_bytes = None
        assert renderer.band_rays() == band // per_ray
    slots_per_ray = renderer.max_samples * RayBatch.slot_bytes(renderer.scene.structures)
    monkeypatch.setattr(neural_render, "MAX_BUFFER_BYTES", 10 * slots_per_ray)
    assert renderer.band_rays() == 9  # 10 rays' slots would be exactly the limit
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 16, 24)
    renderer.gpu = gpu
    monkeypatch.setattr(neural_render, "MAX_BUFFER_BYTES", 4 * 32 * slots_per_ray)  # 4 tiles at max_samples
    bands = [rows for _first, rows, _batch in renderer.camera_bands(camera, rays_per_pass=camera.width * 24)]
    assert len(bands) > 1 and sum(bands) == camera.height  # asked for the whole view in one band
    slot_bytes = RayBatch.slot_bytes(renderer.scene.structures)
    assert all(slots * slot_bytes < neural_render.MAX_BUFFER_BYTES
               for _rays, slots, _need in renderer.band_work), renderer.band_work


def test_bands_take_the_memory_budgets_share_and_render_the_same_picture(gpu, monkeypatch):
    """Under a small GPU memory budget a band needs no more than the budget's share for a band, on a GPU as on a
    software device; a budget with memory to spare leaves the bands at BAND_BYTES (and the picture is the same
    either way). Once a view was counted, bands hold more rays than at ``max_samples`` a ray."""
    from types import SimpleNamespace

    from NeuralRaycastLib.gpu.memory_budget import MIB, SHARES, MemoryBudget
    from NeuralRaycastLib.render import neural_render

    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 32, 24)
    renderer, _scene = sphere_renderer(gpu, SPHERES, sphere_occupancy())
    per_ray = RayBatch.bytes_per_ray(renderer.max_samples, renderer.scene.structures)
    assert renderer.band_rays() == neural_render.BAND_BYTES[2] // per_ray  # lavapipe's 4 GiB default: as before
    whole = renderer.render(camera)
    counted = renderer.band_rays()
    assert counted > neural_render.BAND_BYTES[2] // per_ray  # the rays took fewer than max_samples
    small = MemoryBudget(2 * MIB, "--gpu-memory")
    monkeypatch.setattr(gpu, "memory", small)
    renderer.release_batch()
    share = int(small.bytes * SHARES["band"])
    rays = renderer.band_rays()
    assert rays < counted and rays * renderer._ray_bytes <= share
    banded = renderer.render(camera)
    assert len(renderer.band_work) > 1
    assert all(need <= share for _rays, _slots, need in renderer.band_work)
    np.testing.assert_array_equal(banded.rgba, whole.rgba)
    renderer.gpu = SimpleNamespace(report=SimpleNamespace(software=False), memory=small)
    monkeypatch.setattr(neural_render, "device_memory_total", lambda gpu: 80 << 30)
    per_counted_ray = math.ceil(renderer._ray_bytes * neural_render.BAND_HEADROOM)
    assert renderer._band_bytes() == share  # a large GPU, a small budget: the budget's
    assert renderer.band_rays() == share // per_counted_ray
    renderer.gpu.memory = MemoryBudget(76 << 30, "the GPU's free memory")
    renderer._device_bytes = None
    assert renderer._band_bytes() == neural_render.BAND_BYTES[1]  # memory to spare: as before


def test_a_render_under_a_tiny_budget_equals_the_unbanded_one(gpu, monkeypatch):
    """Under a budget whose band share holds a row or two of rays, a view renders in many bands, each counted and
    laid out compact on its own, with mesh shadows too, and gives exactly the picture of one band."""
    from NeuralRaycastLib.gpu.memory_budget import KIB, MemoryBudget

    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 24, 20)
    sdfs = {"a": lambda p: sphere_sdf(p, SPHERES[0, :3], SPHERES[0, 3]),
            "b": lambda p: sphere_sdf(p, SPHERES[1, :3], SPHERES[1, 3])}
    shadows = hybrid_shadows(gpu, analytic_prepared(sdfs, 1.0, *BOX), STYLE)
    renderer, _scene = sphere_renderer(gpu, SPHERES)
    renderer.set_mesh_shadows(shadows)
    whole = renderer.render(camera, camera.width * camera.height)
    assert len(renderer.band_work) == 1
    monkeypatch.setattr(gpu, "memory", MemoryBudget(256 * KIB, "--gpu-memory"))
    tiny = DiffRenderer(gpu, renderer.scene, renderer.look, renderer.shading["lighting"], renderer.settings,
                        renderer.occupancy, max_samples=renderer.max_samples)
    tiny.set_mesh_shadows(shadows)
    for _view in range(2):  # the first sized by max_samples a ray, the second by what the first counted
        banded = tiny.render(camera)
        assert len(tiny.band_work) > 4
        for name in ("rgba", "normal", "depth"):
            np.testing.assert_array_equal(getattr(banded, name), getattr(whole, name))


def _tile_rows(counts: np.ndarray, width: int) -> np.ndarray:
    """The rows of slots each 8 × 4 tile of rays ``width`` wide needs: its rays' largest sample count."""
    ray = np.arange(len(counts))
    tile = (ray // width // 4) * -(-width // 8) + ray % width // 8
    rows = np.zeros(tile.max() + 1, np.int64)
    np.maximum.at(rows, tile, counts)
    return rows


def test_compact_buffers_follow_the_samples_placed(gpu):
    """A rendered band's sample buffers hold the slots its rays' samples take (each tile's rays as many rows as the
    longest of them), not ``max_samples`` a ray, and every sample lies where the compact layout says, with the
    same t, link and distances as in a strided batch of the same rays."""
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 61, 45)  # tiles cut at the edges
    renderer, _scene = sphere_renderer(gpu, SPHERES, sphere_occupancy())
    renderer.render(camera)
    renderer.render(camera)  # with the room for shaded segments the first view counted
    (rays, slots, _need), = renderer.band_work
    batch = renderer._batch
    counts = renderer.sample_counts(batch)
    assert slots == 32 * _tile_rows(counts, camera.width).sum()
    assert counts.sum() <= slots < 1.5 * counts.sum()  # smooth spheres: neighbouring rays take about as many
    assert slots < rays * renderer.max_samples / 2
    assert slots <= batch.slot_capacity <= 1.25 * slots + 32  # (made for the next view, with some to spare)
    assert batch.distances.shape[0] == batch.slot_capacity * renderer.scene.structures
    shaded = batch.lists.shaded
    # (room for the next view: its headroom, a tenth more slots, and where that grew the room, a quarter more)
    assert shaded <= batch.surface_capacity <= math.ceil(1.25 * BAND_HEADROOM * ROOM_HEADROOM * shaded) + 1
    compact_slots = batch.ray_slots()
    samples = batch.samples.to_numpy().reshape(-1, 2).copy()
    distances = batch.distances.to_numpy().reshape(-1, renderer.scene.structures).copy()

    strided = renderer.camera_rays(camera)
    renderer.forward(strided, backward_follows=False)
    assert not strided.compact and np.array_equal(renderer.sample_counts(strided), counts)
    strided_slots = strided.ray_slots()
    strided_samples = strided.samples.to_numpy().reshape(-1, 2)
    strided_distances = strided.distances.to_numpy().reshape(-1, renderer.scene.structures)
    placed = np.arange(renderer.max_samples)[None, :] < counts[:, None]
    assert np.all(compact_slots[placed] >= 0) and len(set(compact_slots[placed])) == placed.sum()
    np.testing.assert_array_equal(samples[compact_slots[placed], 0], strided_samples[strided_slots[placed], 0])
    linked = samples[compact_slots[placed], 1] != 0
    np.testing.assert_array_equal(linked, strided_samples[strided_slots[placed], 1] != 0)
    np.testing.assert_array_equal(distances[compact_slots[placed]], strided_distances[strided_slots[placed]])


def test_a_band_with_too_little_room_for_its_shaded_segments_renders_again(gpu, monkeypatch):
    """Where the room a band makes for shaded segments (from the slots it counted) falls short, the view renders
    again, counted, with the same picture."""
    from NeuralRaycastLib.render import neural_render

    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 12, 10)
    renderer, _scene = sphere_renderer(gpu, SPHERES)
    expected = renderer.render(camera)
    monkeypatch.setattr(neural_render, "SHADED_PER_SLOT", 0.0)
    fresh, _scene = sphere_renderer(gpu, SPHERES)
    retried = _recorded_passes(fresh, monkeypatch)
    image = fresh.render(camera)
    assert retried == [False, True]
    np.testing.assert_array_equal(image.rgba, expected.rgba)
    assert fresh._batch.surface_capacity >= fresh._batch.lists.shaded > 0


def test_a_band_the_device_cannot_hold_renders_in_halves(gpu, monkeypatch):
    """Out of device memory for a band, a view renders in smaller bands (the same picture) and later views
    start there; where not even one row fits, GpuMemoryError says what could not be held."""
    from NeuralRaycastLib.gpu.device import GpuMemoryError

    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 32, 24)
    renderer, _scene = sphere_renderer(gpu, SPHERES)
    expected = renderer.render(camera)
    original = RayBatch.__init__
    limit = {"rays": 5 * camera.width}

    def small_device(self, gpu, capacity, *args):
        if capacity > limit["rays"]:
            raise RuntimeError("createBuffer(rhi_desc) failed with error: out of memory (simulated)")
        original(self, gpu, capacity, *args)

    monkeypatch.setattr(RayBatch, "__init__", small_device)
    renderer._batch = None
    np.testing.assert_array_equal(renderer.render(camera).rgba, expected.rgba)
    assert renderer.band_rays() <= limit["rays"]
    limit["rays"] = camera.width // 2
    renderer._batch = None
    with pytest.raises(GpuMemoryError, match="sample buffers of 32 rays"):
        renderer.render(camera)


def test_forward_pass_matches_the_reference_renderer(gpu):
    """Rendering the same spheres through the boundary-map renderer gives the same picture, and skipping
    unoccupied cells, and the parts of occupied ones beyond the band, changes nothing."""
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 32, 24)
    sdfs = {"a": lambda p: sphere_sdf(p, SPHERES[0, :3], SPHERES[0, 3]),
            "b": lambda p: sphere_sdf(p, SPHERES[1, :3], SPHERES[1, 3])}
    prepared = analytic_prepared(sdfs, 0.5, *BOX)
    # flat albedo from the scene's colours: no channel modulation in the reference
    reference_style = RenderStyle(
        {name: StructureStyle(opacity, channel=None, modulation=0.0, specular=float(SPHERES[k, 7]),
                              color=tuple(SPHERES[k, 4:7]))
         for k, (name, opacity) in enumerate((("a", 0.6), ("b", 0.8)))},
        STYLE.lighting, epsilon_voxels=2.0, step_voxels=1.0,
    )
    reference_renderer = ReferenceRenderer(gpu, prepared, reference_style)
    reference = reference_renderer.render(camera)

    def both(points: np.ndarray) -> np.ndarray:
        return np.stack([f(points) for f in sdfs.values()], axis=1)

    occupancy = Occupancy.from_distances(both, BOX, cell_mm=4.0, band_mm=8.0)
    assert 0.05 < occupancy.fraction < 0.9  # the corners of the box are skipped
    cells_only = Occupancy(occupancy.cells, occupancy.origin, occupancy.cell_mm)  # no interpolated distances
    finer = Occupancy.from_distances(both, BOX, cell_mm=2.0, band_mm=8.0)  # hugs the surfaces closer
    samples = []
    for grid in (None, cells_only, occupancy, finer):
        renderer, _scene = sphere_renderer(gpu, SPHERES, grid)
        neural = renderer.render(camera)
        assert reference.rgba[..., 3].max() > 0.5
        np.testing.assert_allclose(neural.rgba, reference.rgba, atol=0.005)
        hit = reference.rgba[..., 3] > 0.5
        np.testing.assert_allclose(neural.depth[hit], reference.depth[hit], atol=0.1)
        samples.append(sum(int(renderer.sample_counts(batch).sum()) for *_rows, batch in renderer.camera_bands(camera)))
    # the cells skip the box's corners, the interpolated distances what the cells keep beyond the band
    assert samples[3] < samples[2] < 0.8 * samples[1] < 0.8 * samples[0], samples

    # Hybrid shadows: the same meshes shadow both renderers' key light in the same way.
    shadows = hybrid_shadows(gpu, prepared, reference_style)
    shadowed_reference = reference_renderer.render(camera, mesh_shadows=shadows)
    renderer, _scene = sphere_renderer(gpu, SPHERES, occupancy)
    renderer.set_mesh_shadows(shadows)
    shadowed = renderer.render(camera)
    darker = np.abs(shadowed_reference.rgba - reference.rgba).max(axis=-1) > 0.02
    assert darker.mean() > 0.02, "the key light casts no shadow in this scene"
    np.testing.assert_allclose(shadowed.rgba, shadowed_reference.rgba, atol=0.01)
    renderer.set_mesh_shadows(None)
    np.testing.assert_allclose(renderer.render(camera).rgba, reference.rgba, atol=0.005)


def test_inverse_rendering_recovers_a_sphere_from_image_patches(gpu):
    """Patches + L1/DSSIM loss + the backward pass move a wrong sphere onto the right one."""
    import slangpy as spy

    cameras = orbit_cameras(BOX * 0.6, 4, 32, 32)
    cameras_t = spy.Tensor.from_numpy(gpu.device, pack_cameras(cameras).ravel())
    target = np.array([1.5, -1.0, 2.0, 8.0, 0.8, 0.3, 0.2, 0.3], np.float32)

    def run(values, rows, gradient=None):
        renderer, scene = sphere_renderer(gpu, values, structures=STRUCTURES[:1])
        batch = renderer.patch_rays(cameras_t, rows, 16)
        renderer.forward(batch)
        sums = renderer.sums(batch).reshape(len(rows), 16, 16, 8)
        if gradient is None:
            return sums
        renderer.backward(batch, gradient.reshape(-1, 8))
        return scene.grads.to_numpy()

    whole = np.array([[v, x, y] for v in range(4) for x in (0, 16) for y in (0, 16)], np.int32)
    reference = np.zeros((4, 32, 32, 4), np.float32)
    for (v, x, y), patch in zip(whole, run(target, whole)[..., :4], strict=True):
        reference[v, y:y + 16, x:x + 16] = patch
    sampler = PatchSampler(reference, [0, 1, 2, 3], size=16, seed=0)

    values = target.copy()
    values[:4] += np.array([3.0, -2.5, 2.0, -2.0], np.float32)  # moved and shrunk
    start_error = np.linalg.norm(values[:4] - target[:4])
    m, v = np.zeros_like(values), np.zeros_like(values)
    rate = np.array([0.3] * 4 + [0.0] * 4, np.float32)  # geometry only: appearance stays at the target
    for step in range(1, 31):
        rows = sampler.sample(4)
        sums = run(values, rows)
        _loss, _terms, d_rgba = patch_loss_and_gradient(sums[..., :4], sampler.reference_patches(rows))
        gradient = np.zeros_like(sums)
        gradient[..., :4] = d_rgba
        g = run(values, rows, gradient)
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        values -= rate * (m / (1 - 0.9**step)) / (np.sqrt(v / (1 - 0.999**step)) + 1e-8)
    error = np.linalg.norm(values[:4] - target[:4])
    assert error < start_error / 4, f"{start_error:.2f} mm -> {error:.2f} mm"


def test_a_band_that_lists_more_shaded_segments_than_it_has_room_for_renders_again(gpu):
    """A rendered view's host does not wait for its bands' list counts: a band that listed more shaded segments
    than it had made room for is found when the frame is read, and the view renders again with room for all."""
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 12, 10)
    renderer, _scene = sphere_renderer(gpu, SPHERES)
    expected = renderer.render(camera)
    batch = renderer._batch
    assert batch.lists.shaded > 1
    assert batch.lists.sampled > camera.width * camera.height  # a thread a ray took several entries in turn
    batch.surface_words = 0
    batch.reserve_surfaces(1)  # room for one shaded segment
    image = renderer.render(camera)
    np.testing.assert_array_equal(image.rgba, expected.rgba)
    np.testing.assert_array_equal(image.normal, expected.normal)
    assert renderer._batch is batch and batch.surface_capacity >= batch.lists.shaded


def test_a_view_of_as_many_pixels_in_more_rows_keeps_each_bands_counts(gpu):
    """Each band's list counts are kept aside until the frame is read: a view of as many pixels as the last one
    but more rows, in more bands, renders as a fresh renderer renders it."""
    wide = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 12, 10)
    tall = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 4, 30)
    renderer, _scene = sphere_renderer(gpu, SPHERES)
    renderer.render(wide)
    fresh, _scene = sphere_renderer(gpu, SPHERES)
    np.testing.assert_array_equal(renderer.render(tall, rays_per_pass=4).rgba, fresh.render(tall, rays_per_pass=4).rgba)


def test_profiled_render_gives_the_same_picture_and_each_pass_time(gpu):
    renderer, _scene = sphere_renderer(gpu, SPHERES)
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 12, 10)
    plain = renderer.render(camera)
    timings: dict[str, float] = {}
    profiled = renderer.render(camera, timings=timings)
    np.testing.assert_array_equal(profiled.rgba, plain.rgba)
    assert list(timings) == ["place samples", "distances", "work lists", "normals and appearance", "composite",
                            "G-buffer", "read-back"]
    assert all(seconds > 0 for seconds in timings.values())


def _turned(degrees: float, width: int = 24, height: int = 20) -> Camera:
    """A camera 60 mm from the spheres' centre, turned ``degrees`` about the z axis from looking along +y."""
    angle = math.radians(degrees)
    return Camera((60.0 * math.sin(angle), -60.0 * math.cos(angle), 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0,
                  width, height)


def _recorded_allocations(monkeypatch) -> list[str]:
    """What the renderer and its sample buffers make on the device from now on (each buffer made)."""
    from NeuralRaycastLib.render import neural_render, sample_buffers

    made: list[str] = []
    for module in (neural_render, sample_buffers):
        original = module.device_memory

        def recorded(what: str, original=original):
            made.append(what)
            return original(what)

        monkeypatch.setattr(module, "device_memory", recorded)
    return made


def _recorded_passes(renderer, monkeypatch) -> list:
    """Each pass the renderer draws its next views in (its ``counted`` flag: False for a pass that reads no list
    count first, True for one drawn again, counted)."""
    passes: list = []
    original = renderer._render_frame

    def recorded(*args, **kwargs):
        passes.append(kwargs.get("counted"))
        return original(*args, **kwargs)

    monkeypatch.setattr(renderer, "_render_frame", recorded)
    return passes


def _recorded_count_reads(renderer, monkeypatch) -> list[bool]:
    """Whether each of the renderer's next bands read its slot count back before it was drawn."""
    reads: list[bool] = []
    original = renderer._reserve_tiles

    def recorded(batch, read=True):
        reads.append(read)
        return original(batch, read)

    monkeypatch.setattr(renderer, "_reserve_tiles", recorded)
    return reads


def test_views_turned_a_little_make_no_new_buffers_after_the_first(gpu, monkeypatch):
    """Once a view was rendered, the renderer holds the buffers a view of its size takes (at the most the views
    so far took, with room to spare): views turned a little from it, and it again, make no buffer and render
    their pictures in one pass each (none renders again for want of room), as a fresh renderer renders them; a view
    of another size in between leaves the sizes its own views took."""
    renderer, _scene = sphere_renderer(gpu, SPHERES, sphere_occupancy())
    renderer.render(_turned(0.0))
    made = _recorded_allocations(monkeypatch)
    passes = _recorded_passes(renderer, monkeypatch)
    views = [_turned(degrees) for degrees in (6.0, 12.0, -6.0, 0.0)]
    pictures = [renderer.render(camera) for camera in views]
    assert made == [] and passes == [False] * len(views), (made, passes)
    fresh, _scene = sphere_renderer(gpu, SPHERES, sphere_occupancy())
    np.testing.assert_array_equal(pictures[1].rgba, fresh.render(views[1]).rgba)
    sizes = (renderer._ray_bytes, renderer._slots_per_ray, renderer._shaded_per_slot)
    renderer.render(_turned(0.0, 12, 10))  # a smaller view, whose rays take more slots each, then this one again
    assert renderer._slots_per_ray > sizes[1]
    renderer.render(views[-1])
    assert (renderer._ray_bytes, renderer._slots_per_ray, renderer._shaded_per_slot) == sizes


def test_a_renderers_band_buffers_stay_within_the_budgets_share(gpu, monkeypatch):
    """Under a small GPU memory budget, views turned about the spheres grow the band buffers (the room to spare
    included) to no more than the budget's share for a band (up to the last tile row of slots), and the
    kept sizes never shrink from view to view."""
    from NeuralRaycastLib.gpu.memory_budget import MIB, SHARES, MemoryBudget

    small = MemoryBudget(2 * MIB, "--gpu-memory")
    monkeypatch.setattr(gpu, "memory", small)
    share = int(small.bytes * SHARES["band"])
    renderer, _scene = sphere_renderer(gpu, SPHERES, sphere_occupancy())
    structures, words = renderer.scene.structures, renderer.segment_words()
    kept = (0.0, 0.0, 0.0)
    for degrees in (0.0, 20.0, 40.0, 60.0, 80.0):
        renderer.render(_turned(degrees, 32, 24))
        batch = renderer._batch
        held = RayBatch.band_bytes(batch.capacity, batch.slot_capacity, batch.surface_capacity, structures, words)
        assert held <= share + 32 * RayBatch.slot_bytes(structures), (degrees, held, share)
        sizes = (renderer._ray_bytes, renderer._slots_per_ray, renderer._shaded_per_slot)
        assert all(now >= before for now, before in zip(sizes, kept, strict=True))
        kept = sizes


def test_a_view_of_a_size_drawn_before_is_drawn_without_waiting_for_its_count(gpu, monkeypatch):
    """A view of a size drawn before is drawn on the room its views took without reading its slot count back
    first (the host waits once, for the frame), in one pass, to the picture a fresh renderer draws."""
    renderer, _scene = sphere_renderer(gpu, SPHERES, sphere_occupancy())
    renderer.render(_turned(0.0))
    reads = _recorded_count_reads(renderer, monkeypatch)
    picture = renderer.render(_turned(6.0))
    assert reads and not any(reads), reads
    assert all(slots is not None and slots > 0 for _rays, slots, _need in renderer.band_work)
    fresh, _scene = sphere_renderer(gpu, SPHERES, sphere_occupancy())
    np.testing.assert_array_equal(picture.rgba, fresh.render(_turned(6.0)).rgba)


def test_a_view_whose_samples_outgrow_the_kept_room_is_drawn_again_counted(gpu, monkeypatch):
    """A view of a size drawn before whose rays take more slots than the room its views left (a closer view)
    leaves those rays empty on its first pass, then is drawn again, counted, to a fresh renderer's picture; the
    next such view fits."""
    renderer, _scene = sphere_renderer(gpu, SPHERES, sphere_occupancy())
    far = Camera((0.0, -90.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 32, 24)
    near = Camera((0.0, -40.0, 5.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 32, 24)
    renderer.render(far)
    passes = _recorded_passes(renderer, monkeypatch)
    picture = renderer.render(near)
    assert passes == [False, True], passes
    fresh, _scene = sphere_renderer(gpu, SPHERES, sphere_occupancy())
    expected = fresh.render(near)
    assert expected.rgba[..., 3].max() > 0.5
    np.testing.assert_array_equal(picture.rgba, expected.rgba)
    passes.clear()
    np.testing.assert_array_equal(renderer.render(near).rgba, expected.rgba)
    assert passes == [False], passes


def test_a_batch_made_for_more_rays_keeps_the_room_the_smaller_one_made(gpu):
    """A renderer that needs a batch for more rays (a view after training's patches) moves the smaller batch's
    slot and segment buffers into it rather than making them again beside the rays' (the device's allocator
    keeps the pages of buffers let go), and its pictures are a fresh renderer's."""
    renderer, _scene = sphere_renderer(gpu, SPHERES, sphere_occupancy())
    small = renderer.batch(64)
    small.reserve_slots(40_000)
    small.reserve_surfaces(9_000)
    distances, surface = small.distances, small.surface
    camera = _turned(0.0, 32, 24)
    larger = renderer.batch(camera.width * camera.height)
    assert larger is not small and larger.capacity >= camera.width * camera.height
    assert larger.distances is distances and larger.surface is surface and larger.slot_capacity >= 40_000
    assert larger.struct["distances"] == address(distances)
    assert larger.struct["slotCapacity"] == larger.slot_capacity and small.distances is None
    fresh, _scene = sphere_renderer(gpu, SPHERES, sphere_occupancy())
    np.testing.assert_array_equal(renderer.render(camera).rgba, fresh.render(camera).rgba)


def test_a_batchs_slot_arrays_share_one_buffer_without_overlapping(gpu):
    """The arrays sized by slots lie in one buffer (the device's heap would round each large one up to a page of
    its own), each in its own 128-byte aligned range, and the shaders are pointed at each."""
    renderer, _scene = sphere_renderer(gpu, SPHERES)
    batch = renderer.batch(64)
    batch.reserve_slots(5_000)
    arrays = batch.slot_arrays(batch.slot_capacity)
    ranges = sorted((address(getattr(batch, name)), address(getattr(batch, name)) + 4 * length)
                    for name, length, _dtype in arrays)
    base = batch._slot_room.storage.device_address
    assert ranges[0][0] == base and ranges[-1][1] <= base + batch._slot_room.storage.size
    assert all(end <= start for (_s, end), (start, _e) in zip(ranges, ranges[1:], strict=False))
    assert all((start - base) % 128 == 0 for start, _end in ranges)
    for name, field in RayBatch.ROOM_ADDRESSES.items():
        if name != "surface":
            assert batch.struct[field] == address(getattr(batch, name)), name
    assert batch.distances.shape[0] == batch.slot_capacity * renderer.scene.structures


def test_view_sizes_forgotten_are_learned_again_from_the_next_view(gpu, monkeypatch):
    """After forget_view_sizes (the occupancy changed much: training's cells to the pictures'), the next view
    reads its bands' counts again and the renderer learns the same sizes its views took before."""
    renderer, _scene = sphere_renderer(gpu, SPHERES, sphere_occupancy())
    renderer.render(_turned(0.0))
    learned = (renderer._ray_bytes, renderer._slots_per_ray, renderer._shaded_per_slot)
    renderer.forget_view_sizes()
    assert renderer._slots_per_ray is None and not renderer._sizes_by_view
    reads = _recorded_count_reads(renderer, monkeypatch)
    renderer.render(_turned(0.0))
    assert reads and all(reads), reads
    assert (renderer._ray_bytes, renderer._slots_per_ray, renderer._shaded_per_slot) == learned
