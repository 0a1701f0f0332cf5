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

from NeuralRaycastLib.field import field as field_module
from NeuralRaycastLib.field.field import FieldConfig, FieldLayout, NetworkConfig, NeuralField
from NeuralRaycastLib.field.sdf_fit import FitConfig, SdfFitter, band_errors
from NeuralRaycastLib.study.sample.phantom import voxel_centres

pytestmark = pytest.mark.gpu

SPACING = 2.0


@pytest.fixture(scope="module")
def cuda(gpu):
    if gpu.backend != "cuda":
        pytest.skip("needs CUDA (tensor cores)")
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


NETWORK_KERNELS = """
import params;
import mma_mlp;
typealias Net = MmaMlp<SIZES>;

int tiledCount() { return Net.TiledCount; }
void toTiled(int thread, int threads, float* rowMajor, float* tiled)
{
    Net.toTiled(rowMajor, tiled, uint(thread), uint(threads));
}
void fromTiled(int thread, int threads, float* tiled, float* rowMajor)
{
    Net.fromTiled(tiled, rowMajor, uint(thread), uint(threads));
}
// One thread per row (whole waves): the input gradient for dy, with the weights frozen (the geometry
// network's pass in the renderer's backward) or through the backward pass that also adds the weights'
// gradients to `grads`.
void inputGradient(int row, int frozen, float* tiled, float* grads, float* xs, float* dys, float* dxs)
{
    float x[INPUTS];
    for (int i = 0; i < INPUTS; i++)
        x[i] = xs[row * INPUTS + i];
    float dy[OUTPUTS];
    for (int o = 0; o < OUTPUTS; o++)
        dy[o] = dys[row * OUTPUTS + o];
    Params p = { tiled, grads };
    var pair = diffPair(x);
    if (frozen != 0)
        Net.frozenBackward(p, pair, dy);
    else
        Net.backward(p, pair, dy);
    for (int i = 0; i < INPUTS; i++)
        dxs[row * INPUTS + i] = pair.d[i];
}
"""


def network_case(cuda, sizes: tuple[int, int, int, int], seed: int):
    """NETWORK_KERNELS for a network of these sizes (inputs, hidden, outputs, hidden layers), random weights
    (row-major with their biases, layer by layer), 256 rows of inputs and output gradients, and two helpers
    making device buffers (of values, of zeros)."""
    import slangpy as spy

    inputs, hidden, outputs, layers = sizes
    module = spy.Module.load_from_source(cuda.device, f"mma_mlp_{'_'.join(map(str, sizes))}",
                                         NETWORK_KERNELS.replace("SIZES", ", ".join(map(str, sizes)))
                                         .replace("INPUTS", str(inputs)).replace("OUTPUTS", str(outputs)))
    rng = np.random.default_rng(seed)
    shapes = [(hidden, inputs)] + [(hidden, hidden)] * (layers - 1) + [(outputs, hidden)]
    weights = [(rng.normal(size=shape) / np.sqrt(shape[1]), rng.normal(size=shape[0]) * 0.1) for shape in shapes]
    row_major = np.concatenate([np.concatenate([w.ravel(), b]) for w, b in weights]).astype(np.float32)
    xs = rng.normal(size=(256, inputs)).astype(np.float32)
    dys = rng.normal(size=(256, outputs)).astype(np.float32)

    def buffer(values):
        return spy.Tensor.from_numpy(cuda.device, np.ascontiguousarray(values, np.float32).ravel())

    def zeros(count):
        return spy.Tensor.zeros(cuda.device, shape=(int(count),), dtype=float)

    return module, weights, row_major, xs, dys, buffer, zeros


