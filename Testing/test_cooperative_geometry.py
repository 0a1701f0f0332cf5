"""The geometry network on tensor cores (CUDA) computes what the per-thread network computes.

The per-thread network's gradients are checked against finite differences (test_field_gradients.py); the
tensor-core path is checked against it on the same batch: loss, and the gradient of every parameter group.
Its operands are half precision, so agreement is to about 1e-2, not to float rounding. These tests need a
CUDA device and are skipped elsewhere (lavapipe has no cooperative matrices).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import phantom_prepared
from field_reference import tiny_config

from NeuralRaycastLib import field as field_module
from NeuralRaycastLib.field import FieldConfig, FieldLayout, NetworkConfig, NeuralField
from NeuralRaycastLib.fit import FitConfig, SdfFitter, band_errors
from NeuralRaycastLib.sample.phantom import voxel_centres

pytestmark = pytest.mark.gpu

SPACING = 2.0


@pytest.fixture(scope="module")
def cuda(gpu):
    if gpu.backend != "cuda":
        pytest.skip("needs CUDA (tensor cores through WMMA)")
    return gpu


@pytest.fixture(scope="module")
def phantom():
    """Four channels, as a BraTS study: with the default network the field's kernels are then those of the
    sample's standard preset, which `neuralraycast warmup` has compiled on the machine already (the
    tensor-core ones take minutes to compile)."""
    return phantom_prepared(SPACING, channel_count=4)


def paired_fields(gpu, prepared, config: FieldConfig, seed: int = 3):
    """Two fields with the same parameters: one per-thread, one on tensor cores."""
    layout = FieldLayout.build(config, prepared.bounds, len(prepared.structures), len(prepared.channel_names))
    scalar = NeuralField(gpu, layout, seed=seed, cooperative=False)
    cooperative = NeuralField(gpu, layout, seed=seed)
    assert cooperative.cooperative
    return scalar, cooperative


def config_for(full_network: bool) -> FieldConfig:
    """The small field of the other tests, or the default network sizes (32 → 64 → 64 → K + 15) on a small
    table; neither has layer sizes that are all multiples of the 16-wide tiles."""
    config = tiny_config(log2_table=14, coarsest_cells=8, finest_cell_mm=SPACING)
    if not full_network:
        return config
    return replace(config, encoding=replace(config.encoding, levels=16), network=NetworkConfig())


@pytest.mark.parametrize("full_network", [False, True])
def test_tensor_core_loss_and_gradients_match_the_per_thread_network(cuda, phantom, full_network):
    prepared = phantom[1]
    config = config_for(full_network)
    scalar, cooperative = paired_fields(cuda, prepared, config)
    fit = FitConfig(steps=1, batch=8192, seed=5)
    a, b = SdfFitter(cuda, prepared, scalar, fit), SdfFitter(cuda, prepared, cooperative, fit)
    loss_a, loss_b = a.loss(), b.loss()
    assert abs(loss_a - loss_b) <= 2e-2 * abs(loss_a)
    a.accumulate(0)
    b.accumulate(0)
    grads_a, grads_b = scalar.gradients(), cooperative.gradients()
    for name, (start, stop) in scalar.layout.segments().items():
        if name == "appearance":
            assert not grads_a[start:stop].any() and not grads_b[start:stop].any()
            continue
        ga, gb = grads_a[start:stop].astype(np.float64), grads_b[start:stop].astype(np.float64)
        cosine = ga @ gb / (np.linalg.norm(ga) * np.linalg.norm(gb))
        relative = np.linalg.norm(ga - gb) / np.linalg.norm(ga)
        print(f"{name}: cosine {cosine:.5f}, relative difference {relative:.4f}")
        assert cosine > 0.995 and relative < 0.1, name


def test_tensor_core_fit_reaches_the_phantom_surfaces(cuda, phantom):
    phantom, prepared = phantom
    layout = FieldLayout.build(config_for(full_network=True), prepared.bounds, len(prepared.structures),
                               len(prepared.channel_names))
    field = NeuralField(cuda, layout, seed=1)
    assert field.cooperative
    points = voxel_centres(prepared.affine, prepared.study.shape).reshape(-1, 3)
    exact = np.stack([phantom.sdf(name, points) for name in phantom.structure_names], axis=-1)
    near = np.abs(exact).min(axis=1) < 3 * SPACING
    result = SdfFitter(cuda, prepared, field, FitConfig(steps=400, batch=65536, seed=2)).run()
    errors = band_errors(field, points[near], exact[near], 3 * SPACING)
    print(f"tensor-core fit: {result.points_per_second / 1e6:.1f} M points/s; {errors}")
    assert errors["mean_abs_error_mm"] <= 0.5 * SPACING
    assert errors["mean_gradient_error"] <= 0.1


def test_cooperative_can_be_switched_off(cuda, monkeypatch, phantom):
    monkeypatch.setenv(field_module.COOPERATIVE_ENV, "0")
    layout = FieldLayout.build(tiny_config(), phantom[1].bounds, 4, 1)
    assert not NeuralField(cuda, layout).cooperative


def test_tensor_core_render_matches_the_per_thread_render(cuda, phantom):
    """The renderer's kernels over whole waves with the geometry network on tensor cores: the same picture
    as the per-thread kernels to half precision, and nearly the same gradients for the hash table and the
    appearance network; the geometry network gets none from the images on either path (field_scene.py).
    With the geometry frozen (stage 2) only the appearance network gets gradients, nearly the same too."""
    from NeuralRaycastLib.camera import orbit_cameras
    from NeuralRaycastLib.neural_render import OUTPUTS
    from NeuralRaycastLib.train import field_renderer

    prepared = phantom[1]
    scalar, cooperative = paired_fields(cuda, prepared, config_for(full_network=True))
    SdfFitter(cuda, prepared, scalar, FitConfig(steps=200, batch=1 << 15, seed=1)).run()
    cooperative.set_parameters(scalar.parameters())
    camera = orbit_cameras(prepared.bounds, 1, 48, 40)[0]
    d_sums = np.random.default_rng(4).normal(size=(camera.width * camera.height, OUTPUTS)).astype(np.float32)
    pictures, gradients, appearance = [], [], []
    for field in (scalar, cooperative):
        renderer = field_renderer(cuda, prepared, field, 192)
        assert renderer.scene.cooperative == field.cooperative
        batch = renderer.camera_rays(camera)
        renderer.forward(batch)
        pictures.append(renderer.sums(batch))
        field.zero_gradients()
        renderer.backward(batch, d_sums)
        gradients.append(field.gradients().astype(np.float64))
        field.zero_gradients()
        renderer.backward(batch, d_sums, geometry=False)
        appearance.append(field.gradients().astype(np.float64))
        field.zero_gradients()
    alpha = pictures[0][:, 3]
    assert alpha.max() > 0.5
    print(f"picture: max |difference| {np.abs(pictures[1][:, :4] - pictures[0][:, :4]).max():.4f}")
    np.testing.assert_allclose(pictures[1][:, :4], pictures[0][:, :4], atol=2e-2)
    for name, (start, stop) in scalar.layout.segments().items():
        ga, gb = gradients[0][start:stop], gradients[1][start:stop]
        if name == "geometry":
            assert not ga.any() and not gb.any()
            continue
        cosine = ga @ gb / (np.linalg.norm(ga) * np.linalg.norm(gb))
        print(f"render backward, {name}: cosine {cosine:.5f}")
        assert cosine > 0.99, name
    for name, (start, stop) in scalar.layout.segments().items():
        ga, gb = appearance[0][start:stop], appearance[1][start:stop]
        if name != "appearance":
            assert not ga.any() and not gb.any(), name
            continue
        cosine = ga @ gb / (np.linalg.norm(ga) * np.linalg.norm(gb))
        print(f"appearance-only backward: cosine {cosine:.5f}")
        assert cosine > 0.99
