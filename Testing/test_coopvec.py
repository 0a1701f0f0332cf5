"""The field's networks on cooperative vectors (shaders/coopvec_mlp.slang), which Vulkan devices that report them
run: the geometry network in the SDF fit and the renderer, the appearance network in the renderer. Where the
suite runs without such a device (lavapipe), the same Slang source runs through its per-thread fallback of the
three cooperative operations (the layer products, the transposed products and the weights' outer products): its
fit and render must give the per-thread networks' values and gradients within the half-precision tolerances of
the tensor-core networks (test_cooperative_geometry.py), and its gradients must be those of central differences.
The choice of the network from the device's features needs no device."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import analytic_prepared, phantom_prepared
from field_reference import appearance, central_difference, far_from_zero_parameters, geometry, tiny_config

from NeuralRaycastLib.field import field as field_module
from NeuralRaycastLib.field.coop_vectors import network_layers
from NeuralRaycastLib.field.field import (
    COOPVEC_FALLBACK,
    FieldLayout,
    NeuralField,
    coop_gradient_scale,
    coop_vector_sized,
    load_field_module,
)
from NeuralRaycastLib.field.field_render import appearance_gradient_scale
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
    narrow = replace(config, network=replace(config.network, appearance_hidden=12))
    assert not coop_vector_sized(FieldLayout.build(narrow, BOX, STRUCTURES, CHANNELS))
    # the appearance network's 15 features and 5 local inputs padded to whole 16-byte rows of half weights; its
    # weights' gradients scaled for a mean image loss over a batch of 128 patches of 32² rays
    assert network_layers([20, 64, 20]) == [(64, 24), (20, 64)] and network_layers([32, 64, 19])[0] == (64, 32)
    assert appearance_gradient_scale(128 * 32 * 32) == 128.0


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
    assert np.asarray(fields[1].coop_network("geometry").sums.to_numpy()).view(np.uint8).any()
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


@pytest.mark.gpu
def test_with_its_weights_frozen_the_networks_input_gradient_is_central_differences_at_any_scale(fields, layout,
                                                                                                   params):
    """The renderer's backward pass takes the geometry network's input gradient alone (its weights frozen): each
    point's output gradient is scaled into half's range by itself, so a loss far below half's smallest normal
    number or far above its largest gives the input's and the hash table's gradients of central differences,
    and the network's weights get none."""
    coop = fields[1]
    rng = np.random.default_rng(6)
    points = rng.uniform(BOX[0] + 0.3, BOX[1] - 0.3, (32, 3)).astype(np.float32).astype(np.float64)
    direction = rng.normal(size=STRUCTURES + layout.config.network.geometry_features)
    table = slice(0, layout.geometry_offset)
    for size in (1e-7, 1e6):
        w = size * direction

        def reference(p, x, w=w):
            distance, feature = geometry(layout, p, x)
            return np.concatenate([distance, feature], axis=1) @ w

        coop.zero_gradients()
        coop.upload_coop_vector_network()
        struct = coop.shader_struct(geometry_network_gradients=False, coop_vectors=True)
        dx = np.asarray(coop.sdf_fit_module.geometryBackward(struct, np.float32(points), list(w), _result="numpy"),
                        dtype=np.float64).reshape(-1, 3)
        gradient = coop.gradients().astype(np.float64)
        coop.zero_gradients()
        assert np.isfinite(dx).all() and np.isfinite(gradient).all()
        assert not gradient[layout.geometry_offset :].any(), size
        assert not np.asarray(coop.coop_network("geometry").sums.to_numpy()).view(np.uint8).any()
        steps = np.eye(3)[None] * 1e-4
        numeric_dx = np.stack([(reference(params, points + steps[:, a]) - reference(params, points - steps[:, a]))
                               / 2e-4 for a in range(3)], axis=1)
        np.testing.assert_allclose(dx, numeric_dx, atol=5e-2 * np.abs(numeric_dx).max(), err_msg=str(size))
        largest = np.argsort(-np.abs(gradient[table]))[:8]
        numeric = central_difference(lambda p: reference(p, points).sum(), params, np.eye(params.size)[largest],
                                     1e-5)
        np.testing.assert_allclose(gradient[largest], numeric, rtol=5e-2, atol=5e-2 * np.abs(gradient).max(),
                                   err_msg=str(size))


