"""The reference renderer: the image formation model on the study's boundary maps, on the GPU.

Its images are the targets the neural field is trained on and judged against (I_ref). Forward only,
deterministic, the same on CUDA and on Vulkan (lavapipe on a CPU).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..gpu.device import GpuContext, ReadBack, kernel_floats
from ..grid import grid_corners_bounds
from ..study.preprocess import PreparedStudy
from .camera import Camera
from .image import PLANE_FLOATS, RenderedImage, image_from_planes
from .style import BAND_WIDTHS, RenderStyle
from .volume import volume_stack


def march_settings(prepared: PreparedStudy, style: RenderStyle) -> dict:
    """Accuracy and the box where anything is: the mask's box widened by the surface band."""
    import slangpy as spy

    voxel = float(prepared.spacing.min())
    epsilon = style.epsilon_voxels * voxel
    volume_box = grid_corners_bounds(prepared.affine, prepared.study.shape)
    low = np.maximum(prepared.bounds[0] - BAND_WIDTHS * epsilon, volume_box[0])
    high = np.minimum(prepared.bounds[1] + BAND_WIDTHS * epsilon, volume_box[1])
    return kernel_floats({
        "epsilon": epsilon,
        "step": style.step_voxels * voxel,
        "shadowStep": style.shadow_step_voxels * voxel,
        "boxMin": spy.float3(*map(float, low)),
        "boxMax": spy.float3(*map(float, high)),
    })


class ReferenceRenderer:
    """Renders a prepared study's boundary maps from any camera."""

    def __init__(self, gpu: GpuContext, prepared: PreparedStudy, style: RenderStyle | None = None) -> None:
        self.gpu, self.prepared = gpu, prepared
        self.style = style or RenderStyle.default(prepared.structures, prepared.channel_names)
        ras_to_ijk = np.linalg.inv(prepared.affine)
        self._boundary, boundary = volume_stack(gpu, prepared.boundary, ras_to_ijk)
        self._channels, channels = volume_stack(gpu, prepared.channels, ras_to_ijk)
        self.scene = {"boundary": boundary, "channels": channels}
        self.module = gpu.load_module("reference_render", len(prepared.structures))
        self._read_back = ReadBack(gpu)

    def render(self, camera: Camera, shadows: bool | None = None, mesh_shadows=None) -> RenderedImage:
        """One view. ``shadows`` overrides the style's; ``mesh_shadows`` (a MeshShadows, see
        :func:`hybrid_shadows`) takes the key light's visibility from meshes instead of volumetric marching."""
        import slangpy as spy

        style = self.style
        if mesh_shadows is not None:
            shadows = True
        if shadows is not None:
            style = replace(style, lighting=replace(style.lighting, shadows=shadows))
        arguments = (
            camera.to_shader(),
            style.shader_look(self.prepared.structures, self.prepared.channel_names),
            style.shader_lighting(),
            march_settings(self.prepared, style),
        )
        grid = spy.grid((camera.height, camera.width))
        planes = spy.Tensor.empty(self.gpu.device, shape=(camera.height * camera.width * PLANE_FLOATS,), dtype="float")
        if mesh_shadows is None:
            self.module.renderReference(grid, self.scene, *arguments, planes.storage.device_address)
        else:
            shadow_struct = {"bvh": mesh_shadows.struct, "settings": mesh_shadows.settings}
            self.module.renderReferenceMeshShadows(grid, self.scene, shadow_struct, *arguments,
                                                   planes.storage.device_address)
        return image_from_planes(self._read_back.read(planes), camera.height, camera.width)


def hybrid_shadows(gpu: GpuContext, prepared: PreparedStudy, style: RenderStyle, boundary: np.ndarray | None = None,
                   affine: np.ndarray | None = None):
    """Meshes of the surfaces (marching cubes of ``boundary`` on the grid of ``affine``, default the study's
    B_k on its grid) in a BVH, with each structure's opacity, for shadow rays: the hybrid replacement of
    volumetric shadows."""
    from ..mesh.bvh import build_bvh
    from ..mesh.mesh import mesh_sdf_grid
    from .mesh_shadows import MeshShadows

    affine = prepared.affine if affine is None else np.asarray(affine)
    meshes = mesh_sdf_grid(prepared.boundary if boundary is None else boundary, affine, prepared.structures,
                           normals=False)  # shadow rays need only the triangles
    opacities = [style.structures[s.name].opacity if s.name in style.structures else 1.0
                 for s in prepared.structures]
    # Shadow rays start from the distance field's surface, which the mesh facets approximate to a
    # fraction of a voxel: keep a voxel away from the surface being left.
    return MeshShadows(gpu, build_bvh(meshes), opacities,
                       offset_mm=float(np.linalg.norm(affine[:3, :3], axis=0).min()))