@pytest.mark.parametrize("sizes", [(16, 32, 7, 1), (32, 64, 19, 2), (20, 64, 20, 1)])
def test_frozen_backward_gives_the_input_gradient(cuda, sizes):
    """The renderer's backward with the geometry weights frozen (MmaMlp.frozenBackward: no weight gradients)
    gives the input gradient of the network as numpy computes it in float64 from the same weights, to half
    precision and as the backward pass that trains the weights does, and leaves the gradient buffer alone.
    Sizes: the small test field's geometry network, the default geometry and appearance networks (20 inputs:
    not a whole number of 16-wide tiles)."""
    import slangpy as spy

    module, weights, row_major, xs, dys, buffer, zeros = network_case(cuda, sizes, seed=7)
    inputs, rows = sizes[0], len(xs)
    source, tiled, grads = buffer(row_major), zeros(module.tiledCount()), zeros(module.tiledCount())
    threads = 1024
    module.toTiled(spy.grid((threads,)), threads, source.storage.device_address, tiled.storage.device_address)
    x_buffer, dy_buffer = buffer(xs), buffer(dys)
    results = []
    for frozen in (1, 0):
        dxs = zeros(rows * inputs)
        module.inputGradient(spy.grid((rows,)), frozen, tiled.storage.device_address, grads.storage.device_address,
                             x_buffer.storage.device_address, dy_buffer.storage.device_address,
                             dxs.storage.device_address)
        results.append(dxs.to_numpy().reshape(rows, inputs).astype(np.float64))
        if frozen:
            assert not grads.to_numpy().any()  # no weight gradient formed
    assert grads.to_numpy().any()  # the training backward pass forms them

    activations, h = [], xs.astype(np.float64)
    for w, b in weights[:-1]:
        h = np.maximum(w @ h.T + b[:, None], 0.0).T
        activations.append(h)
    g = dys.astype(np.float64) @ weights[-1][0]
    for (w, _), on in zip(reversed(weights[:-1]), reversed(activations), strict=True):
        g = (g * (on > 0)) @ w
    errors = [np.linalg.norm(result - g) / np.linalg.norm(g) for result in results]
    apart = np.linalg.norm(results[0] - results[1]) / np.linalg.norm(results[1])
    print(f"{sizes}: relative difference from float64, frozen {errors[0]:.2e}, training backward {errors[1]:.2e}; "
          f"between them {apart:.2e}")
    assert max(errors) < 0.1  # half-precision operands, as test_tensor_core_loss_and_gradients_... allows
    assert apart < 1e-6  # the same input gradient either way


def appearance_parameter_gradient(parameters: np.ndarray, layout: FieldLayout, features: np.ndarray,
                                  inputs: np.ndarray, w: np.ndarray) -> np.ndarray:
    """d/dparameters of Σ_rows Σ_j w_j σ(raw_j), raw the appearance network's outputs, in float64: what
    field_checks.slang's appearanceRows accumulates (the network's row-major layout: W1, b1, W2, b2)."""
    hidden, outputs = layout.config.network.appearance_hidden, len(w)
    x = np.concatenate([features, inputs], axis=1).astype(np.float64)
    p = parameters.astype(np.float64)
    w1 = p[: hidden * x.shape[1]].reshape(hidden, x.shape[1])
    b1 = p[w1.size: w1.size + hidden]
    w2 = p[w1.size + hidden: w1.size + hidden + outputs * hidden].reshape(outputs, hidden)
    b2 = p[w1.size + hidden + w2.size:]
    z = x @ w1.T + b1
    h = np.maximum(z, 0.0)
    s = 1.0 / (1.0 + np.exp(-(h @ w2.T + b2)))
    d_raw = w * s * (1.0 - s)
    d_z = (d_raw @ w2) * (z > 0)
    return np.concatenate([(d_z.T @ x).ravel(), d_z.sum(0), (d_raw.T @ h).ravel(), d_raw.sum(0)])


def gradient_cosines(exact: np.ndarray, gradient: np.ndarray, blocks: np.ndarray) -> list[float]:
    """The cosine between two gradients over each block (blocks: an index per parameter)."""
    return [float(exact[blocks == b] @ gradient[blocks == b]
                  / (np.linalg.norm(exact[blocks == b]) * np.linalg.norm(gradient[blocks == b])))
            for b in range(blocks.max() + 1)]