@pytest.mark.gpu
@pytest.mark.parametrize("size", [1.0, 1e-6], ids=["unit_loss", "mean_loss"])
def test_the_appearance_network_on_cooperative_vectors_gives_central_differences(fields, layout, params, size):
    """The appearance network's values, its weights' gradients (their sums over the points, at the gradient scale
    of the loss's size, brought back) and biases', and its input gradient against central differences of the float
    network, within half precision: its 5 inputs padded to 8 read as zeros, and a loss whose gradients are far
    below half's smallest normal number (a mean over a batch's pixels) is summed at a scale that keeps them in
    range."""
    coop = fields[1]
    rng = np.random.default_rng(11)
    net = layout.config.network
    features = rng.normal(size=(12, net.geometry_features)).astype(np.float32).astype(np.float64)
    inputs = rng.uniform(0.0, 1.0, (12, layout.appearance_inputs)).astype(np.float32).astype(np.float64)
    w = size * rng.normal(size=STRUCTURES * (3 + net.materials))
    rows = [(list(map(float, f)), list(map(float, i))) for f, i in zip(features, inputs, strict=True)]

    def reference(p, f=features, i=inputs):
        return appearance(layout, p, f, i) @ w

    module, network = coop.sdf_fit_module, coop.coop_network("appearance")
    network.gradient_scale = coop_gradient_scale(size)
    coop.zero_gradients()
    coop.upload_coop_vector_network("appearance")
    struct = coop.shader_struct(coop_vectors=True)
    values = np.array([module.appearanceValue(struct, f, i, list(w)) for f, i in rows])
    expected = reference(params)
    np.testing.assert_allclose(values, expected, atol=2e-2 * np.abs(expected).max())
    d_inputs = np.array([list(module.appearanceBackward(struct, f, i, list(w))) for f, i in rows], np.float64)
    assert np.asarray(network.sums.to_numpy()).view(np.uint8).any()
    coop.add_coop_vector_gradients("appearance")
    gradient = coop.gradients().astype(np.float64)
    coop.zero_gradients()
    assert np.isfinite(gradient).all() and gradient[layout.appearance_offset :].any()
    assert not gradient[: layout.appearance_offset].any()

    scale = np.abs(gradient).max()
    directions = rng.normal(size=(3, params.size))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    numeric = central_difference(lambda p: reference(p).sum(), params, directions, 1e-5)
    np.testing.assert_allclose(directions @ gradient, numeric, rtol=5e-2, atol=5e-3 * scale * np.sqrt(params.size))
    # every parameter of the network, each weight's within a hundredth of the largest (without the scale, the
    # mean loss's sums of half subnormals miss by several hundredths)
    network_parameters = np.arange(layout.appearance_offset, layout.count)
    numeric = central_difference(lambda p: reference(p).sum(), params, np.eye(params.size)[network_parameters], 1e-5)
    np.testing.assert_allclose(gradient[network_parameters], numeric, atol=1e-2 * np.abs(numeric).max())

    step = 1e-4
    e_f, e_i = np.zeros_like(features), np.zeros_like(inputs)
    e_f[:, 0], e_i[:, 0] = step, step
    numeric_f = (reference(params, features + e_f) - reference(params, features - e_f)) / (2 * step)
    numeric_i = (reference(params, i=inputs + e_i) - reference(params, i=inputs - e_i)) / (2 * step)
    numeric_d = np.stack([numeric_f, numeric_i], axis=1)
    np.testing.assert_allclose(d_inputs, numeric_d, atol=5e-2 * np.abs(numeric_d).max())


