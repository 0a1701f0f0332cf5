"""Slang's portable cooperative matrices (linalg.CoopMat: KHR cooperative matrix on Vulkan, WMMA on CUDA,
simdgroup matrices on Metal) on a device, against a thread a row, both checked against numpy, with the time of
each: tile products (TILE x TILE x TILE, half operands, float sums), and a 32-64-64-32 ReLU network evaluated a
wave of 32 points at once (tools/coop_probe.slang). A device that reports no cooperative matrices may still
build the kernels and return wrong values (lavapipe): the error column says so.

Then Slang's cooperative vectors (CoopVec; SPV_NV_cooperative_vector on Vulkan) on the SDF fit's geometry network
shape (32 -> 64 -> 64 -> 24, ReLU, biases), a point a thread: forward, and forward + backward (the input's
gradient through the transposed weights, the weights' by outer-product accumulation in the training-optimal
layout, the biases' by reduce-sum accumulation, all in half) against shaders/mlp.slang's per-thread network
(float, its gradients as the fit sends them), each checked against numpy, with points/s. Slang emits the
cooperative-vector instructions for every SPIR-V target, with no per-thread fallback: a Vulkan device without
the feature (lavapipe) cannot create the pipeline, and the line says so.

Usage: python tools/coop_probe.py vulkan|cuda [waves] [network points]"""

import sys
import time
from pathlib import Path

import numpy as np
import slangpy as spy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from NeuralRaycastLib.gpu.device import open_device  # noqa: E402

SOURCE = Path(__file__).with_name("coop_probe.slang")
TILE = 16  # Vulkan's and CUDA's tile (Metal's is 8)


def timed(device, kernel, threads: int, args, repeats: int) -> float:
    """Seconds a call of ``kernel`` over ``threads`` threads takes, after one call that builds it."""
    kernel(spy.grid((threads,)), *args)
    device.wait()
    start = time.perf_counter()
    for _ in range(repeats):
        kernel(spy.grid((threads,)), *args)
    device.wait()
    return (time.perf_counter() - start) / repeats


def report(name: str, device, kernel, threads: int, args, result, expected: np.ndarray, flops: float,
           repeats: int) -> None:
    try:
        seconds = timed(device, kernel, threads, args, repeats)
    except Exception as error:  # report and go on: the other kernels' numbers still count
        print(f"  {name}: failed: {str(error).splitlines()[0][:300]}")
        return
    got = np.asarray(result.to_numpy()).reshape(expected.shape)
    error = float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-30))
    print(f"  {name}: {flops / seconds / 1e9:.1f} GFLOP/s, {seconds * 1e3:.3f} ms a call, "
          f"max error {error:.1e} of the largest value")


def half_relu(values: np.ndarray) -> np.ndarray:
    return np.maximum(values, 0.0).astype(np.float16).astype(np.float32)


def run(backend: str, waves: int, repeats: int = 20) -> None:
    gpu = open_device(backend)
    device = gpu.device
    print(f"{backend}: {gpu.report.adapter}; cooperative matrix {gpu.report.cooperative_matrix}, "
          f"cooperative vector {gpu.report.cooperative_vector}")
    module = gpu.load_module_from_source("coop_probe", f"#define TILE {TILE}\n" + SOURCE.read_text())
    rng = np.random.default_rng(0)

    def upload(values: np.ndarray):
        return spy.Tensor.from_numpy(device, np.ascontiguousarray(values).reshape(-1))

    def zeros(count: int):
        return spy.Tensor.zeros(device, shape=(count,), dtype=float)

    a = rng.uniform(-1, 1, (waves, TILE, TILE)).astype(np.float16)
    b = rng.uniform(-1, 1, (TILE, TILE)).astype(np.float16)
    expected = a.astype(np.float32) @ b.astype(np.float32)
    buffers = [upload(a), upload(b)]
    for name, threads in (("tile product, a thread a row", waves * TILE), ("tile product, cooperative", waves * 32)):
        c = zeros(waves * TILE * TILE)
        kernel = module.rowProducts if "row" in name else module.tileProducts
        args = [t.storage.device_address for t in (*buffers, c)]
        report(name, device, kernel, threads, args, c, expected, 2.0 * waves * TILE ** 3, repeats)

    points = 32 * waves
    x = rng.uniform(-1, 1, (points, 32)).astype(np.float16)
    weights = [(rng.normal(0, np.sqrt(2 / k), (n, k))).astype(np.float16) for k, n in ((32, 64), (64, 64), (64, 32))]
    h = half_relu(x.astype(np.float32) @ weights[0].astype(np.float32).T)
    h = half_relu(h @ weights[1].astype(np.float32).T)
    expected = h @ weights[2].astype(np.float32).T
    buffers = [upload(x)] + [upload(w) for w in weights]
    flops = 2.0 * points * (32 * 64 + 64 * 64 + 64 * 32)
    for name, kernel in (("network, a thread a point", module.mlpRows), ("network, cooperative", module.mlpTiles)):
        y = zeros(points * 32)
        args = [t.storage.device_address for t in (*buffers, y)]
        report(name, device, kernel, points, args, y, expected, flops, repeats)


