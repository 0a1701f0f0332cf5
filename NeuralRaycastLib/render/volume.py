"""The study's volumes on the device, as shaders/volume.slang reads them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..gpu.device import GpuContext


def volume_stack(gpu: GpuContext, volumes: np.ndarray, ras_to_ijk: np.ndarray):
    """Upload (V, I, J, K) float32 volumes: (the tensor, which must stay alive; the shader struct)."""
    import slangpy as spy

    volumes = np.ascontiguousarray(volumes, dtype=np.float32)
    tensor = spy.Tensor.from_numpy(gpu.device, volumes.reshape(-1))
    struct = {
        "data": tensor.storage.device_address,
        "dims": spy.int3(*map(int, volumes.shape[1:])),
        "count": int(volumes.shape[0]),
        "rasToIjk": spy.float4x4(np.asarray(ras_to_ijk, dtype=np.float32)),
    }
    return tensor, struct



def interleaved_volumes(gpu: GpuContext, volumes: np.ndarray | Sequence[np.ndarray], ras_to_ijk: np.ndarray):
    """Upload (V, I, J, K) float32 volumes interleaved, each voxel's V values padded to whole float4s, for
    ``InterleavedVolumes`` in shaders/volume.slang: (the tensor, which must stay alive; the shader struct). A
    kernel that reads more volumes (its capacity) reads zeros past these.

    ``volumes``: one (V, I, J, K) array, or several arrays of (v, I, J, K) or (I, J, K) on one grid, taken in
    order (a study's channels and P(x) need not be joined first). They go to the device as they are and are
    interleaved there (shaders/volume_upload.slang): the host would take longer over it than the upload."""
    import slangpy as spy

    parts = [volumes] if isinstance(volumes, np.ndarray) else list(volumes)
    parts = [np.asarray(part, dtype=np.float32) for part in parts]
    parts = [part for part in (part[None] if part.ndim == 3 else part for part in parts) if part.shape[0]]
    shape = parts[0].shape[1:] if parts else ()
    if not parts or any(part.ndim != 4 or part.shape[1:] != shape for part in parts):
        raise ValueError(f"volumes of one grid expected, got shapes {[part.shape for part in parts]}")
    count = sum(part.shape[0] for part in parts)
    stride = -(-count // 4) * 4
    voxels = int(np.prod(shape))
    device, module = gpu.device, gpu.load_module("volume_upload")
    tensor = spy.Tensor.empty(device, shape=(voxels * stride,), dtype=float)
    planar, first = [], 0
    for index, part in enumerate(parts):
        planar.append(spy.Tensor.from_numpy(device, np.ascontiguousarray(part).reshape(-1)))
        module.interleaveVolumes(spy.grid((voxels,)), voxels, part.shape[0], first, stride,
                                 int(index == len(parts) - 1), planar[-1].storage.device_address,
                                 tensor.storage.device_address)
        first += part.shape[0]
    device.wait()  # the planar copies are freed on return
    struct = {
        "data": tensor.storage.device_address,
        "dims": spy.int3(*map(int, shape)),
        "chunks": stride // 4,
        "rasToIjk": spy.float4x4(np.asarray(ras_to_ijk, dtype=np.float32)),
    }
    return tensor, struct