def mlp_blocks(inputs: int, hidden: int, outputs: int, hidden_layers: int) -> np.ndarray:
    """Block of every parameter of an Mlp (row-major weights, then biases, layer by layer): 2 per layer."""
    sizes = [inputs] + [hidden] * hidden_layers + [outputs]
    return np.concatenate([np.repeat([2 * layer, 2 * layer + 1], [sizes[layer + 1] * sizes[layer], sizes[layer + 1]])
                           for layer in range(len(sizes) - 1)])


@pytest.fixture(scope="module")
def appearance_case(cuda, phantom):
    """The default network on the phantom's layout, a per-thread field, a tensor-core one with the same
    parameters, and rows of random geometry features and local inputs."""
    prepared = phantom[1]
    layout = FieldLayout.build(config_for(full_network=True), prepared.bounds, len(prepared.structures),
                               len(prepared.channel_names))
    parts = ("sdf_fit", "field_checks")
    scalar = NeuralField(cuda, layout, seed=3, parts=parts, cooperative=False)
    cooperative = NeuralField(cuda, layout, seed=3, parts=parts)
    rng = np.random.default_rng(11)
    rows = 512
    features = rng.normal(size=(rows, layout.config.network.geometry_features)).astype(np.float32)
    inputs = rng.uniform(0.0, 1.0, (rows, layout.appearance_inputs)).astype(np.float32)
    w = rng.normal(size=layout.structures * (3 + layout.config.network.materials))
    return layout, scalar, cooperative, features, inputs, w


def appearance_rows(cuda, field, module, features, inputs, w, cooperative: bool):
    """Values, d/dfeature[0] per row and the field's parameter gradients of field_checks's appearanceRows."""
    import slangpy as spy

    buffers = [spy.Tensor.from_numpy(cuda.device, a.ravel()) for a in (features, inputs)]
    field.zero_gradients()
    if cooperative:
        field.upload_tiled_networks()
    struct = field.shader_struct(cooperative=cooperative)
    results = []
    for backward in (0, 1):
        out = spy.Tensor.zeros(cuda.device, shape=(len(features),), dtype=float)
        module.appearanceRows(spy.grid((len(features),)), struct, *[b.storage.device_address for b in buffers],
                              list(map(float, w)), backward, out.storage.device_address)
        results.append(out.to_numpy().astype(np.float64))
    if cooperative:
        field.add_tiled_gradients()
    return (*results, field.gradients().astype(np.float64))


def test_tensor_core_appearance_forward_and_the_trained_gradients(cuda, appearance_case):
    """The appearance network on tensor cores gives the per-thread network's values, and in both kinds of
    kernels that train it on CUDA (the SDF fit's and the renderer's backward, frozen_module) the parameter
    gradients numpy computes in float64, block by block, once NeuralField.add_tiled_gradients has brought
    them back (before they were put in the weights' tiled order their weights' cosines with float64 were
    0.51-0.67 on an H100, biases exact)."""
    layout, scalar, cooperative, features, inputs, w = appearance_case
    parts = ("sdf_fit", "field_checks")
    fit = field_module.load_field_module(cuda, layout, parts, cooperative=True)
    frozen = field_module.load_field_module(cuda, layout, parts, frozen_geometry=True)
    values_a, d_a, grads_a = appearance_rows(cuda, scalar, scalar.module, features, inputs, w, False)
    start = layout.appearance_offset
    exact = appearance_parameter_gradient(scalar.parameters()[start:], layout, features, inputs, w)
    net = layout.config.network
    blocks = mlp_blocks(net.geometry_features + layout.appearance_inputs, net.appearance_hidden, len(w), 1)
    cosines = gradient_cosines(exact, grads_a[start:], blocks)
    print("appearance parameter gradients per thread: cosines with float64 (W1, b1, W2, b2) "
          + ", ".join(f"{c:.6f}" for c in cosines))
    assert min(cosines) > 0.99999
    for label, module in (("SDF fit kernels", fit), ("renderer's backward kernels", frozen)):
        values, d, grads = appearance_rows(cuda, cooperative, module, features, inputs, w, True)
        np.testing.assert_allclose(values, values_a, atol=2e-2 * np.abs(values_a).max(), err_msg=label)
        # half-precision operands on the way back too: one row in 512 has been 6 % off
        apart = np.linalg.norm(d - d_a) / np.linalg.norm(d_a)
        print(f"{label}: d/dfeature relative difference from per thread {apart:.2e}")
        assert apart < 2e-2, label
        np.testing.assert_allclose(d, d_a, atol=5e-2 * np.abs(d_a).max(), err_msg=label)
        assert not grads[:start].any(), label
        cosines = gradient_cosines(exact, grads[start:], blocks)
        print(f"appearance parameter gradients on tensor cores, {label}: cosines with float64 (W1, b1, W2, b2) "
              + ", ".join(f"{c:.5f}" for c in cosines))
        assert min(cosines) > 0.995, label


