"""The Gaussian scene's Slang code (shaders/gaussians.slang) against a float64 numpy reference.

A tiny scene (a few anisotropic Gaussians, one partly outside the box and one far outside it, a grid of a
few cells) and a few rays: the grid's lists, the integrated colours with and without early termination, a
camera's picture, and the hand-written backward pass against central differences of the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from field_reference import central_difference
from gaussian_reference import render, render_sums, rotations, unpack

from NeuralRaycastLib.gaussians.look import (
    LOOK_FLOATS,
    MODULATION,
    OFFSET,
    SPECULAR,
    ChannelVolumes,
    Highlights,
    texture_factors,
)
from NeuralRaycastLib.gaussians.scene import OUTPUTS, GaussianScene, GaussianSet, GridShape, MarchSettings
from NeuralRaycastLib.grid import sample_at
from NeuralRaycastLib.render.camera import Camera

pytestmark = pytest.mark.gpu

BOX = np.array([[0.0, 0.0, 0.0], [10.0, 8.0, 12.0]])
DENSITY = 0.8
STEP = 0.25
RAYS = 12
CHUNK = 4  # the samples of a cell the march sums at a time (shaders/gaussian_march.slang's GAUSSIAN_CHUNK)


def tiny_set() -> GaussianSet:
    rng = np.random.default_rng(0)
    n = 7
    positions = rng.uniform(2.0, 8.0, (n, 3))
    positions[5] = (9.5, 4.0, 6.0)  # its box pokes out of the scene's
    positions[6] = (40.0, 40.0, 40.0)  # never seen
    return GaussianSet(positions, np.log(rng.uniform(0.6, 1.6, (n, 3))), rng.normal(size=(n, 4)),
                       rng.normal(0.0, 1.0, n), rng.normal(0.0, 1.0, (n, 6, 3)))


@pytest.fixture(scope="module")
def scene(gpu) -> GaussianScene:
    grid = GridShape.for_box(BOX, 2.5)
    return GaussianScene(gpu, tiny_set(), grid, density_scale=DENSITY, march=MarchSettings(STEP, 1e-4))


@pytest.fixture(scope="module")
def rays() -> np.ndarray:
    rng = np.random.default_rng(1)
    origins = rng.uniform(-6.0, 18.0, (RAYS, 3))
    directions = rng.uniform(3.0, 7.0, (RAYS, 3)) - origins
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    return np.concatenate([origins, directions], axis=1).astype(np.float32).astype(np.float64)


def device_render(scene: GaussianScene, rays: np.ndarray):
    uploaded = scene.upload_rays(rays[:, :3], rays[:, 3:])
    results = scene.render_rays(uploaded, len(rays))
    return uploaded, results, np.asarray(results.to_numpy(), np.float64).reshape(-1, OUTPUTS)[:, :4]


def reference(scene: GaussianScene, values: np.ndarray, rays: np.ndarray, min_transmittance: float,
              look=(None, None)) -> np.ndarray:
    grid = scene.grid
    return render(values, scene.count, scene.density_scale, rays, grid.low, grid.high, STEP, min_transmittance,
                  *look)


#: Two channels on a grid of 1.2 × 1.0 × 1.4 mm voxels over the scene's box and a little past it.
TEXTURE_AFFINE = np.array([[1.2, 0, 0, -0.5], [0, 1.0, 0, -0.5], [0, 0, 1.4, -0.5], [0, 0, 0, 1]])


@pytest.fixture(scope="module")
def looked(gpu):
    """The tiny scene with its structures' look: colours textured by two channels of noise, each Gaussian by one
    of them through its own window and modulation, and a specular term of its own weight; one Gaussian with
    neither (a record of zeros). Returns the scene and the reference's texture and highlight functions."""
    rng = np.random.default_rng(5)
    gaussians = tiny_set()
    n = gaussians.count
    records = np.zeros((n, LOOK_FLOATS), np.float32)
    records[np.arange(n), rng.integers(0, 2, n)] = rng.uniform(0.8, 2.0, n)  # the channel over the window's width
    records[:, OFFSET] = rng.uniform(-0.2, 0.4, n)  # the window's low end over its width
    records[:, MODULATION] = rng.uniform(0.4, 0.9, n)
    records[:, SPECULAR] = rng.uniform(0.5, 1.5, n)  # the specular weight
    records[3] = 0.0
    gaussians.looks = records
    channels = rng.uniform(0.0, 1.0, (2, 10, 10, 10)).astype(np.float32)
    key = np.array([0.45, 0.35, 0.82]) / np.linalg.norm([0.45, 0.35, 0.82])
    highlights = Highlights(tuple(key), 6.0)
    scene = GaussianScene(gpu, gaussians, GridShape.for_box(BOX, 2.5), density_scale=DENSITY,
                          march=MarchSettings(STEP, 1e-4), channels=ChannelVolumes(gpu, channels, TEXTURE_AFFINE),
                          highlights=highlights)

    def texture(x: np.ndarray) -> np.ndarray:
        values = np.zeros(4)
        values[:2] = sample_at(channels.astype(np.float64), TEXTURE_AFFINE, x[None])[:, 0]
        return texture_factors(records, values)

    return scene, (texture, lambda axes, d: highlights.specular(records, axes, d))


