"""The study's MRI channels as the texture of the Gaussians' colours (shaders/gaussians.slang's GaussianTexture).

The reference views take each structure's albedo from one channel through a window (docs/image-formation.md):
colour_k · lerp(1 - m_k, 1, clamp((I_c(x) - lo) / (hi - lo), 0, 1)). A Gaussian on structure k's surface takes
that same factor, read from the channels at every sample it adds to, so that its colour coefficients hold the
structure's colour under the lights and the channels give the grain within it: without the texture a Gaussian's
colour is one value over its whole width, and the grain of the channels asks for Gaussians a voxel wide.

A Gaussian's texture record (TEXTURE_FLOATS floats, data that training does not change): the weights u that pick
its structure's channel, divided by the window's width (4, one per channel), the window's low end over its width,
the modulation m, and two zeros. A record of zeros leaves the colour as it is.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..gpu.device import GpuContext
from ..render.style import RenderStyle
from ..study.preprocess import PreparedStudy

TEXTURE_FLOATS = 8
#: The most channels the texture reads (shaders/gaussians.slang's InterleavedVolumes<4>).
MAX_CHANNELS = 4


def structure_records(prepared: PreparedStudy) -> np.ndarray:
    """(K, TEXTURE_FLOATS): each structure's texture record, as the reference views' default look textures it
    (render/style.py: its channel, window and modulation; zeros for a structure drawn in a flat colour)."""
    style = RenderStyle.default(prepared.structures, prepared.channel_names)
    records = np.zeros((len(prepared.structures), TEXTURE_FLOATS), np.float32)
    for k, structure in enumerate(prepared.structures):
        look = style.structures[structure.name]
        if look.channel is None or not look.modulation:
            continue
        channel = prepared.channel_names.index(look.channel)
        if channel >= MAX_CHANNELS:
            continue  # (the study's first four channels alone reach the device)
        low, high = look.window
        width = max(float(high) - float(low), 1e-6)
        records[k, channel] = 1.0 / width
        records[k, 4] = float(low) / width
        records[k, 5] = float(look.modulation)
    return records


def texture_factors(records: np.ndarray, channels: np.ndarray) -> np.ndarray:
    """t = (1 - m) + m · clamp(u · I - o, 0, 1) for records (N, TEXTURE_FLOATS) and channel values (..., 4) that
    broadcast against them: the shader's GaussianTexture.factor, for the host's checks."""
    records = np.asarray(records, np.float64)
    picked = np.einsum("...c,...c->...", np.asarray(channels, np.float64), records[..., :4]) - records[..., 4]
    return 1.0 - records[..., 5] + records[..., 5] * np.clip(picked, 0.0, 1.0)


class ChannelVolumes:
    """The study's channels (at most MAX_CHANNELS, normalised as the reference views read them) on the device, for
    the Gaussians' texture."""

    def __init__(self, gpu: GpuContext, channels: np.ndarray, affine: np.ndarray) -> None:
        from ..render.volume import interleaved_volumes

        channels = np.asarray(channels, np.float32)
        if channels.ndim != 4 or not 1 <= len(channels) <= MAX_CHANNELS:
            raise ValueError(f"the Gaussians' texture reads 1 to {MAX_CHANNELS} channels of one grid, got an array "
                             f"of shape {channels.shape}")
        self._tensor, self.struct = interleaved_volumes(gpu, channels, np.linalg.inv(np.asarray(affine, np.float64)))

    @classmethod
    def for_study(cls, gpu: GpuContext, prepared: PreparedStudy) -> ChannelVolumes:
        return cls(gpu, prepared.channels[:MAX_CHANNELS], prepared.affine)

    @staticmethod
    def empty_struct() -> dict[str, Any]:
        """The shader's volumes where there is no texture (never read: GaussianTexture.textured is 0)."""
        import slangpy as spy

        return {"data": 0, "dims": spy.int3(2, 2, 2), "chunks": 0,
                "rasToIjk": spy.float4x4(np.eye(4, dtype=np.float32))}
