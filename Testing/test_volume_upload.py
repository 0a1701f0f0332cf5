"""A study's volumes interleaved on the device (shaders/volume_upload.slang): the layout volume.slang's
InterleavedVolumes reads, value for value, from one stack or from the volumes that make it up."""

from __future__ import annotations

import numpy as np
import pytest

from NeuralRaycastLib.render.volume import interleaved_volumes

pytestmark = pytest.mark.gpu


def host_interleaved(volumes: np.ndarray) -> np.ndarray:
    """The layout on the host: [i][j][k][volume], each voxel's values padded with zeros to whole float4s."""
    count = volumes.shape[0]
    out = np.zeros((*volumes.shape[1:], -(-count // 4) * 4), np.float32)
    out[..., :count] = np.moveaxis(volumes, 0, -1)
    return out.reshape(-1)


@pytest.mark.parametrize("counts", [(5,), (4, 1), (2, 2, 1), (4,), (1, 3, 2)])
def test_volumes_are_interleaved_on_the_device_as_the_shaders_read_them(gpu, counts):
    rng = np.random.default_rng(sum(counts))
    shape = (3, 5, 7)  # no side like another: a swapped axis shows
    parts = [rng.normal(size=(n, *shape)).astype(np.float32) for n in counts]
    parts = [part[0] if n == 1 else part for part, n in zip(parts, counts, strict=True)]  # (I, J, K) taken too
    tensor, struct = interleaved_volumes(gpu, parts if len(parts) > 1 else parts[0], np.eye(4))
    stack = np.concatenate([part.reshape(-1, *shape) for part in parts])
    np.testing.assert_array_equal(np.asarray(tensor.to_numpy()).reshape(-1), host_interleaved(stack))
    assert struct["chunks"] == -(-sum(counts) // 4)


def test_volumes_of_different_grids_are_refused(gpu):
    with pytest.raises(ValueError, match="one grid"):
        interleaved_volumes(gpu, [np.zeros((2, 3, 4, 5), np.float32), np.zeros((3, 4, 6), np.float32)], np.eye(4))