def test_grid_lists_each_gaussian_in_every_cell_its_box_overlaps(scene):
    gaussians = scene.gaussians()
    low, high = gaussians.positions - gaussians.half_extents(), gaussians.positions + gaussians.half_extents()
    grid = scene.grid
    assert grid.dims == (4, 4, 5)
    lists = scene.cell_lists()
    size = grid.cell_size
    for cell, listed in enumerate(lists):
        nx, ny, _ = grid.dims
        index = np.array([cell % nx, cell // nx % ny, cell // (nx * ny)])
        cell_low = np.asarray(grid.low) + index * size
        overlaps = np.flatnonzero(((low < cell_low + size) & (high >= cell_low)).all(axis=1))
        np.testing.assert_array_equal(listed, overlaps, err_msg=f"cell {index}")
    assert not any(6 in listed for listed in lists)
    assert any(5 in listed for listed in lists)


def test_rays_integrate_the_gaussians_as_the_float64_reference(scene, rays):
    _, _, values = device_render(scene, rays)
    expected = reference(scene, scene.parameters().astype(np.float64), rays, 1e-4)
    assert (expected[:, 3] > 0.2).sum() >= RAYS // 2, "the rays should see the Gaussians"
    np.testing.assert_allclose(values, expected, rtol=2e-5, atol=2e-6)


def test_the_look_textures_each_sample_and_adds_the_highlights_as_the_reference(looked, rays):
    """Each Gaussian's colour takes its texture factor from the channels at every sample (trilinear), through its
    own window, and its specular term from its axis: the device's pictures are the reference's, and neither the
    texture nor the highlights are without effect."""
    scene, (texture, highlight) = looked
    assert scene.textured
    _, _, values = device_render(scene, rays)
    params = scene.parameters().astype(np.float64)
    expected = reference(scene, params, rays, 1e-4, (texture, highlight))
    np.testing.assert_allclose(values, expected, rtol=2e-5, atol=2e-6)
    for part in ((None, highlight), (texture, None)):
        without = reference(scene, params, rays, 1e-4, part)
        assert np.abs(without[:, :3] - expected[:, :3]).max() > 0.05
        np.testing.assert_allclose(without[:, 3], expected[:, 3], rtol=1e-12)  # the look leaves the opacity alone


def test_backward_pass_with_the_look_matches_central_differences(looked, rays):
    """With the texture and the highlights, every kind of parameter's gradient against central differences of the
    reference: the texture scales each sample's colour gradient, and the specular term's moves the axis."""
    scene, look = looked
    uploaded, results, _ = device_render(scene, rays)
    weights = np.random.default_rng(7).normal(size=(RAYS, 4))
    scene.zero_gradients()
    scene.backward_rays(uploaded, RAYS, results, weights)
    gradient = scene.gradients().astype(np.float64)

    def loss(p: np.ndarray) -> float:
        return float((reference(scene, p, rays, 1e-4, look) * weights).sum())

    assert_central_differences(loss, scene.parameters().astype(np.float64), gradient, np.random.default_rng(8),
                               largest=24)


def test_rays_stop_once_nearly_opaque(gpu, rays):
    """Dense Gaussians: the march stops where the transmittance falls below its threshold, as the reference
    does (and then gives other colours than a march to the end of the box)."""
    dense = tiny_set()
    dense.density[:] = 4.0
    scene = GaussianScene(gpu, dense, GridShape.for_box(BOX, 2.5), density_scale=4.0, march=MarchSettings(STEP, 0.2))
    _, _, values = device_render(scene, rays)
    stopping = reference(scene, scene.parameters().astype(np.float64), rays, 0.2)
    to_the_end = reference(scene, scene.parameters().astype(np.float64), rays, 0.0)
    np.testing.assert_allclose(values, stopping, rtol=2e-5, atol=2e-6)
    stopped = np.abs(stopping - to_the_end).max(axis=1) > 1e-3
    assert stopped.sum() >= 3
    assert (stopping[stopped, 3] > 0.8).all()


def test_camera_picture_is_the_rays_through_its_pixels(scene):
    camera = Camera((5.0, -30.0, 6.0), (5.0, 4.0, 6.0), (0.0, 0.0, 1.0), 30.0, 20, 14)
    picture = scene.render(camera)
    directions = camera.ray_directions().reshape(-1, 3)
    rays = np.concatenate([np.broadcast_to(camera.position, directions.shape), directions], axis=1)
    _, _, values = device_render(scene, rays.astype(np.float32).astype(np.float64))
    assert picture[..., 3].max() > 0.3
    np.testing.assert_allclose(picture.reshape(-1, 4), values, atol=1e-5)
    # the live view's picture: straight-alpha bytes, rows from the bottom, packed on the device
    alpha = picture[..., 3:4]
    straight = np.where(alpha > 1e-6, picture[..., :3] / np.maximum(alpha, 1e-6), 0.0)
    expected = np.round(np.clip(np.concatenate([straight, alpha], axis=-1), 0, 1) * 255)[::-1]
    packed = scene.render_picture(camera)
    assert packed.shape == (14, 20, 4) and packed.dtype == np.uint8
    np.testing.assert_allclose(packed, expected, atol=1)


def test_picture_has_the_expected_depth_and_the_density_normals(scene):
    """A run's pictures carry a G-buffer as the field's do: depth is Σ weight·t / alpha along the ray, and the
    normal the unit -∇σ (turned towards the viewer) averaged by the same weights, here against central
    differences of the float64 density."""
    camera = Camera((5.0, -30.0, 6.0), (5.0, 4.0, 6.0), (0.0, 0.0, 1.0), 16.0, 10, 8)
    image = scene.render_image(camera)
    directions = camera.ray_directions().reshape(-1, 3)
    rays = np.concatenate([np.broadcast_to(camera.position, directions.shape), directions], axis=1)
    grid = scene.grid
    sums = render_sums(scene.parameters().astype(np.float64), scene.count, scene.density_scale,
                       rays.astype(np.float32).astype(np.float64), grid.low, grid.high, STEP, 1e-4, normals=True)
    alpha = sums[:, 3]
    seen = alpha > 0.05
    assert seen.sum() >= 20 and (~seen).sum() >= 1
    np.testing.assert_allclose(image.rgba.reshape(-1, 4), sums[:, :4], atol=1e-5)
    depth = image.depth.reshape(-1)
    np.testing.assert_allclose(depth[seen], sums[seen, 7] / alpha[seen], rtol=1e-4)
    assert (depth[alpha < 1e-6] == 0).all()
    distance = np.linalg.norm(np.asarray(scene.gaussians().positions[:5]) - camera.position, axis=1)
    assert distance.min() - 10 < depth[seen].min() and depth[seen].max() < distance.max() + 10
    expected = sums[:, 4:7] / np.maximum(np.linalg.norm(sums[:, 4:7], axis=1, keepdims=True), 1e-12)
    normal = image.normal.reshape(-1, 3)
    np.testing.assert_allclose(normal[seen], expected[seen], atol=2e-3)
    np.testing.assert_allclose(np.linalg.norm(normal[seen], axis=1), 1.0, atol=1e-4)
    assert (normal[seen] @ np.asarray(camera.basis()[2]) < 0).mean() > 0.9  # facing the camera
    # training's forward leaves the normals out (it compares colours)
    assert not scene.render_sums(camera)[..., 4:7].any()


def assert_central_differences(loss, params: np.ndarray, gradient: np.ndarray, rng: np.random.Generator,
                               largest: int) -> None:
    """``gradient`` of ``loss`` at ``params`` against central differences along three random directions and on
    its ``largest`` coordinates."""
    scale = np.abs(gradient).max()
    directions = rng.normal(size=(3, params.size))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    numeric = central_difference(loss, params, directions, 1e-6)
    np.testing.assert_allclose(directions @ gradient, numeric, rtol=2e-3, atol=2e-4 * scale)
    coordinates = np.argsort(-np.abs(gradient))[:largest]
    numeric = central_difference(loss, params, np.eye(params.size)[coordinates], 1e-6)
    np.testing.assert_allclose(gradient[coordinates], numeric, rtol=2e-3, atol=2e-4 * scale)


def test_backward_pass_matches_central_differences(scene, rays):
    """∂(Σ w·rgba)/∂parameters for every kind of parameter, along random directions and on the largest
    coordinates; the Gaussian no ray reaches gets none. A ray's samples in one cell make more than one chunk
    (the march sums them a chunk at a time), so chunks within a cell are covered too."""
    assert scene.grid.cell_size.max() / STEP > CHUNK
    uploaded, results, _ = device_render(scene, rays)
    weights = np.random.default_rng(2).normal(size=(RAYS, 4))
    scene.zero_gradients()
    scene.backward_rays(uploaded, RAYS, results, weights)
    gradient = scene.gradients().astype(np.float64)
    params = scene.parameters().astype(np.float64)

    def loss(p: np.ndarray) -> float:
        return float((reference(scene, p, rays, 1e-4) * weights).sum())

    n = scene.count
    scale = np.abs(gradient).max()
    for kind, (first, last) in {"position": (0, 3), "log-scale": (3, 6), "rotation": (6, 10), "density": (10, 11),
                                "colour": (11, 29)}.items():
        assert np.abs(gradient[first * n : last * n]).max() > 1e-3 * scale, f"no {kind} gradient"
    assert_central_differences(loss, params, gradient, np.random.default_rng(3), largest=24)
    unseen = 6
    own = np.concatenate([3 * unseen + np.arange(3), 3 * n + 3 * unseen + np.arange(3),
                          6 * n + 4 * unseen + np.arange(4), [10 * n + unseen], 11 * n + 18 * unseen + np.arange(18)])
    assert not gradient[own].any()


def test_backward_pass_taking_the_rays_in_groups_gives_the_same_gradients(scene, rays):
    """A training batch's backward pass takes its patches' rays in turn (neighbouring threads, different patches);
    the gradients are those of the rays taken in order, and a count that groups do not divide is refused."""
    uploaded, results, _ = device_render(scene, rays)
    weights = np.random.default_rng(4).normal(size=(RAYS, 4))
    gradients = []
    for groups in (1, 3, 4):
        scene.zero_gradients()
        scene.backward_rays(uploaded, RAYS, results, weights, groups)
        gradients.append(scene.gradients().astype(np.float64))
    assert np.abs(gradients[0]).max() > 0
    for other in gradients[1:]:
        np.testing.assert_allclose(other, gradients[0], rtol=1e-4, atol=1e-6 * np.abs(gradients[0]).max())
    with pytest.raises(ValueError, match="groups"):
        scene.backward_rays(uploaded, RAYS, results, weights, 5)


def test_training_step_on_the_device_matches_the_host_loss(gpu, scene):
    """A training step's loss, its gradient and densification's statistics computed on the device (patch rays,
    DeviceImageLoss, the backward pass fed from its ∂/∂sums) are the host's: the float64 loss of the same
    pictures, the backward pass given the host's gradient, and the norms of the position gradients."""
    from types import SimpleNamespace

    from NeuralRaycastLib.gaussians.train import GaussianStep, GaussianTrainConfig
    from NeuralRaycastLib.render.image_loss import patch_loss_and_gradient

    cameras = [Camera((5.0, -30.0, 6.0), (5.0, 4.0, 6.0), (0.0, 0.0, 1.0), 22.0, 32, 24),
               Camera((-25.0, 4.0, 9.0), (5.0, 4.0, 6.0), (0.0, 0.0, 1.0), 22.0, 30, 20)]
    rows = np.array([[0, 8, 4], [1, 3, 2], [0, 12, 7]], np.int32)
    size = 16
    step = GaussianStep(gpu, scene, SimpleNamespace(cameras=cameras), GaussianTrainConfig(patches=3, patch_size=size))
    reference = np.random.default_rng(4).uniform(0.0, 1.0, (3, size, size, 8)).astype(np.float32)
    scene.zero_gradients()
    loss = step.loss_and_gradients(rows, reference)
    step.accumulate_statistics()
    device_gradient = scene.gradients().astype(np.float64)

    # the same rays from the host's cameras, rendered and scored on the host
    rays = []
    for view, x0, y0 in rows:
        directions = cameras[view].ray_directions()[y0 : y0 + size, x0 : x0 + size].reshape(-1, 3)
        rays.append(np.concatenate([np.broadcast_to(cameras[view].position, directions.shape), directions], axis=1))
    rays = np.concatenate(rays)
    uploaded, results, rendered = device_render(scene, rays)
    sums = np.asarray(step.batch.sums.to_numpy()).reshape(-1, OUTPUTS)
    np.testing.assert_allclose(sums[:, :4], rendered, atol=2e-5)
    assert rendered[:, 3].max() > 0.3, "the patches should see the Gaussians"
    host_loss, _, d_rendered = patch_loss_and_gradient(rendered.reshape(3, size, size, 4), reference[..., :4])
    assert loss == pytest.approx(host_loss, rel=1e-4)
    scene.zero_gradients()
    scene.backward_rays(uploaded, len(rays), results, d_rendered.reshape(-1, 4))
    host_gradient = scene.gradients().astype(np.float64)
    assert np.abs(host_gradient).max() > 0
    np.testing.assert_allclose(device_gradient, host_gradient, rtol=1e-3, atol=1e-4 * np.abs(host_gradient).max())

    norms, seen = step.statistics()
    expected = np.linalg.norm(device_gradient[: 3 * scene.count].reshape(-1, 3), axis=1)
    np.testing.assert_allclose(norms, expected, rtol=1e-5)
    np.testing.assert_array_equal(seen, expected > 0)
    assert seen[6] == 0 and seen.sum() >= 3  # the Gaussian no ray reaches has none
    scene.zero_gradients()


LAYER_BOX = np.array([[-14.0, -14.0, -4.0], [14.0, 14.0, 4.0]])


def flat_layer(gpu, width: float, thickness: float, depth: float, half: int = 12) -> GaussianScene:
    """A layer of flat Gaussians on z = 0, one per mm² (a lattice of 2 half + 1 a side), of optical depth
    ``depth`` across."""
    lattice = np.arange(-half, half + 1)
    xy = np.stack(np.meshgrid(lattice, lattice), axis=-1).reshape(-1, 2).astype(np.float64)
    n = len(xy)
    w = depth / ((2 * np.pi) ** 1.5 * width**2 * thickness)
    gaussians = GaussianSet(np.concatenate([xy, np.zeros((n, 1))], axis=1),
                            np.log(np.tile([width, width, thickness], (n, 1))), np.tile([1.0, 0.0, 0.0, 0.0], (n, 1)),
                            np.full(n, np.log(w / (1 - w))), np.zeros((n, 6, 3)))
    return GaussianScene(gpu, gaussians, GridShape.for_box(LAYER_BOX, 2.0), density_scale=1.0,
                         march=MarchSettings(STEP, 1e-4))


def rays_through_the_origin(degrees: list[float]) -> np.ndarray:
    angles = np.radians(degrees)
    directions = np.stack([np.zeros(len(angles)), np.sin(angles), np.cos(angles)], axis=1)
    return np.concatenate([-3.0 * directions, directions], axis=1).astype(np.float32).astype(np.float64)


def test_a_layer_of_flat_gaussians_is_as_opaque_from_every_angle(gpu):
    """A layer of flat Gaussians stands for a surface, which the reference views give the same optical depth
    at every crossing: rays through it head-on, at 30° and at 60° see the same alpha (a plain volume density
    would double the optical depth at 60°, and a picture's silhouettes would glare), as the float64 reference."""
    depth = 0.4
    scene = flat_layer(gpu, 1.0, 0.3, depth)
    rays = rays_through_the_origin([0.0, 30.0, 60.0])
    _, _, values = device_render(scene, rays)
    np.testing.assert_allclose(values, reference(scene, scene.parameters().astype(np.float64), rays, 1e-4),
                               rtol=2e-5, atol=2e-6)
    # the intended optical depth, less the truncated Gaussians' share (about a tenth)
    assert 1.0 - np.exp(-0.85 * depth) < values[0, 3] < 1.0 - np.exp(-depth)
    np.testing.assert_allclose(values[:, 3], values[0, 3], rtol=2e-3)


#: More Gaussians around one sample than a warp has lanes: a dense layer.
DENSE = 32


def test_backward_pass_where_a_ray_is_inside_many_gaussians_at_once(gpu):
    """The backward pass sums each Gaussian's share of a ray's gradient over a chunk of samples before adding it
    to the parameters' gradients (shaders/gaussians.slang). Rays through a layer of wide, overlapping, differently
    coloured Gaussians (dozens of them around a sample, each holding several samples of a chunk and reaching
    over several cells and chunks) get the gradients of central differences all the same."""
    scene = flat_layer(gpu, 1.6, 0.4, 1.5, half=8)
    rng = np.random.default_rng(5)
    gaussians = scene.gaussians()
    n = gaussians.count
    gaussians.positions[:, 2] += rng.normal(0.0, 0.1, n)
    gaussians.rotations += rng.normal(0.0, 0.1, (n, 4))
    gaussians.density += rng.normal(0.0, 0.5, n)
    gaussians.colours[:] = rng.normal(0.0, 1.0, (n, 6, 3))
    scene.set_gaussians(gaussians)
    rays = rays_through_the_origin([0.0, 30.0, 60.0])
    rays[:, :2] += rng.uniform(-0.5, 0.5, (3, 2))
    params = scene.parameters().astype(np.float64)
    # around some sample, the ray is inside dozens of Gaussians
    position, log_scale, quaternion, _, _ = unpack(params, n)
    rotation = rotations(quaternion)
    points = rays[:, None, :3] + np.arange(-2.0, 2.0, STEP)[None, :, None] * rays[:, None, 3:]
    local = np.einsum("nab,rsna->rsnb", rotation, points[:, :, None, :] - position) / np.exp(log_scale)
    assert ((local**2).sum(axis=-1) < 9.0).sum(axis=-1).max() > DENSE

    uploaded, results, _ = device_render(scene, rays)
    weights = rng.normal(size=(3, 4))
    scene.zero_gradients()
    scene.backward_rays(uploaded, 3, results, weights)
    gradient = scene.gradients().astype(np.float64)

    def loss(p: np.ndarray) -> float:
        return float((reference(scene, p, rays, 1e-4) * weights).sum())

    assert_central_differences(loss, params, gradient, rng, largest=8)
