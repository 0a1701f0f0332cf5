"""Gradient checks of the latent appearance's Slang code (shaders/latent_appearance.slang) against central
differences of a float64 numpy reference (latent_reference.py), as the field's are checked: the encoder, the
fp16 latent grid's trilinear lookup, the decoder and the two chained, for their values and their derivatives
with respect to the parameters, the grid's codes and their inputs; and the grid filled by the encoder over a
study's volumes holds the reference codes at its vertices, in fp16."""

from __future__ import annotations

import numpy as np
import pytest
from latent_reference import assert_gradient, assert_row_gradient, decoder, encoder, lookup

from NeuralRaycastLib.appearance.latent import BRICK, GridLayout, LatentAppearance, LatentConfig

pytestmark = pytest.mark.gpu

CONFIG = LatentConfig(inputs=2, latent=8, encoder_hidden=16, decoder_hidden=16, structures=4, materials=2)
BOX = np.array([[-4.0, 2.0, 1.0], [16.0, 26.0, 17.0]])
GRID = GridLayout.over(BOX, 4.0)
ROWS = 40
PARTS = ("latent_appearance", "latent_checks")


@pytest.fixture(scope="module")
def params() -> np.ndarray:
    """Weights as initialised plus noise on the biases too, so no layer sits at zero."""
    values = CONFIG.initial_parameters(seed=3).astype(np.float64)
    values += np.random.default_rng(3).normal(0.0, 0.1, values.size)
    return values.astype(np.float32).astype(np.float64)  # exactly what the device holds


@pytest.fixture(scope="module")
def codes() -> np.ndarray:
    """Grid codes as fp16 holds them (the device's values)."""
    values = np.random.default_rng(4).uniform(-1.0, 1.0, (GRID.vertices, CONFIG.latent))
    return values.astype(np.float16).astype(np.float64)


@pytest.fixture(scope="module")
def latent(gpu, params, codes) -> LatentAppearance:
    appearance = LatentAppearance(gpu, CONFIG, GRID, params, parts=PARTS)
    appearance.set_grid_codes(codes)
    return appearance


@pytest.fixture(scope="module")
def points() -> np.ndarray:
    inside = np.random.default_rng(5).uniform(BOX[0] + 0.3, BOX[1] - 0.3, (ROWS, 3))
    return inside.astype(np.float32).astype(np.float64)


@pytest.fixture(scope="module")
def views() -> np.ndarray:
    directions = np.random.default_rng(6).normal(size=(ROWS, 3))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    return directions.astype(np.float32).astype(np.float64)


def check(latent: LatentAppearance, kernel: str, rows: np.ndarray, weights: np.ndarray, *more: np.ndarray,
          backward: bool = False, grid_gradients: bool = True):
    """Run a probe kernel from zeroed gradients over rows: (values (N,), row gradients (N, D), parameter
    gradients, grid gradients)."""
    import slangpy as spy

    device = latent.gpu.device
    latent.zero_gradients()
    uploaded = [spy.Tensor.from_numpy(device, np.ascontiguousarray(a, np.float32).reshape(-1))
                for a in (rows, *more, weights)]
    values = spy.Tensor.zeros(device, shape=(len(rows),), dtype=float)
    d_rows = spy.Tensor.zeros(device, shape=(rows.size,), dtype=float)
    getattr(latent.module, kernel)(spy.grid((len(rows),)), len(rows), latent.shader_struct(grid_gradients),
                                   *(t.storage.device_address for t in uploaded), int(backward),
                                   values.storage.device_address, d_rows.storage.device_address)
    return (np.asarray(values.to_numpy(), np.float64), np.asarray(d_rows.to_numpy(), np.float64).reshape(rows.shape),
            latent.gradients().astype(np.float64), latent.grid_gradients().astype(np.float64))


