"""The study's volumes on the device, as shaders/volume.slang reads them."""

from __future__ import annotations

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



def interleaved_volumes(gpu: GpuContext, volumes: np.ndarray, ras_to_ijk: np.ndarray):
    """Upload (V, I, J, K) float32 volumes interleaved, each voxel's V values padded to whole float4s, for
    ``InterleavedVolumes`` in shaders/volume.slang: (the tensor, which must stay alive; the shader struct). A
    kernel that reads more volumes (its capacity) reads zeros past these."""
    import slangpy as spy

    volumes = np.asarray(volumes, dtype=np.float32)
    count = volumes.shape[0]
    interleaved = np.zeros((*volumes.shape[1:], -(-count // 4) * 4), np.float32)
    interleaved[..., :count] = np.moveaxis(volumes, 0, -1)
    tensor = spy.Tensor.from_numpy(gpu.device, interleaved.reshape(-1))
    struct = {
        "data": tensor.storage.device_address,
        "dims": spy.int3(*map(int, volumes.shape[1:])),
        "chunks": interleaved.shape[-1] // 4,
        "rasToIjk": spy.float4x4(np.asarray(ras_to_ijk, dtype=np.float32)),
    }
    return tensor, struct
