"""Slang's portable cooperative matrices (linalg.CoopMat: KHR cooperative matrix on Vulkan, WMMA on CUDA,
simdgroup matrices on Metal) on a device, against a thread a row, both checked against numpy, with the time of
each: tile products (TILE x TILE x TILE, half operands, float sums), and a 32-64-64-32 ReLU network evaluated a
wave of 32 points at once (tools/coop_probe.slang). A device that reports no cooperative matrices may still
build the kernels and return wrong values (lavapipe): the error column says so.

Usage: python tools/coop_probe.py vulkan|cuda [waves]"""

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


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 14)
