"""The SDF fit's geometry network on cooperative vectors (shaders/coopvec_mlp.slang), which Vulkan devices that
report them run. Where the suite runs without such a device (lavapipe), the same Slang source runs through its
per-thread fallback of the three cooperative operations (the layer products, the transposed products and the
weights' outer products): its fit must give the per-thread network's gradients within the half-precision
tolerances of the tensor-core networks (test_cooperative_geometry.py), and its gradients must be those of
central differences. The choice of the network from the device's features needs no device."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import phantom_prepared
from field_reference import central_difference, far_from_zero_parameters, geometry, tiny_config

from NeuralRaycastLib.field import field as field_module
from NeuralRaycastLib.field.field import (
    COOPVEC_FALLBACK,
    FieldLayout,
    NeuralField,
    coop_gradient_scale,
    coop_vector_sized,
    load_field_module,
)
from NeuralRaycastLib.field.sdf_fit import FitConfig, SdfFitter
from NeuralRaycastLib.gpu.device import coop_vector_networks

BOX = np.array([[-4.0, 2.0, 1.0], [16.0, 26.0, 17.0]])
STRUCTURES, CHANNELS = 4, 1
PARTS = ("sdf_fit", "field_checks")


def test_the_network_on_cooperative_vectors_is_chosen_from_the_devices_features():
    """Vulkan devices that report cooperative vectors get them (their sums in half unless asked for float, whose
    sums came back wrong on an H100); others, CUDA (its own tensor-core networks) and the setting 0 keep the
    per-thread network."""
    assert coop_vector_networks("vulkan", True, "1") == (1, "cooperative vectors, the weights' gradients summed "
                                                            "in half")
    assert coop_vector_networks("vulkan", True, "half")[0] == 1
    assert coop_vector_networks("vulkan", True, "float")[0] == 2
    # a point's share of the default batch's mean loss (65536 points, four structures) taken into half's normal
    # range by an exact power of two, and a large share brought down likewise
    assert coop_gradient_scale(1.0 / (65536 * 4)) == 256.0 and coop_gradient_scale(1.0 / 96) == 0.125
    assert coop_vector_networks("vulkan", True, "0") == (None, "NEURALRAYCAST_COOPVEC=0")
    assert coop_vector_networks("vulkan", False, "1") == (None, "the Vulkan device has no cooperative vectors")
    assert coop_vector_networks("cuda", True, "1")[0] is None
    assert coop_vector_networks("metal", True, "1")[0] is None
    # a row of a layer's weights must span a multiple of 16 bytes: 5 levels of 1 feature keep the per-thread network
    config = tiny_config()
    assert coop_vector_sized(FieldLayout.build(config, BOX, STRUCTURES, CHANNELS))
    odd = replace(config, encoding=replace(config.encoding, levels=5, features=1))
    assert not coop_vector_sized(FieldLayout.build(odd, BOX, STRUCTURES, CHANNELS))


class RecordingDevice:
    """A device that records the defines each field module's session is asked for instead of compiling it."""

    def __init__(self) -> None:
        self.device = object()
        self.sessions: list[tuple[str, dict[str, str] | None]] = []

    def load_module_from_source(self, name: str, source: str, structures: int | None = None,
                                defines: dict[str, str] | None = None) -> str:
        self.sessions.append((source, defines))
        return name


def test_only_the_cooperative_vectors_module_is_compiled_with_their_define():
    """The fit's and the renderer's modules (per thread, tensor cores, frozen) go to a session without
    FIELD_COOPVEC, as they were before cooperative vectors; the cooperative vectors' module (each Kind) to one
    with it, its FIELD_COOPERATIVE past the tensor cores' values."""
    layout = FieldLayout.build(tiny_config(), BOX, STRUCTURES, CHANNELS)
    device = RecordingDevice()
    try:
        for options in ({}, {"cooperative": True}, {"frozen_geometry": True}):
            load_field_module(device, layout, PARTS, **options)
        for kind in (COOPVEC_FALLBACK, 1, 2):
            load_field_module(device, layout, PARTS, coop_vectors=kind)
    finally:  # the modules cached for it, which a later device at its address must not find
        for key in [key for key in field_module._MODULES if key[0] == id(device.device)]:
            del field_module._MODULES[key]
    defines = [session for _, session in device.sessions]
    assert defines == [None] * 3 + [{"FIELD_COOPVEC": "1"}] * 3
    values = [next(line for line in source.splitlines() if line.startswith("#define FIELD_COOPERATIVE "))
              for source, _ in device.sessions]
    assert values == [f"#define FIELD_COOPERATIVE {value}" for value in (0, 1, 2, 3, 4, 5)]


@pytest.fixture(scope="module")
def layout() -> FieldLayout:
    return FieldLayout.build(tiny_config(), BOX, STRUCTURES, CHANNELS, capacity=(STRUCTURES, CHANNELS + 1))