NET = (32, 64, 64, 24)  # tools/coop_probe.slang's NET_IN, NET_HID, NET_HID, NET_OUT


def network_parameters(rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """The probe network's float parameters in mlp.slang's order (each layer's row-major weights, then its
    biases), and the layers as (W, b), the weights rounded to half as the cooperative vectors read them."""
    flat, layers = [], []
    for k, n in zip(NET[:-1], NET[1:], strict=True):
        w = rng.normal(0, np.sqrt(2 / k), (n, k)).astype(np.float16).astype(np.float32)
        b = rng.uniform(-0.1, 0.1, n).astype(np.float16).astype(np.float32)
        flat += [w.reshape(-1), b]
        layers.append((w, b))
    return np.concatenate(flat), layers


def network_reference(layers, x: np.ndarray, dy: np.ndarray, half: bool) -> tuple[np.ndarray, ...]:
    """y, dx and the parameters' gradients (mlp.slang's order) of the ReLU network, summed over the points;
    ``half``: every layer's result rounded to half, as the cooperative vectors keep them."""
    def rounded(values):
        return values.astype(np.float16).astype(np.float32) if half else values

    inputs, value = [], rounded(x)
    for index, (w, b) in enumerate(layers):
        inputs.append(value)
        value = rounded(value @ w.T + b)
        if index < len(layers) - 1:
            value = np.maximum(value, 0.0)
    y, d, grads = value, rounded(dy), []
    for index in reversed(range(len(layers))):
        w, _ = layers[index]
        grads = [(d.T @ inputs[index]).reshape(-1), d.sum(axis=0)] + grads
        d = rounded(d @ w)
        if index > 0:
            d = np.where(inputs[index] > 0, d, 0.0)
    return y, d, np.concatenate(grads)


def relative(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-30))