def test_tensor_core_geometry_weight_gradients_layer_by_layer(cuda, appearance_case):
    """The geometry network's parameter gradients on tensor cores (the SDF fit's kernels) against the per-thread
    network's, on random points through the hash encoding: the hash table, then each layer's weights and biases
    apart (the group as a whole can hide a layer whose gradients are wrong)."""
    import slangpy as spy

    layout, scalar, cooperative, _, _, _ = appearance_case
    module = field_module.load_field_module(cuda, layout, ("sdf_fit", "field_checks"), cooperative=True)
    rng = np.random.default_rng(12)
    low, high = np.asarray(layout.origin), np.asarray(layout.origin) + np.asarray(layout.extent)
    points = rng.uniform(low, high, (2048, 3)).astype(np.float32)
    w = list(map(float, rng.normal(size=layout.structures + layout.config.network.geometry_features)))
    buffer = spy.Tensor.from_numpy(cuda.device, points.ravel())
    gradients = []
    for field, kernels, tensor_cores in ((scalar, scalar.module, False), (cooperative, module, True)):
        field.zero_gradients()
        if tensor_cores:
            field.upload_tiled_networks()
        out = spy.Tensor.zeros(cuda.device, shape=(len(points),), dtype=float)
        kernels.geometryRows(spy.grid((len(points),)), field.shader_struct(cooperative=tensor_cores),
                             buffer.storage.device_address, w, 1, out.storage.device_address)
        if tensor_cores:
            field.add_tiled_gradients()
        gradients.append(field.gradients().astype(np.float64))
    start, stop = layout.geometry_offset, layout.appearance_offset
    net, encoding = layout.config.network, layout.config.encoding
    network = mlp_blocks(encoding.levels * encoding.features, net.hidden, layout.structures + net.geometry_features,
                         net.hidden_layers)
    blocks = np.concatenate([np.zeros(start, dtype=int), 1 + network])
    cosines = gradient_cosines(gradients[0][:stop], gradients[1][:stop], blocks)
    print("geometry gradients on tensor cores against per thread: cosines (table, W1, b1, W2, b2, W3, b3) "
          + ", ".join(f"{c:.5f}" for c in cosines))
    assert min(cosines) > 0.995


@pytest.mark.parametrize("sizes", [(16, 32, 7, 1), (32, 64, 19, 2), (20, 64, 20, 1)])
def test_tensor_core_weight_gradients_match_float64(cuda, sizes):
    """The tensor-core backward pass adds the weight gradients in the lanes' tiles: made row-major
    (fromTiled), every layer's weight and bias gradients are numpy's float64 ones, to half precision."""
    import slangpy as spy

    module, weights, row_major, xs, dys, buffer, zeros = network_case(cuda, sizes, seed=8)
    inputs, rows = sizes[0], len(xs)
    threads = 1024
    source, tiled, grads = buffer(row_major), zeros(module.tiledCount()), zeros(module.tiledCount())
    # held in names until the kernels ran: a buffer made in the argument list would be freed (and its memory
    # handed to the next one) as soon as its address was read
    x_buffer, dy_buffer, dxs = buffer(xs), buffer(dys), zeros(rows * inputs)
    module.toTiled(spy.grid((threads,)), threads, source.storage.device_address, tiled.storage.device_address)
    module.inputGradient(spy.grid((rows,)), 0, tiled.storage.device_address, grads.storage.device_address,
                         x_buffer.storage.device_address, dy_buffer.storage.device_address, dxs.storage.device_address)
    out = zeros(row_major.size)
    module.fromTiled(spy.grid((threads,)), threads, grads.storage.device_address, out.storage.device_address)
    result = out.to_numpy().astype(np.float64)

    layer_inputs, h = [xs.astype(np.float64)], xs.astype(np.float64)
    for w, b in weights[:-1]:
        h = np.maximum(h @ w.T + b, 0.0)
        layer_inputs.append(h)
    g, exact = dys.astype(np.float64), []
    for (w, _), x in zip(reversed(weights), reversed(layer_inputs), strict=True):
        exact.insert(0, np.concatenate([(g.T @ x).ravel(), g.sum(0)]))
        g = (g @ w) * (x > 0)
    exact, blocks = np.concatenate(exact), mlp_blocks(*sizes)
    cosines = gradient_cosines(exact, result, blocks)
    print(f"{sizes}, weight gradients: cosines with float64 (weights, biases per layer) "
          + ", ".join(f"{c:.5f}" for c in cosines))
    assert min(cosines) > 0.999