@pytest.fixture(scope="module", params=[COOPVEC_FALLBACK, 1], ids=["fallback", "half_sums"])
def shaded_pair(request, gpu):
    """A per-thread field fitted to the phantom's surfaces (the sizes of test_train.py's, whose render kernels are
    compiled already), and the same field with its geometry network on cooperative vectors: their fallback, and
    the device's own where it has them."""
    from NeuralRaycastLib.study.sample.phantom import Phantom

    if request.param != COOPVEC_FALLBACK and not gpu.report.cooperative_vector:
        pytest.skip("the device has no cooperative vectors")

    phantom = Phantom(brain_tilt_degrees=(0.0, 0.0, 0.0))
    low, high = phantom.bounds(6.0)
    prepared = analytic_prepared({name: (lambda p, name=name: phantom.sdf(name, p))
                                  for name in phantom.structure_names}, 2.5, low, high)
    layout = FieldLayout.build(tiny_config(log2_table=14, coarsest_cells=8, finest_cell_mm=2.5), prepared.bounds,
                               len(prepared.structures), 1)
    per_thread = NeuralField(gpu, layout, seed=1, cooperative=False, coop_vectors=None)
    SdfFitter(gpu, prepared, per_thread, FitConfig(steps=20, batch=1 << 12, seed=1)).run()  # surfaces to shade
    coop = NeuralField(gpu, layout, per_thread.parameters(), cooperative=False, coop_vectors=request.param)
    return prepared, per_thread, coop


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.gpu
def test_the_render_and_a_training_step_on_cooperative_vectors_agree_with_the_per_thread_networks(gpu, shaded_pair):
    """The renderer's kernels with the geometry network on cooperative vectors (the fit's module): the picture of
    the per-thread kernels to half precision, and a joint training step's gradients (the image's backward pass,
    its geometry network frozen, then the SDF and Eikonal terms) and stage 2's appearance-only gradients nearly
    the same, within the tensor-core render's tolerances (test_cooperative_geometry.py)."""
    from NeuralRaycastLib.render.camera import orbit_cameras
    from NeuralRaycastLib.render.sample_buffers import OUTPUTS
    from NeuralRaycastLib.train.trainer import field_renderer

    prepared, *fields = shaded_pair
    camera = orbit_cameras(prepared.bounds, 1, 16, 16)[0]
    d_sums = np.zeros((camera.width * camera.height, OUTPUTS), np.float32)
    d_sums[:, :4] = np.random.default_rng(3).normal(size=(len(d_sums), 4))
    pictures, images, steps, appearance = [], [], [], []
    for field in fields:
        renderer = field_renderer(gpu, prepared, field, 128)
        assert renderer.scene.coop_vectors == (field.coop_vectors is not None)
        batch = renderer.camera_rays(camera)
        renderer.forward(batch)
        pictures.append(renderer.sums(batch))
        sdf = SdfFitter(gpu, prepared, field, FitConfig(batch=96, eikonal_every=2, seed=7))  # (zeroes the gradients)
        renderer.backward(batch, d_sums)
        images.append(field.gradients().astype(np.float64))
        sdf.accumulate(0, 0.5)
        steps.append(field.gradients().astype(np.float64))
        field.zero_gradients()
        renderer.backward(batch, d_sums, geometry=False)
        appearance.append(field.gradients().astype(np.float64))
        field.zero_gradients()
    assert pictures[0][:, 3].max() > 0.5
    print(f"picture: max |difference| {np.abs(pictures[1][:, :4] - pictures[0][:, :4]).max():.5f}")
    np.testing.assert_allclose(pictures[1][:, :4], pictures[0][:, :4], atol=2e-2)
    for name, (start, stop) in fields[0].layout.segments().items():
        print(f"{name}: step gradients' cosine {cosine(steps[0][start:stop], steps[1][start:stop]):.5f}")
        if name == "geometry":  # the images give the network's weights nothing; the SDF terms do
            assert not images[0][start:stop].any() and not images[1][start:stop].any()
        else:
            assert cosine(images[0][start:stop], images[1][start:stop]) > 0.99, name
        assert cosine(steps[0][start:stop], steps[1][start:stop]) > 0.99, name
        if name == "appearance":
            assert cosine(appearance[0][start:stop], appearance[1][start:stop]) > 0.99
        else:
            assert not appearance[0][start:stop].any() and not appearance[1][start:stop].any(), name


@pytest.mark.gpu
@pytest.mark.parametrize("group", ["geometry", "appearance"])
def test_a_render_on_cooperative_vectors_shows_every_change_of_a_networks_weights(gpu, shaded_pair, group):
    """Frames reuse the networks' half copies until the weights change: after set_parameters the next frame is that
    of a new field holding the new weights."""
    from NeuralRaycastLib.render.camera import orbit_cameras
    from NeuralRaycastLib.train.trainer import field_renderer

    prepared, _, shared = shaded_pair
    # a field of its own, whose weights it may change
    coop = NeuralField(gpu, shared.layout, shared.parameters(), cooperative=False, coop_vectors=shared.coop_vectors)
    camera = orbit_cameras(prepared.bounds, 1, 16, 16)[0]
    renderer = field_renderer(gpu, prepared, coop, 128)
    first = renderer.render(camera).rgba
    np.testing.assert_array_equal(renderer.render(camera).rgba, first)
    start, stop = coop.layout.segments()[group]
    values = coop.parameters()
    values[start:stop] *= 1.05
    coop.set_parameters(values)
    changed = renderer.render(camera).rgba
    assert np.abs(changed - first).max() > 1e-3
    fresh = NeuralField(gpu, coop.layout, coop.parameters(), cooperative=False, coop_vectors=coop.coop_vectors)
    new = field_renderer(gpu, prepared, fresh, 128)
    new.set_occupancy(renderer.occupancy)  # the samples where the first renderer places them
    np.testing.assert_array_equal(changed, new.render(camera).rgba)