@pytest.fixture(scope="module")
def params(layout) -> np.ndarray:
    return far_from_zero_parameters(layout)


#: coopvec_mlp.slang's Kinds: the per-thread fallback everywhere; on a device with cooperative vectors, the
#: weights' gradients summed in float and in half as well.
KINDS = [COOPVEC_FALLBACK, 2, 1]


@pytest.fixture(scope="module", params=KINDS, ids=["fallback", "float_sums", "half_sums"])
def fields(request, gpu, layout, params) -> tuple[NeuralField, NeuralField]:
    """The per-thread field, and the same field with its geometry network on cooperative vectors (the device's,
    where it has them, or their fallback)."""
    if request.param != COOPVEC_FALLBACK and not gpu.report.cooperative_vector:
        pytest.skip("the device has no cooperative vectors")
    per_thread = NeuralField(gpu, layout, params, parts=PARTS, cooperative=False, coop_vectors=None)
    coop = NeuralField(gpu, layout, params, parts=PARTS, cooperative=False, coop_vectors=request.param)
    return per_thread, coop


@pytest.mark.gpu
def test_a_fit_step_on_cooperative_vectors_gives_the_per_thread_networks_gradients(gpu, fields):
    """One fit step's gradients (Eikonal waves and others), every parameter group, and the batch's loss."""
    prepared = phantom_prepared(4.0)[1]
    gradients, losses = [], []
    for field in fields:
        fitter = SdfFitter(gpu, prepared, field, FitConfig(batch=96, eikonal_every=2, seed=7))
        losses.append(fitter.loss())
        fitter.accumulate(0)
        gradients.append(field.gradients().astype(np.float64))
        field.zero_gradients()
    assert fields[1].coop_vectors is not None and fields[0].coop_vectors is None
    # the weights' gradients came through the cooperative vectors' sums, not the per-thread network
    assert np.asarray(fields[1].coop_vector_buffers()["sums"].to_numpy()).view(np.uint8).any()
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-2)
    for name, (start, stop) in fields[0].layout.segments().items():
        expected, got = gradients[0][start:stop], gradients[1][start:stop]
        if name == "appearance":
            assert not expected.any() and not got.any()
            continue
        assert np.abs(expected).max() > 0, name
        np.testing.assert_allclose(got, expected, atol=5e-2 * np.abs(expected).max(), err_msg=name)


@pytest.mark.gpu
def test_the_cooperative_vector_networks_gradients_are_central_differences(fields, layout, params):
    """The network's values, and its parameters' and input's gradients (weights through the outer products'
    sums, biases and the hash table through the field's own gradients) against central differences of the
    float network, within half precision."""
    coop = fields[1]
    rng = np.random.default_rng(4)
    points = rng.uniform(BOX[0] + 0.3, BOX[1] - 0.3, (48, 3)).astype(np.float32).astype(np.float64)
    w = rng.normal(size=STRUCTURES + layout.config.network.geometry_features)

    def reference(p, x):
        distance, feature = geometry(layout, p, x)
        return np.concatenate([distance, feature], axis=1) @ w

    module = coop.sdf_fit_module
    coop.upload_coop_vector_network()
    values = np.asarray(module.geometryValue(coop.shader_struct(coop_vectors=True), np.float32(points), list(w),
                                             _result="numpy"))
    expected = reference(params, points)
    np.testing.assert_allclose(values, expected, atol=2e-2 * np.abs(expected).max())

    coop.zero_gradients()
    coop.upload_coop_vector_network()
    dx = np.asarray(module.geometryBackward(coop.shader_struct(coop_vectors=True), np.float32(points), list(w),
                                            _result="numpy"), dtype=np.float64).reshape(-1, 3)
    coop.add_coop_vector_gradients()
    gradient = coop.gradients().astype(np.float64)
    coop.zero_gradients()
    network = gradient[layout.geometry_offset : layout.appearance_offset]
    assert network.any() and gradient[: layout.geometry_offset].any()
    assert not gradient[layout.appearance_offset :].any()

    scale = np.abs(gradient).max()
    directions = rng.normal(size=(3, params.size))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    numeric = central_difference(lambda p: reference(p, points).sum(), params, directions, 1e-5)
    np.testing.assert_allclose(directions @ gradient, numeric, rtol=5e-2, atol=5e-3 * scale * np.sqrt(params.size))
    largest = np.argsort(-np.abs(network))[:16] + layout.geometry_offset
    numeric = central_difference(lambda p: reference(p, points).sum(), params, np.eye(params.size)[largest], 1e-5)
    np.testing.assert_allclose(gradient[largest], numeric, rtol=5e-2, atol=5e-2 * scale)

    steps = np.eye(3)[None] * 1e-4
    numeric_dx = np.stack([(reference(params, points + steps[:, a]) - reference(params, points - steps[:, a])) / 2e-4
                           for a in range(3)], axis=1)
    np.testing.assert_allclose(dx, numeric_dx, atol=5e-2 * np.abs(numeric_dx).max())