def test_sizes_and_fp16_storage(latent, codes):
    """The grid covers the box at its cell, stores two codes a 32-bit word (half the fp32 bytes), brick by brick,
    and reads back exactly the fp16 codes it was given."""
    assert GRID.dims == (6, 7, 5) and np.allclose(GRID.positions()[-1], BOX[0] + 4.0 * np.array([5, 6, 4]))
    assert GRID.bricks == tuple(-(-n // BRICK) for n in GRID.dims) and latent.stored == np.prod(GRID.bricks) * BRICK**3
    assert latent.codes.to_numpy().nbytes == latent.stored * CONFIG.latent * 2
    np.testing.assert_array_equal(latent.grid_codes(), codes.astype(np.float32))
    assert CONFIG.count == (2 * 16 + 16) + (16 * 8 + 8) + (11 * 16 + 16) + (16 * 20 + 20)


def test_encoder_values_and_gradients(latent, params):
    rng = np.random.default_rng(7)
    inputs = rng.uniform(0.0, 1.0, (ROWS, CONFIG.inputs)).astype(np.float32).astype(np.float64)
    w = rng.normal(size=CONFIG.latent)

    def reference(p, x):
        return encoder(CONFIG, p, x) @ w

    values, d_inputs, gradient, grid_gradient = check(latent, "encoderCheck", inputs, w, backward=True)
    np.testing.assert_allclose(values, reference(params, inputs), rtol=1e-4, atol=1e-5)
    assert not gradient[CONFIG.decoder_offset:].any() and not grid_gradient.any()
    assert_gradient(lambda p: reference(p, inputs).sum(), params, gradient)
    assert_row_gradient(lambda x: reference(params, x), inputs, d_inputs)


def test_grid_lookup_values_and_gradients(latent, codes, points):
    w = np.random.default_rng(8).normal(size=CONFIG.latent)
    # Some points beyond the box: the lookup is clamped to the edge vertices, flat along that axis.
    outside = points.copy()
    outside[::7, 0] = BOX[0, 0] - 2.0
    values, d_points, gradient, grid_gradient = check(latent, "gridCheck", outside, w, backward=True)
    np.testing.assert_allclose(values, lookup(GRID, codes, outside) @ w, rtol=1e-4, atol=1e-5)
    assert not gradient.any()
    assert_gradient(lambda c: (lookup(GRID, c.reshape(codes.shape), outside) @ w).sum(), codes.ravel(),
                    grid_gradient.ravel())
    assert_row_gradient(lambda x: lookup(GRID, codes, x) @ w, outside, d_points, step=1e-4)
    assert not d_points[::7, 0].any()

    _, _, _, frozen = check(latent, "gridCheck", outside, w, backward=True, grid_gradients=False)
    assert not frozen.any()


def test_decoder_values_and_gradients(latent, params, views):
    rng = np.random.default_rng(9)
    latents = rng.uniform(-1.0, 1.0, (ROWS, CONFIG.latent)).astype(np.float32).astype(np.float64)
    w = rng.normal(size=CONFIG.outputs)

    def reference(p, z):
        return decoder(CONFIG, p, z, views) @ w

    values, d_latents, gradient, _ = check(latent, "decoderCheck", latents, w, views, backward=True)
    np.testing.assert_allclose(values, reference(params, latents), rtol=1e-4, atol=1e-5)
    assert not gradient[:CONFIG.decoder_offset].any()
    assert_gradient(lambda p: reference(p, latents).sum(), params, gradient)
    assert_row_gradient(lambda z: reference(params, z), latents, d_latents)
    # The view direction is an input: the same code seen from elsewhere is shaded otherwise.
    assert not np.allclose(reference(params, latents), decoder(CONFIG, params, latents, -views) @ w)


def test_shading_chains_grid_and_decoder(latent, params, codes, points, views):
    w = np.random.default_rng(10).normal(size=CONFIG.outputs)

    def reference(p, c, x):
        return decoder(CONFIG, p, lookup(GRID, c, x), views) @ w

    values, d_points, gradient, grid_gradient = check(latent, "shadeCheck", points, w, views, backward=True)
    np.testing.assert_allclose(values, reference(params, codes, points), rtol=1e-4, atol=1e-5)
    assert_gradient(lambda p: reference(p, codes, points).sum(), params, gradient)
    assert_gradient(lambda c: reference(params, c.reshape(codes.shape), points).sum(), codes.ravel(),
                    grid_gradient.ravel())
    assert_row_gradient(lambda x: reference(params, codes, x), points, d_points, step=1e-4)
    shaded = latent.shade(points, views)
    np.testing.assert_allclose(shaded.reshape(ROWS, -1), decoder(CONFIG, params, lookup(GRID, codes, points), views),
                               rtol=1e-4, atol=1e-5)


def test_encoding_a_study_fills_the_grid_with_the_encoder_codes(gpu, params):
    """The encoder over a study's volumes at every vertex: the reference encoder's codes of the inputs there (the
    volumes are linear in RAS, so trilinear sampling gives them exactly), rounded to fp16."""
    appearance = LatentAppearance(gpu, CONFIG, GRID, params, parts=PARTS)
    affine = np.diag([2.0, 2.0, 2.0, 1.0])
    affine[:3, 3] = BOX[0] - 1.0
    ijk = np.stack(np.meshgrid(*(np.arange(n) for n in (13, 15, 11)), indexing="ij"))
    ras = np.einsum("ab,bijk->aijk", affine[:3, :3], ijk) + affine[:3, 3, None, None, None]
    volumes = np.stack([0.05 * ras[0] - 0.02 * ras[2], 0.5 + 0.01 * ras[1]]).astype(np.float32)
    appearance.encode(volumes, np.linalg.inv(affine))
    positions = GRID.positions()
    inputs = np.stack([0.05 * positions[:, 0] - 0.02 * positions[:, 2], 0.5 + 0.01 * positions[:, 1]], axis=1)
    expected = encoder(CONFIG, params, inputs)
    got = appearance.grid_codes()
    np.testing.assert_allclose(got, expected, atol=1e-3)
    assert np.abs(expected).max() > 0.1
    with pytest.raises(ValueError, match="takes 2 local inputs"):
        appearance.encode(volumes[:1], np.linalg.inv(affine))


def test_a_fine_tune_step_moves_the_grid_and_the_decoder_against_their_gradients(gpu, params, codes):
    """Adam's first step moves each parameter by its rate against the sign of its gradient: the grid's codes
    (kept in fp16, from an fp32 copy) and the decoder's weights; the encoder stays pretrained, codes without a
    gradient stay, and the gradients are used up."""
    from NeuralRaycastLib.appearance.latent_scene import FineTune

    appearance = LatentAppearance(gpu, CONFIG, GRID, params, parts=PARTS)
    appearance.set_grid_codes(codes)
    rng = np.random.default_rng(11)
    grid_gradient = rng.normal(size=codes.shape).astype(np.float32)
    grid_gradient[::3] = 0.0
    appearance.set_grid_gradients(grid_gradient)
    gradient = rng.normal(size=CONFIG.count).astype(np.float32)
    appearance.grads.copy_from_numpy(gradient)
    tune = FineTune(appearance, rate_grid=1e-2, rate_decoder=1e-3)
    tune.step()
    expected = (codes - 1e-2 * np.sign(grid_gradient)).astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(appearance.grid_codes(), expected, atol=2e-3)
    np.testing.assert_array_equal(appearance.grid_codes()[::3], codes[::3].astype(np.float32))
    moved = appearance.parameters().astype(np.float64) - params
    decoder = slice(CONFIG.decoder_offset, CONFIG.count)
    np.testing.assert_allclose(moved[decoder], -1e-3 * np.sign(gradient[decoder]), atol=1e-6)
    assert not moved[: CONFIG.decoder_offset].any()
    assert not appearance.grid_gradients().any() and not appearance.gradients().any()


def test_a_sparse_grid_stores_only_its_bricks_and_reads_zero_elsewhere(gpu, params, codes, points, views):
    """With some bricks left out the grid stores only the others' vertices; a point whose cell lies in stored
    bricks reads exactly the dense grid's codes (lookup, gradients into the stored codes only), one whose corners
    fall in a brick left out reads zero codes there, and the encoder fills only the stored vertices."""
    needed = np.zeros(GRID.bricks[::-1], bool)  # (z, y, x) bricks: the first column along x, and one more
    needed[:, :, 0] = True
    needed[0, 1, 1] = True
    slots = np.where(needed, np.cumsum(needed).reshape(needed.shape) - 1, -1).astype(np.int32)
    sparse = LatentAppearance(gpu, CONFIG, GRID, params, parts=PARTS, slots=slots)
    kept_bytes = needed.sum() * BRICK**3 * CONFIG.latent * 2
    assert sparse.stored == needed.sum() * BRICK**3 and sparse.codes.to_numpy().nbytes == kept_bytes
    sparse.set_grid_codes(codes)
    indices = GRID.stored_indices(slots)
    kept = codes * (indices >= 0)[:, None]
    np.testing.assert_array_equal(sparse.grid_codes(), kept.astype(np.float32))
    w = np.random.default_rng(12).normal(size=CONFIG.latent)
    values, _, _, grid_gradient = check(sparse, "gridCheck", points, w, backward=True)
    np.testing.assert_allclose(values, lookup(GRID, kept, points) @ w, rtol=1e-4, atol=1e-5)
    mask = (indices >= 0)[:, None]
    assert_gradient(lambda c: (lookup(GRID, c.reshape(codes.shape) * mask, points) @ w).sum(), codes.ravel(),
                    grid_gradient.ravel())
    assert not grid_gradient[indices < 0].any()
    dense = lookup(GRID, codes, points) @ w
    stored = np.all(np.isin(cell_corners(points), np.flatnonzero(indices >= 0)), axis=1)
    assert stored.any() and not stored.all()
    np.testing.assert_allclose(values[stored], dense[stored], rtol=1e-4, atol=1e-5)
    assert not np.allclose(values[~stored], dense[~stored])

    affine = np.eye(4)
    sparse.set_grid_codes(np.full(codes.shape, 0.5))
    sparse.encode(np.ones((CONFIG.inputs, 3, 3, 3), np.float32), affine)
    encoded = sparse.grid_codes()
    assert not encoded[indices < 0].any()
    np.testing.assert_allclose(encoded[indices >= 0], encoder(CONFIG, params, np.ones((1, CONFIG.inputs)))
                               .repeat((indices >= 0).sum(), axis=0), atol=1e-3)


def cell_corners(points: np.ndarray) -> np.ndarray:
    """The vertex indices (the grid's order) of the 8 corners of each point's cell, as the lookup clamps it."""
    g = np.clip((points - GRID.origin) / GRID.cell_mm, 0, np.array(GRID.dims) - 1)
    base = np.clip(np.floor(g).astype(int), 0, np.array(GRID.dims) - 2)
    corners = [base + np.array([c & 1, (c >> 1) & 1, (c >> 2) & 1]) for c in range(8)]
    return np.stack([(v[:, 2] * GRID.dims[1] + v[:, 1]) * GRID.dims[0] + v[:, 0] for v in corners], axis=1)


@pytest.mark.parametrize("dims", [(9, 7, 6), (8, 8, 8), (5, 2, 3)])
def test_the_bricks_a_shaded_point_can_reach_are_found_on_the_device_as_on_the_host(latent, dims):
    """latentBricksNear over min |s| at the vertices (odd and even sides, a side of two vertices): the host's
    brick_slots, slot for slot, at a reach that keeps some bricks and leaves others."""
    import slangpy as spy

    from NeuralRaycastLib.appearance.latent_scene import brick_slots, device_brick_slots

    grid = GridLayout((0.0, 0.0, 0.0), dims, 1.0)
    rng = np.random.default_rng(sum(dims))
    nearest = rng.uniform(0.0, 10.0, dims[::-1]).astype(np.float32)
    nearest[rng.random(nearest.shape) < 0.85] = 50.0  # most vertices far from any surface
    expected = brick_slots(nearest, 4.0)
    assert 0 < (expected >= 0).sum() < expected.size or min(dims) <= 2
    uploaded = spy.Tensor.from_numpy(latent.gpu.device, nearest.reshape(-1))
    np.testing.assert_array_equal(device_brick_slots(latent.module, uploaded, grid, 4.0), expected)