@pytest.mark.gpu
def test_the_pretrained_appearances_render_on_cooperative_vectors_agrees_with_the_per_thread_network(gpu,
                                                                                                      shaded_pair):
    """The pretrained route's renderer (latent_scene.py) runs the field's geometry network on cooperative vectors
    where the field has them: the per-thread kernels' picture to half precision, and the fine-tune's gradients of
    the decoder and the latent grid nearly the same."""
    from NeuralRaycastLib.appearance.latent import LatentAppearance, LatentConfig
    from NeuralRaycastLib.appearance.latent_scene import latent_renderer, study_grid
    from NeuralRaycastLib.render.camera import orbit_cameras
    from NeuralRaycastLib.render.neural_render import SHADE_WEIGHT
    from NeuralRaycastLib.render.sample_buffers import OUTPUTS

    prepared, *fields = shaded_pair
    config = LatentConfig(latent=8, encoder_hidden=16, decoder_hidden=16, structures=4, materials=2)
    rng = np.random.default_rng(13)
    params = config.initial_parameters(seed=3) + rng.normal(0.0, 0.1, config.count).astype(np.float32)
    grid = study_grid(fields[0])
    codes = rng.uniform(-1.0, 1.0, (grid.vertices, config.latent)).astype(np.float16)
    camera = orbit_cameras(prepared.bounds, 1, 16, 16)[0]
    d_sums = np.zeros((camera.width * camera.height, OUTPUTS), np.float32)
    d_sums[:, :4] = rng.normal(size=(len(d_sums), 4))
    pictures, gradients = [], []
    for field in fields:
        latent = LatentAppearance(gpu, config, grid, params)
        latent.set_grid_codes(codes)
        renderer = latent_renderer(gpu, prepared, field, latent, 128, 4.0, SHADE_WEIGHT)
        assert (renderer.scene.coop_vectors is not None) == (field.coop_vectors is not None)
        pictures.append(renderer.render(camera).rgba)
        batch = renderer.camera_rays(camera)
        renderer.forward(batch)
        latent.zero_gradients()
        renderer.backward(batch, d_sums, geometry=False)
        gradients.append(np.concatenate([latent.gradients(), latent.grid_gradients().ravel()]).astype(np.float64))
    assert pictures[0][..., 3].max() > 0.5
    np.testing.assert_allclose(pictures[1], pictures[0], atol=2e-2)
    assert np.abs(gradients[0]).max() > 0
    assert cosine(gradients[0], gradients[1]) > 0.99

def test_a_warm_up_with_the_cooperative_vectors_switched_off_does_not_stand_for_one_with_them(
        monkeypatch, tmp_path, phantom_study_dir):
    """NEURALRAYCAST_COOPVEC chooses the kernels the fit and the renderer run, so it is part of the warm-up's key."""
    from types import SimpleNamespace

    from NeuralRaycastLib.gpu.device import COOPVEC_ENV
    from NeuralRaycastLib.study.study import load_study
    from NeuralRaycastLib.train import warmup
    from NeuralRaycastLib.train.presets import RunSettings
    from NeuralRaycastLib.train.run_folder import prepare_for_run

    settings = RunSettings("standard")
    prepared = prepare_for_run(load_study(phantom_study_dir), settings)
    gpu = SimpleNamespace(backend="vulkan", report=SimpleNamespace(
        software=False, shader_cache=str(tmp_path), slangpy_version="0.43.1", adapter="a GPU"))
    monkeypatch.delenv(COOPVEC_ENV, raising=False)
    keys = [warmup.kernels_key(gpu, prepared, settings)]
    for setting in ("0", "float"):
        monkeypatch.setenv(COOPVEC_ENV, setting)
        keys.append(warmup.kernels_key(gpu, prepared, settings))
    assert len(set(keys)) == 3
