"""What a Gaussian takes from its structure's look besides its trained colour (shaders/gaussian_scene.slang's
GaussianLook): the texture the study's MRI channels give its colour, and its specular highlight.

The reference views shade a crossing of structure k's surface as (docs/image-formation.md)

    albedo_k(x) · (ambient + headlight · (n·v) + key · max(n·l, 0)) + specular_k · (½ (n·v)^p + [n·l > 0] (n·h)^p),
    albedo_k(x) = colour_k · lerp(1 - m_k, 1, clamp((I_c(x) - lo) / (hi - lo), 0, 1)),

n the normal turned towards the viewer. A flat Gaussian on that surface has its third axis a along n, so n·v =
|d·a| and the diffuse part is a constant on each side of it plus one in |d·a|: its trained colour coefficients
(linear in them). The rest comes from here, as data that training does not change: the texture factor of the
albedo, read from the channels at every sample the Gaussian adds to (without it a Gaussian's colour is one value
over its whole width, and the channels' grain asks for Gaussians a voxel wide), and the specular term, from the
structure's specular weight and the lights.

A Gaussian's look record (LOOK_FLOATS floats): the weights u that pick its structure's channel, divided by the
window's width (4, one per channel), the window's low end over its width, the modulation m, the specular weight,
and a zero. A record of zeros leaves the trained colour alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..gpu.device import GpuContext
from ..render.style import RenderStyle
from ..study.preprocess import PreparedStudy

LOOK_FLOATS = 8
#: Where a look record holds each part: the channel weights u, the window's offset o, the modulation m, the
#: specular weight (the texture is the parts before SPECULAR).
OFFSET, MODULATION, SPECULAR = 4, 5, 6
#: The most channels the texture reads (shaders/gaussian_scene.slang's InterleavedVolumes<4>).
MAX_CHANNELS = 4


def structure_looks(prepared: PreparedStudy, textured: bool = True) -> np.ndarray:
    """(K, LOOK_FLOATS): each structure's look record, as the reference views' default look has it
    (render/style.py: its channel, window, modulation and specular weight). ``textured`` False: no texture (the
    specular weight alone)."""
    style = RenderStyle.default(prepared.structures, prepared.channel_names)
    records = np.zeros((len(prepared.structures), LOOK_FLOATS), np.float32)
    for k, structure in enumerate(prepared.structures):
        look = style.structures[structure.name]
        records[k, SPECULAR] = float(look.specular)
        if not textured or look.channel is None or not look.modulation:
            continue
        channel = prepared.channel_names.index(look.channel)
        if channel >= MAX_CHANNELS:
            continue  # (the study's first four channels alone reach the device)
        low, high = look.window
        width = max(float(high) - float(low), 1e-6)
        records[k, channel] = 1.0 / width
        records[k, OFFSET] = float(low) / width
        records[k, MODULATION] = float(look.modulation)
    return records


def texture_factors(records: np.ndarray, channels: np.ndarray) -> np.ndarray:
    """t = (1 - m) + m · clamp(u · I - o, 0, 1) for records (N, LOOK_FLOATS) and channel values (..., 4) that
    broadcast against them: the shader's GaussianLook.texture, for the host's checks."""
    records = np.asarray(records, np.float64)
    picked = np.einsum("...c,...c->...", np.asarray(channels, np.float64), records[..., :OFFSET]) - records[..., OFFSET]
    return 1.0 - records[..., MODULATION] + records[..., MODULATION] * np.clip(picked, 0.0, 1.0)


@dataclass(frozen=True)
class Highlights:
    """The lights' part of the specular term (render/style.py's Lighting): the unit direction towards the key
    light and the shininess."""

    key_direction: tuple[float, float, float]
    shininess: float

    @classmethod
    def of_style(cls, prepared: PreparedStudy) -> Highlights:
        light = RenderStyle.default(prepared.structures, prepared.channel_names).lighting
        key = np.asarray(light.key_direction, np.float64)
        return cls(tuple(float(v) for v in key / np.linalg.norm(key)), float(light.shininess))

    def as_dict(self) -> dict[str, Any]:
        return {"key_direction": list(self.key_direction), "shininess": self.shininess}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Highlights:
        key = tuple(float(v) for v in values["key_direction"])
        shininess = float(values["shininess"])
        if len(key) != 3 or abs(float(np.linalg.norm(key)) - 1.0) > 1e-4 or not shininess > 0:
            raise ValueError(f"highlights of key direction {key} and shininess {shininess}")
        return cls(key, shininess)

    def shader_struct(self) -> dict[str, Any]:
        import slangpy as spy

        return {"keyDirection": spy.float3(*self.key_direction), "shininess": self.shininess}

    def specular(self, records: np.ndarray, axes: np.ndarray, direction: np.ndarray) -> np.ndarray:
        """(N,) each Gaussian's specular term seen along ``direction`` (3,), its third axis ``axes`` (N, 3) the
        normal: the shader's GaussianLook.highlight, for the host's checks."""
        view = -np.asarray(direction, np.float64)
        normal = np.where((axes @ view < 0)[:, None], -axes, axes)
        key = np.asarray(self.key_direction, np.float64)
        half = (key + view) / np.linalg.norm(key + view)
        head = np.maximum(normal @ view, 0.0) ** self.shininess
        lit = np.where(normal @ key > 0, np.maximum(normal @ half, 0.0) ** self.shininess, 0.0)
        return np.asarray(records, np.float64)[:, SPECULAR] * (0.5 * head + lit)


#: Highlights of no specular weight's use (a scene whose records hold none): any unit direction.
NO_HIGHLIGHTS = Highlights((0.0, 0.0, 1.0), 1.0)


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
        """The shader's volumes where there is no texture (never read: GaussianLook.textured is 0)."""
        import slangpy as spy

        return {"data": 0, "dims": spy.int3(2, 2, 2), "chunks": 0,
                "rasToIjk": spy.float4x4(np.eye(4, dtype=np.float32))}


def any_textured(looks: np.ndarray) -> bool:
    """Whether some of the look records (N, LOOK_FLOATS) textures its Gaussian's colour."""
    return bool(np.asarray(looks)[:, :SPECULAR].any())


def study_channels(gpu: GpuContext, prepared: PreparedStudy, gaussians) -> ChannelVolumes | None:
    """The study's channels on the device where some of ``gaussians`` (a GaussianSet) is textured, else None."""
    return ChannelVolumes.for_study(gpu, prepared) if any_textured(gaussians.looks) else None
