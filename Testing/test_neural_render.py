"""The differentiable renderer: the whole ray integral's gradient against finite differences, and its
forward pass against the reference renderer (one image formation model)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import analytic_prepared

from NeuralRaycastLib.camera import Camera
from NeuralRaycastLib.render import ReferenceRenderer
from NeuralRaycastLib.sample.phantom import sphere_sdf
from NeuralRaycastLib.structures import Structure
from NeuralRaycastLib.style import Lighting, RenderStyle, StructureStyle

#: two overlapping spheres: centre, radius, albedo, specular
SPHERES = np.array([[0, 0, 0, 10, 0.8, 0.3, 0.2, 0.3], [4, -9, 3, 5, 0.2, 0.7, 0.4, 0.1]], np.float32)
STRUCTURES = [Structure("a", (1,), (1.0, 0.0, 0.0)), Structure("b", (2,), (0.0, 1.0, 0.0))]
BOX = ((-20.0, -20.0, -20.0), (20.0, 20.0, 20.0))


@pytest.fixture(scope="module")
def spheres(gpu):
    import slangpy as spy

    module = gpu.load_module("sphere_scene")
    style = RenderStyle({"a": StructureStyle(0.6), "b": StructureStyle(0.8)}, Lighting())
    settings = {"epsilon": 1.0, "step": 0.5, "shadowStep": 1.0,
                "boxMin": spy.float3(*BOX[0]), "boxMax": spy.float3(*BOX[1])}
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 6, 5)
    common = (camera.to_shader(), style.shader_look(STRUCTURES, ["t1"]), style.shader_lighting(), settings)

    def scene(values: np.ndarray):
        values_t = spy.Tensor.from_numpy(gpu.device, np.asarray(values, np.float32).ravel())
        grads_t = spy.Tensor.zeros_like(values_t)
        struct = {"params": {"values": values_t.storage.device_address, "grads": grads_t.storage.device_address},
                  "count": len(values) // 8}
        return struct, (values_t, grads_t)

    def sums(values: np.ndarray) -> np.ndarray:
        struct, _alive = scene(values)
        return module.sphereSums(spy.grid((camera.height, camera.width)), struct, *common, _result="numpy")

    def backward(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
        struct, (_values, grads) = scene(values)
        weights_t = spy.Tensor.from_numpy(gpu.device, weights.astype(np.float32).ravel())
        module.sphereBackward(spy.grid((camera.height, camera.width)), struct, *common,
                              weights_t.storage.device_address)
        return grads.to_numpy()

    return sums, backward, camera, style, settings


def test_ray_integral_gradient_matches_finite_differences(spheres):
    """L = Σ W · (colour, opacity, normal, depth sums) over a small image; every parameter checked."""
    sums, backward, camera, _style, _settings = spheres
    values = SPHERES.ravel().astype(np.float64)
    weights = np.random.default_rng(0).normal(size=(camera.height, camera.width, 8))
    analytic = backward(values, weights)
    numeric = np.zeros_like(values)
    h = 1e-2
    for i in range(len(values)):
        plus, minus = values.copy(), values.copy()
        plus[i] += h
        minus[i] -= h
        numeric[i] = ((weights * sums(plus)).sum() - (weights * sums(minus)).sum()) / (2 * h)
    assert np.abs(numeric).max() > 1.0  # the loss depends on the parameters
    np.testing.assert_allclose(analytic, numeric, rtol=2e-2, atol=2e-2 * np.abs(numeric).max())


def test_forward_pass_matches_the_reference_renderer(spheres, gpu):
    """Rendering the same spheres through the boundary-map renderer gives the same picture."""
    sums, _backward, _camera, style, settings = spheres
    camera = Camera((0.0, -60.0, 10.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, 32, 24)
    prepared = analytic_prepared(
        {"a": lambda p: sphere_sdf(p, SPHERES[0, :3], SPHERES[0, 3]),
         "b": lambda p: sphere_sdf(p, SPHERES[1, :3], SPHERES[1, 3])},
        0.5, *BOX,
    )
    # flat albedo from the scene's colours: no channel modulation in the reference
    reference_style = RenderStyle(
        {name: StructureStyle(opacity, channel=None, modulation=0.0, specular=float(SPHERES[k, 7]),
                              color=tuple(SPHERES[k, 4:7]))
         for k, (name, opacity) in enumerate((("a", 0.6), ("b", 0.8)))},
        style.lighting, epsilon_voxels=2.0, step_voxels=1.0,
    )
    reference = ReferenceRenderer(gpu, prepared, reference_style).render(camera)

    import slangpy as spy

    from NeuralRaycastLib.render import unpack_pixels

    module = gpu.load_module("sphere_scene")
    values = spy.Tensor.from_numpy(gpu.device, SPHERES.ravel())
    grads = spy.Tensor.zeros_like(values)
    scene = {"params": {"values": values.storage.device_address, "grads": grads.storage.device_address}, "count": 2}
    neural = unpack_pixels(
        module.sphereRender(spy.grid((camera.height, camera.width)), scene, camera.to_shader(),
                            style.shader_look(STRUCTURES, ["t1"]), style.shader_lighting(), settings,
                            _result="tensor"),
        camera.height, camera.width,
    )
    assert reference.rgba[..., 3].max() > 0.5
    np.testing.assert_allclose(neural.rgba, reference.rgba, atol=0.005)
    hit = reference.rgba[..., 3] > 0.5
    np.testing.assert_allclose(neural.depth[hit], reference.depth[hit], atol=0.1)


def test_inverse_rendering_recovers_a_sphere_from_image_patches(spheres, gpu):
    """Patches + L1/DSSIM loss + the backward pass move a wrong sphere onto the right one."""
    import slangpy as spy

    from NeuralRaycastLib.camera import orbit_cameras
    from NeuralRaycastLib.image_loss import patch_loss_and_gradient
    from NeuralRaycastLib.patches import PatchSampler, pack_cameras

    _sums, _backward, _camera, style, settings = spheres
    module = gpu.load_module("sphere_scene")
    look, lighting = style.shader_look(STRUCTURES[:1], ["t1"]), style.shader_lighting()
    cameras = orbit_cameras(np.array(BOX) * 0.6, 4, 32, 32)
    cameras_t = spy.Tensor.from_numpy(gpu.device, pack_cameras(cameras).ravel())
    target = np.array([1.5, -1.0, 2.0, 8.0, 0.8, 0.3, 0.2, 0.3], np.float32)

    def run(values, rows, gradient=None):
        values_t = spy.Tensor.from_numpy(gpu.device, values.astype(np.float32))
        grads_t = spy.Tensor.zeros_like(values_t)
        rows_t = spy.Tensor.from_numpy(gpu.device, rows.astype(np.int32).ravel())
        scene = {"params": {"values": values_t.storage.device_address, "grads": grads_t.storage.device_address},
                 "count": 1}
        batch = {"cameras": cameras_t.storage.device_address, "patches": rows_t.storage.device_address, "size": 16}
        grid = spy.grid((len(rows), 16, 16))
        if gradient is None:
            return module.spherePatchSums(grid, scene, batch, look, lighting, settings, _result="numpy")
        gradient_t = spy.Tensor.from_numpy(gpu.device, gradient.astype(np.float32).ravel())
        module.spherePatchBackward(grid, scene, batch, look, lighting, settings, gradient_t.storage.device_address)
        return grads_t.to_numpy()

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
