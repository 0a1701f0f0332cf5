"""Gradient checks of the field's Slang code against central differences of a float64 numpy reference.

Each component (hash encoding, geometry network, appearance network, each loss term) is checked for
its forward values and for its derivatives with respect to the parameters and to its inputs, on
random inputs, on the device the suite runs on (lavapipe on a machine without a GPU).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import phantom_prepared
from field_reference import (
    TETRAHEDRON,
    appearance,
    central_difference,
    distance_gradients,
    encode,
    far_from_zero_parameters,
    geometry,
    point_loss,
    segment_tetrahedron,
    tetrahedron_gradients,
    tiny_config,
)

from NeuralRaycastLib.field.field import FieldLayout, NeuralField
from NeuralRaycastLib.field.sdf_fit import FitConfig, SdfFitter

pytestmark = pytest.mark.gpu

BOX = np.array([[-4.0, 2.0, 1.0], [16.0, 26.0, 17.0]])
STRUCTURES, CHANNELS = 4, 1
POINTS = 48


#: The kernels of the checked field hold exactly its structures and inputs, so the probes take its own sizes.
CAPACITY = (STRUCTURES, CHANNELS + 1)


@pytest.fixture(scope="module")
def layout() -> FieldLayout:
    return FieldLayout.build(tiny_config(), BOX, STRUCTURES, CHANNELS, capacity=CAPACITY)


@pytest.fixture(scope="module")
def params(layout) -> np.ndarray:
    return far_from_zero_parameters(layout)


@pytest.fixture(scope="module")
def field(gpu, layout, params) -> NeuralField:
    """The per-thread fp32 network on every backend: these checks are exact to float rounding. The tensor-core
    path (half precision, CUDA) is compared with this one in test_cooperative_geometry."""
    return NeuralField(gpu, layout, params, parts=("sdf_fit", "field_checks"), cooperative=False)


@pytest.fixture(scope="module")
def points() -> np.ndarray:
    rng = np.random.default_rng(4)
    inside = rng.uniform(BOX[0] + 0.3, BOX[1] - 0.3, (POINTS, 3))
    return inside.astype(np.float32).astype(np.float64)


def f32(points: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(points, dtype=np.float32)


def float3(x: np.ndarray):
    import slangpy as spy

    return spy.float3(*map(float, x))


def device_backward(field: NeuralField, kernel, *args):
    """Run a backward probe from zeroed gradients: (its return value, the parameter gradients)."""
    field.zero_gradients()
    result = np.asarray(kernel(field.shader_struct(), *args, _result="numpy"), dtype=np.float64)
    return result, field.gradients().astype(np.float64)


def assert_parameter_gradient(function, params: np.ndarray, gradient: np.ndarray, step: float = 1e-5) -> None:
    """Device gradient vs central differences: along random directions and on the largest coordinates."""
    rng = np.random.default_rng(5)
    scale = np.abs(gradient).max()
    assert scale > 0, "the gradient is identically zero"
    directions = rng.normal(size=(3, params.size))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    numeric = central_difference(function, params, directions, step)
    np.testing.assert_allclose(directions @ gradient, numeric, rtol=2e-3, atol=2e-4 * scale * np.sqrt(params.size))
    largest = np.argsort(-np.abs(gradient))[:24]
    untouched = rng.choice(np.flatnonzero(gradient == 0), size=min(8, int((gradient == 0).sum())), replace=False)
    chosen = np.concatenate([largest, untouched])
    numeric = central_difference(function, params, np.eye(params.size)[chosen], step)
    np.testing.assert_allclose(gradient[chosen], numeric, rtol=2e-3, atol=2e-4 * scale)


def assert_position_gradient(function, x: np.ndarray, gradient: np.ndarray, step: float = 1e-5) -> None:
    """Per-point d/dx of a per-point function vs central differences."""
    numeric = np.stack([(function(x + step * a) - function(x - step * a)) / (2 * step) for a in np.eye(3)], axis=1)
    scale = np.abs(numeric).max()
    assert scale > 0
    np.testing.assert_allclose(gradient, numeric, rtol=2e-3, atol=2e-4 * scale)


def test_layout_has_dense_and_hashed_levels(layout):
    dense = [level.dense for level in layout.levels]
    assert any(dense) and not all(dense), dense
    for level in layout.levels:
        vertices = int(np.prod(level.dims))
        assert level.size == (vertices if level.dense else 1 << layout.config.encoding.log2_table)
    cells = [level.cell_mm for level in layout.levels]
    assert cells == sorted(cells, reverse=True)
    assert cells[0] == pytest.approx((BOX[1] - BOX[0]).max() / 4) and cells[-1] == pytest.approx(2.0)


@pytest.mark.parametrize("hash_name", ["x_added", "xor"])
def test_hash_encoding_values_and_gradients(gpu, field, layout, params, points, hash_name):
    """Both hashes: "x_added" (new fields) and "xor" (model files of format 1 and 2)."""
    if hash_name != layout.config.encoding.hash:
        other = FieldLayout.build(replace(layout.config, encoding=replace(layout.config.encoding, hash=hash_name)),
                                  BOX, STRUCTURES, CHANNELS, capacity=CAPACITY)
        assert not np.allclose(encode(other, params, points), encode(layout, params, points))
        layout = other
        field = NeuralField(gpu, layout, params, parts=("sdf_fit", "field_checks"), cooperative=False)
    encoded = layout.config.encoding.levels * layout.config.encoding.features
    w = np.random.default_rng(6).normal(size=encoded)
    values = np.asarray(field.module.encodingValue(field.shader_struct(), f32(points), list(w), _result="numpy"))
    reference = encode(layout, params, points) @ w
    np.testing.assert_allclose(values, reference, rtol=1e-4, atol=1e-5 * np.abs(reference).max())

    dx, gradient = device_backward(field, field.module.encodingBackward, f32(points), list(w))
    # Linear in the table: every table entry a point touches gets its weight; nothing else moves.
    assert_parameter_gradient(lambda p: (encode(layout, p, points) @ w).sum(), params, gradient)
    assert not gradient[layout.geometry_offset :].any()
    assert_position_gradient(lambda x: encode(layout, params, x) @ w, points, dx.reshape(-1, 3))
    # The pairs of entries that straddle two 16-byte blocks went to the table's second gradient copy.
    raw = field.grads.to_numpy()
    assert raw[layout.shifted_gradients :].any() and raw[: layout.geometry_offset].any()


def test_a_gpus_reads_of_the_hash_table_give_the_same_encoding(gpu, field, layout, params, points):
    """On a GPU the table's entries are read without the CPU driver's branch per pair of them
    (NEURALRAYCAST_GPU_DRIVER, shaders/hash_encoding.slang): the same entries, summed in the same order. The GPU's
    form is compiled here on whatever device runs the suite (the encoding's kernel alone, which has no atomics)."""
    from NeuralRaycastLib.field.field import field_source

    source = field_source(layout, ("sdf_fit", "field_checks"))
    gpu_form = gpu.load_module_from_source("field_checks_gpu_reads", source, layout.kernels.structures,
                                           {"NEURALRAYCAST_GPU_DRIVER": "1"})
    w = np.random.default_rng(6).normal(size=layout.config.encoding.levels * layout.config.encoding.features)
    ours = np.asarray(field.module.encodingValue(field.shader_struct(), f32(points), list(w), _result="numpy"))
    theirs = np.asarray(gpu_form.encodingValue(field.shader_struct(), f32(points), list(w), _result="numpy"))
    np.testing.assert_allclose(theirs, ours, rtol=1e-6, atol=1e-6 * np.abs(ours).max())
    reference = encode(layout, params, points) @ w
    np.testing.assert_allclose(theirs, reference, rtol=1e-4, atol=1e-5 * np.abs(reference).max())


def test_hash_encoding_gradients_of_consecutive_points_in_the_same_cells(field, layout, params):
    """Samples along rays in ray order, as the renderer's backward passes send them: neighbouring threads
    share cells at every level (runs of lanes whose gradients are summed before one atomic on CUDA), and
    the table gradient must still be exact."""
    rng = np.random.default_rng(9)
    starts = rng.uniform(BOX[0] + 1.0, BOX[1] - 1.0, (6, 3))
    directions = rng.normal(size=(6, 3))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    steps = 0.25 * np.arange(48)  # mm; the finest cells are 2 mm
    rays = np.clip(starts[:, None, :] + steps[None, :, None] * directions[:, None, :], BOX[0] + 0.3, BOX[1] - 0.3)
    samples = rays.reshape(-1, 3).astype(np.float32).astype(np.float64)
    encoded = layout.config.encoding.levels * layout.config.encoding.features
    w = np.random.default_rng(10).normal(size=encoded)

    _, gradient = device_backward(field, field.module.encodingBackward, f32(samples), list(w))
    assert_parameter_gradient(lambda p: (encode(layout, p, samples) @ w).sum(), params, gradient)


@pytest.mark.parametrize("h", [0.4, 3.0], ids=["stencil-inside-cells", "stencil-across-cells"])
def test_stencil_encoding_equals_the_encoding_of_each_point(field, layout, params, points, h):
    """The Eikonal term's and the normals' tetrahedra are encoded together, reading a shared cell's entries once
    (most coarse levels when h is small, few when it spans cells): the same features as each point alone, and
    the same table gradient as four separate backward passes."""
    encoded = layout.config.encoding.levels * layout.config.encoding.features
    w = np.random.default_rng(11).normal(size=encoded)
    stencil = [points + (h / np.sqrt(3.0)) * (corner - TETRAHEDRON[0]) for corner in TETRAHEDRON]
    for index, where in enumerate(stencil):
        values = np.asarray(field.module.stencilEncodingValue(field.shader_struct(), f32(points), h, index, list(w),
                                                              _result="numpy"))
        reference = encode(layout, params, where) @ w
        np.testing.assert_allclose(values, reference, rtol=1e-4, atol=1e-5 * np.abs(reference).max())

    _, gradient = device_backward(field, field.module.stencilEncodingBackward, f32(points), h, list(w))
    assert_parameter_gradient(
        lambda p: sum((index + 1) * (encode(layout, p, where) @ w).sum() for index, where in enumerate(stencil)),
        params, gradient)


@pytest.mark.parametrize("length", [0.4, 3.0], ids=["segment-inside-cells", "segment-across-cells"])
def test_shading_geometry_is_the_gradient_over_the_segments_tetrahedron(field, layout, params, points, length):
    """A shaded segment's normals come from the distances at its ends (given) and at the two corners that make
    it an edge of a regular tetrahedron, its features from the first corner: the values of a float64 reference,
    and its gradients with respect to the parameters and to the end distances those of central differences,
    with the corners encoded together and the backward scheduled by hand (the render's) or evaluated apart."""
    rng = np.random.default_rng(12)
    directions = rng.normal(size=(POINTS, 3))
    ends = f32(points + length * directions / np.linalg.norm(directions, axis=1, keepdims=True)).astype(np.float64)
    features = layout.config.network.geometry_features
    w = rng.normal(size=features + 3 * STRUCTURES)
    at_start, at_end = rng.normal(0.0, 2.0, STRUCTURES), rng.normal(0.0, 2.0, STRUCTURES)
    corners = segment_tetrahedron(points, ends)
    edges = [np.linalg.norm(corners[i] - corners[j], axis=1) for i in range(4) for j in range(i)]
    np.testing.assert_allclose(edges, np.full((6, POINTS), length), rtol=1e-5)  # a regular tetrahedron

    def reference(p, start, end):
        first, feature = geometry(layout, p, corners[2])
        second, _ = geometry(layout, p, corners[3])
        values = np.stack([np.broadcast_to(start, first.shape), np.broadcast_to(end, first.shape), first, second])
        gradients = tetrahedron_gradients(corners, values).reshape(POINTS, -1)
        return feature @ w[:features] + gradients @ w[features:]

    step = 1e-3  # the end distances enter linearly
    numeric = [(reference(params, at_start + step, at_end) - reference(params, at_start - step, at_end)) / (2 * step),
               (reference(params, at_start, at_end + step) - reference(params, at_start, at_end - step)) / (2 * step)]
    args = (f32(points), f32(ends), list(at_start), list(at_end), list(w))
    for together in (True, False):
        values = np.asarray(field.module.shadingValue(field.shader_struct(), *args, together, _result="numpy"))
        expected = reference(params, at_start, at_end)
        np.testing.assert_allclose(values, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
        ends_gradient, gradient = device_backward(field, field.module.shadingBackward, *args, together)
        assert np.abs(gradient[: layout.geometry_offset]).max() > 0
        assert_parameter_gradient(lambda p: reference(p, at_start, at_end).sum(), params, gradient)
        np.testing.assert_allclose(ends_gradient, np.stack(numeric, axis=1), rtol=1e-3,
                                   atol=1e-4 * np.abs(numeric).max())


def test_hash_encoding_active_levels(field, layout, params, points):
    """Coarse-to-fine: levels from activeLevels on contribute nothing."""
    encoded = layout.config.encoding.levels * layout.config.encoding.features
    w = np.random.default_rng(7).normal(size=encoded)
    field.active_levels = 3
    try:
        values = np.asarray(field.module.encodingValue(field.shader_struct(), f32(points), list(w), _result="numpy"))
    finally:
        field.active_levels = len(layout.levels)
    np.testing.assert_allclose(values, encode(layout, params, points, active=3) @ w, rtol=1e-4, atol=1e-5)


def test_geometry_network_values_and_gradients(field, layout, params, points):
    outputs = STRUCTURES + layout.config.network.geometry_features
    w = np.random.default_rng(8).normal(size=outputs)

    def reference(p, x):
        distance, feature = geometry(layout, p, x)
        return np.concatenate([distance, feature], axis=1) @ w

    values = np.asarray(field.module.geometryValue(field.shader_struct(), f32(points), list(w), _result="numpy"))
    np.testing.assert_allclose(values, reference(params, points), rtol=1e-4, atol=1e-4)
    distances = field.distances(points)
    np.testing.assert_allclose(distances, geometry(layout, params, points)[0], rtol=1e-4, atol=1e-4)
    # Outside the field's box: the distances at the box's nearest point plus the way to it.
    low = np.asarray(layout.origin)
    high = low + np.asarray(layout.extent)
    away = np.array([[low[0] - 3.0, *(0.5 * (low + high))[1:]], [high[0] + 1.0, high[1] + 2.0, low[2] - 2.0]])
    nearest = np.clip(away, low, high)
    expected = geometry(layout, params, nearest)[0] + np.linalg.norm(away - nearest, axis=1)[:, None]
    np.testing.assert_allclose(field.distances(away), expected, rtol=1e-4, atol=1e-4)

    dx, gradient = device_backward(field, field.module.geometryBackward, f32(points), list(w))
    assert_parameter_gradient(lambda p: reference(p, points).sum(), params, gradient)
    assert gradient[layout.geometry_offset : layout.appearance_offset].any()
    assert not gradient[layout.appearance_offset :].any()
    assert_position_gradient(lambda x: reference(params, x), points, dx.reshape(-1, 3))


def test_appearance_network_values_and_gradients(field, layout, params):
    rng = np.random.default_rng(9)
    features = rng.normal(size=(POINTS, layout.config.network.geometry_features))
    inputs = rng.uniform(0.0, 1.0, (POINTS, layout.appearance_inputs))
    outputs = STRUCTURES * (3 + layout.config.network.materials)
    w = rng.normal(size=outputs)
    rows_f, rows_i = [list(map(float, r)) for r in features], [list(map(float, r)) for r in inputs]

    def reference(p, f, i):
        return appearance(layout, p, f, i) @ w

    values = np.array([
        field.module.appearanceValue(field.shader_struct(), f, i, list(w)) for f, i in zip(rows_f, rows_i, strict=True)
    ])
    np.testing.assert_allclose(values, reference(params, features, inputs), rtol=1e-4, atol=1e-5)

    field.zero_gradients()
    d_inputs = np.array([
        list(field.module.appearanceBackward(field.shader_struct(), f, i, list(w)))
        for f, i in zip(rows_f, rows_i, strict=True)
    ])
    gradient = field.gradients().astype(np.float64)
    assert not gradient[: layout.appearance_offset].any()
    assert_parameter_gradient(lambda p: reference(p, features, inputs).sum(), params, gradient)
    e = np.zeros_like(features)
    e[:, 0] = 1e-5
    numeric_f = (reference(params, features + e, inputs) - reference(params, features - e, inputs)) / 2e-5
    e = np.zeros_like(inputs)
    e[:, 0] = 1e-5
    numeric_i = (reference(params, features, inputs + e) - reference(params, features, inputs - e)) / 2e-5
    np.testing.assert_allclose(d_inputs, np.stack([numeric_f, numeric_i], axis=1), rtol=2e-3, atol=1e-5)


def loss_settings(data_scale: float, eikonal_scale: float, structures: int = STRUCTURES) -> dict:
    import slangpy as spy

    return {
        "boxMin": spy.float3(*BOX[0]),
        "boxMax": spy.float3(*BOX[1]),
        "ijkToRas": spy.float4x4(np.eye(4, dtype=np.float32)),
        "bandFraction": 0.5,
        "truncation": 5.0,
        "eikonalStep": 0.5,
        "eikonalEvery": 1,
        "dataScale": data_scale,
        "eikonalScale": eikonal_scale,
        "seed": 1,
        "structures": structures,
    }


@pytest.mark.parametrize("term", ["truncated_l1", "eikonal"])
def test_loss_term_gradients(field, layout, params, points, term):
    eikonal = term == "eikonal"
    settings = loss_settings(0.0 if eikonal else 0.7, 0.3 if eikonal else 0.0)
    distance = geometry(layout, params, points)[0]
    rng = np.random.default_rng(10)
    # Targets around the current distances, some beyond the truncation: every branch of the term is hit.
    targets = distance + rng.normal(0.0, 4.0, distance.shape)
    targets[::5] = np.sign(targets[::5]) * 12.0
    targets = targets.astype(np.float32).astype(np.float64)
    rows = [list(map(float, t)) for t in targets]

    values = np.array([
        field.module.pointLossValue(field.shader_struct(), float3(x), t, eikonal, settings)
        for x, t in zip(points, rows, strict=True)
    ])
    reference = point_loss(layout, params, points, targets, eikonal, settings)
    np.testing.assert_allclose(values, reference, rtol=1e-3, atol=1e-4 * np.abs(reference).max())
    assert np.abs(reference).max() > 0

    field.zero_gradients()
    for x, t in zip(points, rows, strict=True):
        field.module.pointLossBackward(field.shader_struct(), float3(x), t, eikonal, settings)
    gradient = field.gradients().astype(np.float64)
    assert_parameter_gradient(lambda p: point_loss(layout, p, points, targets, eikonal, settings).sum(), params,
                              gradient, step=1e-6 if eikonal else 1e-5)


@pytest.fixture(scope="module")
def fewer(gpu, field) -> tuple[FieldLayout, np.ndarray, NeuralField]:
    """A study of one structure fewer on the checked field's kernels (they hold one structure more than it has)."""
    layout = FieldLayout.build(tiny_config(), BOX, STRUCTURES - 1, CHANNELS, capacity=CAPACITY)
    rng = np.random.default_rng(8)
    values = layout.initial_parameters(seed=8).astype(np.float64)
    values[: layout.geometry_offset] = rng.uniform(-1.0, 1.0, layout.geometry_offset)
    values[layout.geometry_offset :] += rng.normal(0.0, 0.05, layout.count - layout.geometry_offset)
    values = values.astype(np.float32).astype(np.float64)
    return layout, values, NeuralField(gpu, layout, values, parts=("sdf_fit", "field_checks"), cooperative=False)


@pytest.mark.parametrize("term", ["truncated_l1", "eikonal"])
def test_a_study_with_fewer_structures_than_its_kernels_hold_trains_as_a_field_of_its_own(field, fewer, points, term):
    """The kernels' unused structure takes no part: the loss, its gradients and the queried distances are those of
    the study's own smaller field whatever the unused target holds, and no gradient reaches the unused weights,
    which stay zero on the device."""
    layout, params, small = fewer
    assert small.module is field.module  # one compile serves both studies
    eikonal = term == "eikonal"
    settings = loss_settings(0.0 if eikonal else 0.7, 0.3 if eikonal else 0.0, structures=layout.structures)
    distance = geometry(layout, params, points)[0]
    targets = distance + np.random.default_rng(11).normal(0.0, 4.0, distance.shape)
    targets = targets.astype(np.float32).astype(np.float64)
    rows = [[*map(float, t), -7.0] for t in targets]  # the unused structure's target: far inside, were it read

    values = np.array([small.module.pointLossValue(small.shader_struct(), float3(x), t, eikonal, settings)
                       for x, t in zip(points, rows, strict=True)])
    reference = point_loss(layout, params, points, targets, eikonal, settings)
    np.testing.assert_allclose(values, reference, rtol=1e-3, atol=1e-4 * np.abs(reference).max())

    small.zero_gradients()
    for x, t in zip(points, rows, strict=True):
        small.module.pointLossBackward(small.shader_struct(), float3(x), t, eikonal, settings)
    unused = np.setdiff1d(np.arange(layout.kernels.count), layout.kernel_positions)
    assert unused.size > 0
    assert not small.kernel_gradients()[unused].any() and not small.kernel_parameters()[unused].any()
    assert_parameter_gradient(lambda p: point_loss(layout, p, points, targets, eikonal, settings).sum(), params,
                              small.gradients().astype(np.float64), step=1e-6 if eikonal else 1e-5)
    assert small.distances(points).shape == distance.shape
    np.testing.assert_allclose(small.distances(points), distance, rtol=1e-4, atol=1e-4 * np.abs(distance).max())


def test_normals_point_along_the_distance_gradient(field, layout, params, points):
    h = 0.5
    numeric = distance_gradients(layout, params, points, h)
    gradient = field.distance_gradients(points, h)
    np.testing.assert_allclose(gradient, numeric, rtol=2e-3, atol=2e-3 * np.abs(numeric).max())
    normals = field.normals(points, h)
    np.testing.assert_allclose(np.linalg.norm(normals, axis=-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(normals, numeric / np.linalg.norm(numeric, axis=-1, keepdims=True), atol=1e-3)


def test_the_fit_samples_the_boundary_maps_trilinearly_with_every_structure_at_once(gpu, field):
    """The fit reads every structure's B_k at a point from one interleaved copy of the maps: the trilinear
    values of each map, clamped to the edge voxels beyond the grid (as the reference renderer samples them)."""
    import slangpy as spy
    from scipy.ndimage import map_coordinates

    prepared = phantom_prepared(4.0)[1]
    fitter = SdfFitter(gpu, prepared, field, FitConfig(batch=32))
    rng = np.random.default_rng(5)
    ijk = rng.uniform(-2.0, np.array(prepared.boundary.shape[1:]) + 1.0, size=(64, 3))
    ras = ijk @ prepared.affine[:3, :3].T + prepared.affine[:3, 3]
    points = spy.Tensor.from_numpy(gpu.device, f32(ras).reshape(-1))
    values = spy.Tensor.zeros(gpu.device, shape=(len(ras) * STRUCTURES,), dtype=float)
    field.module.boundaryAt(spy.grid((len(ras),)), fitter.boundary, points.storage.device_address,
                            values.storage.device_address)
    got = np.asarray(values.to_numpy()).reshape(-1, STRUCTURES)
    expected = np.stack([map_coordinates(volume, ijk.T, order=1, mode="nearest") for volume in prepared.boundary], 1)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_the_fit_steps_backward_by_hand_equals_the_checked_point_loss_gradients(gpu, field):
    """A training step schedules its backward pass by hand (distances first, then each evaluation's network
    and hash table backward again, one at a time); its gradients must be those of the point loss checked
    above (bwd_diff through the whole of it), summed over the step's points, Eikonal waves and others."""
    import slangpy as spy

    prepared = phantom_prepared(4.0)[1]  # four structures and one channel, as the field's layout
    fitter = SdfFitter(gpu, prepared, field, FitConfig(batch=96, eikonal_every=2, seed=7))
    assert fitter.eikonal_points == 64  # waves 0 and 2 of 3
    fitter.accumulate(0)
    split = field.gradients().astype(np.float64)
    field.zero_gradients()
    field.module.fitStepByAutodiff(spy.grid((fitter.batch,)), field.shader_struct(), fitter.boundary, fitter.band,
                                    fitter.settings(0))
    whole = field.gradients().astype(np.float64)
    field.zero_gradients()
    for name, (start, stop) in field.layout.segments().items():
        if name == "appearance":
            assert not split[start:stop].any() and not whole[start:stop].any()
            continue
        assert np.abs(whole[start:stop]).max() > 0, name
        np.testing.assert_allclose(split[start:stop], whole[start:stop], rtol=1e-4,
                                   atol=1e-5 * np.abs(whole[start:stop]).max(), err_msg=name)