def coop_vec_gradients(device, layouts: list[tuple[int, int]], kind):
    """A zeroed gradient buffer for the cooperative vectors: each layer's weights (training-optimal matrices
    of ``kind``, 64-byte aligned) then its biases (half); and the CoopVecGradients struct pointing into it."""
    import slangpy as spy

    offsets, biases, at = [], [], 0
    for rows, cols in layouts:
        offsets.append(at)
        at += -(-device.get_coop_vec_matrix_size(rows, cols, spy.CoopVecMatrixLayout.training_optimal,
                                                  kind) // 64) * 64
    for rows, _ in layouts:
        biases.append(at)
        at += -(-rows * 2 // 64) * 64
    usage = spy.BufferUsage.shader_resource | spy.BufferUsage.unordered_access
    buffer = device.create_buffer(size=at, usage=usage, data=np.zeros(at, np.uint8))
    return buffer, {"buffer": buffer, "weights": offsets, "biases": biases}


def coop_vec_gradients_read(device, buffer, struct: dict, layouts: list[tuple[int, int]], kind) -> np.ndarray:
    """The gradients of coop_vec_gradients' buffer in mlp.slang's order, the weights converted to row-major."""
    import slangpy as spy

    usage = spy.BufferUsage.shader_resource | spy.BufferUsage.unordered_access
    numpy_kind = np.float16 if kind == spy.DataType.float16 else np.float32
    parts = []
    for (rows, cols), offset, bias in zip(layouts, struct["weights"], struct["biases"], strict=True):
        size = rows * cols * np.dtype(numpy_kind).itemsize
        target = device.create_buffer(size=size, usage=usage, data=np.zeros(size, np.uint8))
        encoder = device.create_command_encoder()
        encoder.convert_coop_vec_matrix(
            target, device.create_coop_vec_matrix_desc(rows, cols, spy.CoopVecMatrixLayout.row_major, kind),
            buffer, device.create_coop_vec_matrix_desc(rows, cols, spy.CoopVecMatrixLayout.training_optimal,
                                                       kind, offset))
        device.submit_command_buffer(encoder.finish())
        device.wait()
        parts.append(target.to_numpy().view(numpy_kind).astype(np.float32).reshape(-1))
        raw = buffer.to_numpy().view(np.uint8)[bias:bias + rows * 2]
        parts.append(raw.view(np.float16).astype(np.float32))
    order = [p for pair in zip(parts[0::2], parts[1::2], strict=True) for p in pair]
    return np.concatenate(order)


def network_run(name: str, device, call, threads: int, outputs, expected, repeats: int) -> None:
    """One network kernel timed (points/s) and its outputs' largest errors against numpy's, on one line."""
    try:
        call(threads)
        device.wait()
        start = time.perf_counter()
        for _ in range(repeats):
            call(threads)
        device.wait()
        seconds = (time.perf_counter() - start) / repeats
    except Exception as error:  # report and go on: the other variants' numbers still count
        print(f"  {name}: failed: {' '.join(str(error).split())[:300]}")
        return
    pairs = zip(*outputs, expected, strict=True)
    errors = ", ".join(f"{what} {relative(got(), want):.1e}" for what, got, want in pairs)
    print(f"  {name}: {threads / seconds / 1e6:.2f} M points/s ({seconds * 1e3:.3f} ms a call); "
          f"max error of the largest value: {errors}")


def run_coop_vec(backend: str, points: int, repeats: int = 10) -> None:
    """The per-thread network and the cooperative-vector one on ``points`` points: forward, and forward +
    backward; their errors from a check on 1024 points (gradients summed in half need small sums)."""
    import slangpy as spy

    gpu = open_device(backend)
    device = gpu.device
    print(f"cooperative vectors, network {'-'.join(map(str, NET))}, {points} points "
          f"(device feature cooperative_vector: {gpu.report.cooperative_vector})")
    module = gpu.load_module_from_source("coop_probe_vec", f"#define TILE {TILE}\n" + SOURCE.read_text())
    rng = np.random.default_rng(1)
    values, layers = network_parameters(rng)
    assert values.size == int(module.coopVecParameterCount())
    check = 1024
    x = rng.uniform(-1, 1, (points, NET[0])).astype(np.float16).astype(np.float32)
    dy = rng.normal(0, 1.0 / check, (points, NET[-1])).astype(np.float32)
    y_float, dx_float, g_float = network_reference(layers, x[:check], dy[:check], half=False)
    y_half, dx_half, g_half = network_reference(layers, x[:check], dy[:check], half=True)

    def tensor(a: np.ndarray):
        return spy.Tensor.from_numpy(device, np.ascontiguousarray(a).reshape(-1))

    tx, tdy, tw = tensor(x), tensor(dy), tensor(values)
    half_weights = tensor(values.astype(np.float16))
    y = spy.Tensor.zeros(device, shape=(points * NET[-1],), dtype=float)
    dx = spy.Tensor.zeros(device, shape=(points * NET[0],), dtype=float)
    grads = spy.Tensor.zeros(device, shape=(values.size,), dtype=float)
    params = {"values": tw.storage.device_address, "grads": grads.storage.device_address}
    a = {t: t.storage.device_address for t in (tx, tdy, y, dx, half_weights)}

    def read(t, width):
        return lambda: t.to_numpy().reshape(-1, width)[:check]

    network_run("forward, per thread (float)", device,
                lambda n: module.threadForward(spy.grid((n,)), params, a[tx], a[y]), points,
                (["y"], [read(y, NET[-1])]), [y_float], repeats)
    network_run("forward + backward, per thread (float)", device,
                lambda n: module.threadStep(spy.grid((n,)), params, a[tx], a[tdy], a[dx]), points,
                (["dx"], [read(dx, NET[0])]), [dx_float], repeats)
    grads.copy_from_numpy(np.zeros(values.size, np.float32))
    module.threadStep(spy.grid((check,)), params, a[tx], a[tdy], a[dx])
    error = relative(grads.to_numpy(), g_float)
    print(f"    per-thread parameter gradients on {check} points: max error {error:.1e}")
    if not gpu.report.cooperative_vector:
        print("    this device has no cooperative vectors: its Vulkan driver cannot create the pipelines below")
    network_run("forward, cooperative vectors (half)", device,
                lambda n: module.coopVecForward(spy.grid((n,)), a[half_weights], a[tx], a[y]), points,
                (["y"], [read(y, NET[-1])]), [y_half], repeats)
    layouts = list(zip(NET[1:], NET[:-1], strict=True))
    for kind, name in ((spy.DataType.float16, "Float16"), (spy.DataType.float32, "Float32")):
        module = gpu.load_module_from_source(f"coop_probe_vec_{name}", f"#define TILE {TILE}\n"
                                             f"#define COOPVEC_GRADIENTS {name}\n" + SOURCE.read_text())
        label = f"forward + backward, cooperative vectors (half, weights' gradients summed in {name})"
        try:
            buffer, struct = coop_vec_gradients(device, layouts, kind)
        except Exception as error:
            print(f"  {label}: no gradient buffer: {' '.join(str(error).split())[:300]}")
            continue
        network_run(label, device,
                    lambda n, m=module, s=struct: m.coopVecStep(spy.grid((n,)), a[half_weights], s, a[tx], a[tdy],
                                                                 a[dx]),
                    points, (["dx"], [read(dx, NET[0])]), [dx_half], repeats)
        try:
            buffer, struct = coop_vec_gradients(device, layouts, kind)
            module.coopVecStep(spy.grid((check,)), a[half_weights], struct, a[tx], a[tdy], a[dx])
            got = coop_vec_gradients_read(device, buffer, struct, layouts, kind)
            print(f"    its parameter gradients on {check} points: max error {relative(got, g_half):.1e}")
        except Exception as error:
            print(f"    its parameter gradients: failed: {' '.join(str(error).split())[:300]}")


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 14)
    run_coop_vec(sys.argv[1], int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 20)
