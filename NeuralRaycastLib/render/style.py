"""How a study looks: per-structure opacity, colour and texture, lights, and ray-marching accuracy.

The parameters of the image formation model (docs/image-formation.md), shared by the reference and the
neural renderer. Defaults give the clinical picture: a semi-transparent brain textured by T1, the whole
tumour, tumour core and enhancing tumour inside it in increasingly opaque colours.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..gpu.device import kernel_floats
from ..study.structures import BRAIN, Structure

MAX_STRUCTURES = 8  # shaders/image_formation.slang: STYLE_STRUCTURES
MAX_CHANNELS = 8
BAND_WIDTHS = 8.0  # Φ is flat beyond this many ε from a surface (shaders/image_formation.slang)


@dataclass
class StructureStyle:
    opacity: float  # opacity of one crossing of the surface, in [0, 1)
    channel: str | None = None  # channel modulating the albedo (None: flat colour)
    window: tuple[float, float] = (0.2, 1.2)  # normalised channel values mapped to dark and bright
    modulation: float = 0.4  # 0: flat colour, 1: black where the channel is at the window's low end
    specular: float = 0.2
    color: tuple[float, float, float] | None = None  # None: the structure's colour

    def optical_depth(self) -> float:
        if not 0.0 <= self.opacity < 1.0:
            raise ValueError(f"opacity must lie in [0, 1), got {self.opacity}")
        return float(-np.log1p(-self.opacity))


#: (opacity, preferred channels, window, modulation, specular) per well-known structure.
_DEFAULTS = {
    BRAIN: (0.3, ("t1", "t1ce", "t2", "flair"), (0.1, 0.9), 0.35, 0.12),
    "whole_tumor": (0.35, ("flair", "t2"), (0.3, 1.3), 0.3, 0.2),
    "tumor_core": (0.55, ("t2", "flair"), (0.3, 1.5), 0.3, 0.25),
    "enhancing_tumor": (0.9, ("t1ce", "t1"), (0.3, 1.6), 0.3, 0.35),
}


def default_structure_style(name: str, channel_names: list[str]) -> StructureStyle:
    opacity, preferred, window, modulation, specular = _DEFAULTS.get(name, (0.6, (), (0.2, 1.2), 0.0, 0.2))
    channel = next((c for c in preferred if c in channel_names), channel_names[0] if preferred else None)
    return StructureStyle(opacity, channel, window, modulation, specular)


@dataclass
class Lighting:
    ambient: float = 0.3
    headlight: float = 0.35
    key: float = 0.65
    key_direction: tuple[float, float, float] = (0.45, 0.35, 0.82)  # towards the key light, RAS
    shininess: float = 24.0
    shadows: bool = False  # volumetric shadows of the key light (expensive)


@dataclass
class RenderStyle:
    structures: dict[str, StructureStyle] = field(default_factory=dict)
    lighting: Lighting = field(default_factory=Lighting)
    epsilon_voxels: float = 0.5  # width of the smooth step, in voxels
    # Sample spacing near surfaces, in voxels. Each segment's optical depth is exact (from the smooth step
    # at its ends), so the step only sets where colour and normal are taken: on the sample case one voxel
    # renders within about 60 dB of a four times finer march (docs/image-formation.md).
    step_voxels: float = 1.0
    shadow_step_voxels: float = 1.0

    @classmethod
    def default(cls, structures: list[Structure], channel_names: list[str]) -> RenderStyle:
        return cls({s.name: default_structure_style(s.name, channel_names) for s in structures})

    def shader_look(self, structures: list[Structure], channel_names: list[str]) -> dict:
        """The ``Look`` struct of shaders/image_formation.slang for these structures (in this order)."""
        import slangpy as spy

        if len(structures) > MAX_STRUCTURES:
            raise ValueError(f"at most {MAX_STRUCTURES} structures can be rendered, got {len(structures)}")
        look = {k: [] for k in ("color", "opticalDepth", "channel", "window", "modulation", "specular")}
        for index in range(MAX_STRUCTURES):
            if index < len(structures):
                structure = structures[index]
                style = self.structures.get(structure.name) or default_structure_style(structure.name, channel_names)
                if style.channel is not None and style.channel not in channel_names:
                    raise ValueError(f"structure '{structure.name}': no channel '{style.channel}' in {channel_names}")
                color = style.color or structure.color
                channel = channel_names.index(style.channel) if style.channel else -1
                values = (color, style.optical_depth(), channel, style.window, style.modulation, style.specular)
            else:
                values = ((0.0, 0.0, 0.0), 0.0, -1, (0.0, 1.0), 0.0, 0.0)
            look["color"].append(spy.float3(*values[0]))
            look["opticalDepth"].append(float(values[1]))
            look["channel"].append(int(values[2]))
            look["window"].append(spy.float2(*map(float, values[3])))
            look["modulation"].append(float(values[4]))
            look["specular"].append(float(values[5]))
        return kernel_floats(look)

    def shader_lighting(self) -> dict:
        import slangpy as spy

        light = self.lighting
        direction = np.asarray(light.key_direction, dtype=np.float64)
        direction = direction / np.linalg.norm(direction)
        return kernel_floats({
            "ambient": float(light.ambient),
            "headlight": float(light.headlight),
            "key": float(light.key),
            "keyDirection": spy.float3(*map(float, direction)),
            "shininess": float(light.shininess),
            "shadows": int(bool(light.shadows)),
        })