def test_cooperative_can_be_switched_off(cuda, monkeypatch, phantom):
    monkeypatch.setenv(field_module.COOPERATIVE_ENV, "0")
    layout = FieldLayout.build(tiny_config(), phantom[1].bounds, 4, 1)
    assert not NeuralField(cuda, layout).cooperative


def test_tensor_core_render_matches_the_per_thread_render(cuda, phantom):
    """The renderer's kernels over whole waves with the geometry network on tensor cores: the same picture
    as the per-thread kernels to half precision, and nearly the same gradients for the hash table and the
    appearance network; the geometry network gets none from the images on either path (field_scene.py).
    With the geometry frozen (stage 2) only the appearance network gets gradients, nearly the same too."""
    from NeuralRaycastLib.render.camera import orbit_cameras
    from NeuralRaycastLib.render.sample_buffers import OUTPUTS
    from NeuralRaycastLib.train.trainer import field_renderer

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


def test_a_tensor_core_render_shows_every_change_of_the_weights(cuda, phantom):
    """Frames of a finished field reuse the weights' tensor-core copy; a change through set_parameters or an
    Adam step shows in the next frame, which is then the frame of a new field holding those weights."""
    from NeuralRaycastLib.field.sdf_fit import Adam
    from NeuralRaycastLib.render.camera import orbit_cameras
    from NeuralRaycastLib.train.trainer import field_renderer

    prepared = phantom[1]
    _scalar, field = paired_fields(cuda, prepared, config_for(full_network=True))
    SdfFitter(cuda, prepared, field, FitConfig(steps=200, batch=1 << 15, seed=1)).run()
    camera = orbit_cameras(prepared.bounds, 1, 48, 40)[0]
    renderer = field_renderer(cuda, prepared, field, 192)

    def frame_of_a_new_field() -> np.ndarray:
        fresh = NeuralField(cuda, field.layout, parameters=field.parameters())
        return field_renderer(cuda, prepared, fresh, 192).render(camera).rgba

    first = renderer.render(camera).rgba
    assert first[..., 3].max() > 0.5
    np.testing.assert_array_equal(renderer.render(camera).rgba, first)
    start, stop = field.layout.segments()["appearance"]
    values = field.parameters()
    values[start:stop] *= 1.5
    field.set_parameters(values)
    changed = renderer.render(camera).rgba
    assert np.abs(changed - first).max() > 1e-2
    np.testing.assert_array_equal(changed, frame_of_a_new_field())
    gradients = np.zeros(field.layout.gradient_count, np.float32)
    gradients[start:stop] = 1.0  # (the geometry, and so the renderer's occupancy, stays as it is)
    field.grads.copy_from_numpy(gradients)
    Adam(cuda, field, FitConfig(rate_appearance=1e-2)).step()
    stepped = renderer.render(camera).rgba
    assert np.abs(stepped - changed).max() > 1e-3
    np.testing.assert_array_equal(stepped, frame_of_a_new_field())
