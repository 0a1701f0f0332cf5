"""Key-light visibility and ambient occlusion from meshes, for batches of surface points on the GPU.

The hybrid renderer shades its G-buffer points with these instead of marching volumetric shadows
(shaders/mesh_shadows.slang). With each structure's opacity the visibility is the same quantity as
the reference renderer's shadow transmittance, since each surface crossing dims the light by exactly
that structure's opacity; with opacity 1 everywhere it is a binary shadow test.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..gpu.device import GpuContext
from ..mesh.bvh import MAX_MESHES, Bvh, shader_struct
from .light_grid import build_light_grid, light_grid_struct


class MeshShadows:
    """Visibility queries against a BVH of structure meshes."""

    def __init__(
        self,
        gpu: GpuContext,
        bvh: Bvh,
        opacities: Sequence[float] | None = None,
        offset_mm: float = 0.5,
        ambient_rays: int = 8,
        ambient_radius_mm: float = 20.0,
    ) -> None:
        """``opacities`` per mesh (default 1: opaque). ``offset_mm`` keeps rays off the surface they leave;
        points taken from the field rather than the mesh need about a voxel, since the mesh's facets sit
        off the true surface by up to a fraction of a voxel where it curves."""
        opacity = np.ones(MAX_MESHES) if opacities is None else np.asarray(opacities, float)
        if len(opacity) > MAX_MESHES:
            raise ValueError(f"at most {MAX_MESHES} meshes")
        factors = np.zeros(MAX_MESHES, np.float32)
        factors[: len(opacity)] = 1.0 - np.clip(opacity, 0.0, 1.0)
        self.gpu, self.bvh = gpu, bvh
        self._tensors, self.struct = shader_struct(gpu, bvh)
        self._grid: tuple[tuple[float, ...], list, dict] | None = None  # (direction, tensors, struct)
        self.settings = {
            "offset": float(offset_mm),
            "tMax": 1e30,  # the key light is at infinity
            "factors": [float(f) for f in factors],
            "ambientRays": int(ambient_rays),
            "ambientRadius": float(ambient_radius_mm),
        }
        self.module = gpu.load_module("mesh_shadows")

    def light_grid(self, to_light: Sequence[float]) -> dict:
        """The ``LightGrid`` shader struct of these meshes for rays towards ``to_light`` (shaders/light_grid.slang),
        built on first use for each direction."""
        light = np.asarray(to_light, np.float64)
        direction = tuple(float(c) for c in np.float32(light / np.linalg.norm(light)))
        if self._grid is None or self._grid[0] != direction:
            self._grid = (direction, *light_grid_struct(self.gpu, build_light_grid(self.bvh, direction)))
        return self._grid[2]

    def key_visibility(self, points: np.ndarray, normals: np.ndarray, to_light: Sequence[float],
                       through_grid: bool = True) -> np.ndarray:
        """Fraction of the key light (direction ``to_light``, towards the light) reaching each point: (N,).
        The rays go through the light grid (what the renderer does), or with ``through_grid=False`` through
        the BVH: the same hits."""
        import slangpy as spy

        points = np.array(points, np.float32, order="C").reshape(-1, 3)
        normals = np.array(normals, np.float32, order="C").reshape(-1, 3)
        light = np.asarray(to_light, np.float64)
        light = spy.float3(*map(float, np.float32(light / np.linalg.norm(light))))
        if through_grid:
            result = self.module.meshKeyVisibilityByGrid(points, normals, light, self.light_grid(to_light), self.struct,
                                                         self.settings, _result="numpy")
        else:
            result = self.module.meshKeyVisibility(points, normals, light, self.struct, self.settings, _result="numpy")
        return np.asarray(result)

    def ambient_visibility(self, points: np.ndarray, normals: np.ndarray) -> np.ndarray:
        """Unoccluded fraction of the hemisphere around each normal (cosine weighted): (N,) float32."""
        points = np.array(points, np.float32, order="C").reshape(-1, 3)
        normals = np.array(normals, np.float32, order="C").reshape(-1, 3)
        return np.asarray(
            self.module.meshAmbientVisibility(points, normals, self.struct, self.settings, _result="numpy")
        )
