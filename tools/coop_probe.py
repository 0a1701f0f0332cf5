"""Tiles of C = A B (16 x 16 x 16, half operands, fp32 sums) on the device: through Slang's portable cooperative
matrices (linalg.CoopMat: KHR cooperative matrix on Vulkan, WMMA on CUDA) and through per-thread loops, checked
against numpy, with the time of each. Usage: python tools/coop_probe.py vulkan|cuda [tiles]"""

import sys
import time
from pathlib import Path

import numpy as np
import slangpy as spy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from NeuralRaycastLib.gpu.device import open_device  # noqa: E402

SOURCE = """
typealias TileA = linalg.CoopMat<half, MemoryScope.Subgroup, 16, 16, linalg.CoopMatMatrixUse.MatrixA>;
typealias TileB = linalg.CoopMat<half, MemoryScope.Subgroup, 16, 16, linalg.CoopMatMatrixUse.MatrixB>;
typealias TileC = linalg.CoopMat<float, MemoryScope.Subgroup, 16, 16, linalg.CoopMatMatrixUse.MatrixAccumulator>;

// One tile a wave: C[t] = A[t] B (every lane of the wave calls this together).
void tileProducts(int thread, half* a, half* b, float* c)
{
    int tile = thread / 32;
    let mb = TileB.Load<linalg.CoopMatMatrixLayout.RowMajor>(b, 0, 16);
    let ma = TileA.Load<linalg.CoopMatMatrixLayout.RowMajor>(a, uint(tile * 256), 16);
    TileC mc = TileC(0.0f);
    mc = linalg.coopMatMulAdd<float, false, half, half, float, MemoryScope.Subgroup, 16, 16, 16>(ma, mb, mc);
    mc.Store<linalg.CoopMatMatrixLayout.RowMajor>(c, uint(tile * 256), 16);
}

// The same, a thread a row of C.
void rowProducts(int thread, half* a, half* b, float* c)
{
    for (int j = 0; j < 16; j++)
    {
        float sum = 0.0f;
        for (int k = 0; k < 16; k++)
            sum += float(a[thread * 16 + k]) * float(b[k * 16 + j]);
        c[thread * 16 + j] = sum;
    }
}
"""


def run(backend: str, tiles: int = 1 << 16, repeats: int = 20) -> None:
    gpu = open_device(backend)
    device = gpu.device
    print(f"{backend}: {gpu.report.adapter}; cooperative matrix {gpu.report.cooperative_matrix}, "
          f"cooperative vector {gpu.report.cooperative_vector}")
    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (tiles, 16, 16)).astype(np.float16)
    b = rng.uniform(-1, 1, (16, 16)).astype(np.float16)
    expected = a.astype(np.float32) @ b.astype(np.float32)
    a_gpu = spy.Tensor.from_numpy(device, a.reshape(-1))
    b_gpu = spy.Tensor.from_numpy(device, b.reshape(-1))
    module = gpu.load_module_from_source("coop_probe", SOURCE)
    for name, threads in (("rowProducts", tiles * 16), ("tileProducts", tiles * 32)):
        c_gpu = spy.Tensor.zeros(device, shape=(tiles * 256,), dtype=float)
        kernel = getattr(module, name)
        args = (a_gpu.storage.device_address, b_gpu.storage.device_address, c_gpu.storage.device_address)
        try:
            kernel(spy.grid((threads,)), *args)
            device.wait()
            start = time.perf_counter()
            for _ in range(repeats):
                kernel(spy.grid((threads,)), *args)
            device.wait()
            seconds = (time.perf_counter() - start) / repeats
        except Exception as error:  # report and go on: the other kernel's numbers still count
            print(f"  {name}: failed: {str(error).splitlines()[0][:300]}")
            continue
        got = np.asarray(c_gpu.to_numpy()).reshape(tiles, 16, 16)
        error = float(np.abs(got - expected).max())
        print(f"  {name}: {tiles * 16 * 16 * 16 * 2 / seconds / 1e9:.1f} GFLOP/s, {seconds * 1e3:.3f} ms a pass, "
              f"max |error| {error:.2e}")


if __name__ == "__main__":
    run(sys.argv[1], tiles=int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 16)
