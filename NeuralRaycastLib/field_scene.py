"""The neural field as a scene of the differentiable renderer (shaders/field_render.slang): its
distances, normals (tetrahedral differences), albedo and specular weight at sample points, fed the study's
normalised MRI channels and P(x) as the appearance network's local inputs.

Where the field is ``cooperative`` (CUDA) the forward kernels run the geometry network on tensor cores, from
the tiled copy of its weights (uploaded before each forward pass). The backward passes stay per thread:
the normals' parameter gradients are differences of four nearly equal network gradients, which half
precision operands do not resolve (measured on an H100: a cosine of 0.65 between the two paths' geometry
gradients, against 0.99 for the hash table's)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .field import NeuralField
from .gpu import GpuContext
from .neural_render import WAVE, Occupancy, WorkLists
from .preprocess import PreparedStudy
from .render import volume_stack
from .style import BAND_WIDTHS


class FieldScene:
    def __init__(self, gpu: GpuContext, field: NeuralField, prepared: PreparedStudy) -> None:
        inputs = np.concatenate([prepared.channels, prepared.probability[None]], axis=0)
        if inputs.shape[0] != field.layout.appearance_inputs:
            raise ValueError(f"the field expects {field.layout.appearance_inputs} local inputs, "
                             f"the study gives {inputs.shape[0]}")
        self.field = field
        self._inputs, self.inputs = volume_stack(gpu, inputs, np.linalg.inv(prepared.affine))

    @property
    def structures(self) -> int:
        return self.field.structures

    @property
    def cooperative(self) -> bool:
        return self.field.cooperative

    def struct(self, cooperative: bool = False) -> dict[str, Any]:
        return {"field": self.field.shader_struct(cooperative), "inputs": self.inputs}

    def distances(self, grid: Any, buffers: dict) -> None:
        if self.cooperative:
            if buffers["maxSamples"] % WAVE:
                raise ValueError(f"tensor-core kernels need max_samples in multiples of {WAVE}")
            self.field.upload_tiled_geometry()
        self.field.fit_module.fieldDistances(grid, self.struct(self.cooperative), buffers)

    def surface(self, lists: WorkLists, buffers: dict, step_mm: float) -> None:
        self.field.fit_module.fieldSurface(WorkLists.launch(lists.shaded), self.struct(self.cooperative), buffers,
                                           step_mm)

    def backward(self, lists: WorkLists, buffers: dict, step_mm: float) -> None:
        struct = self.struct()
        self.field.module.fieldBackwardDistances(WorkLists.launch(lists.touched), struct, buffers)
        self.field.module.fieldBackwardSurface(WorkLists.launch(lists.shaded), struct, buffers, step_mm)

    def backward_appearance(self, lists: WorkLists, buffers: dict) -> None:
        """The backward pass with the geometry frozen: gradients of the appearance network only."""
        self.field.module.fieldAppearanceBackward(WorkLists.launch(lists.shaded), self.struct(), buffers)


def boundary_occupancy(prepared: PreparedStudy, box: np.ndarray, cell_mm: float, epsilon_mm: float) -> Occupancy:
    """Where the boundary maps put a surface (the occupancy before anything is learnt)."""
    from .evaluate import sample_at

    def distances(points: np.ndarray) -> np.ndarray:
        return np.stack([sample_at(b, prepared.affine, points) for b in prepared.boundary], axis=1)

    return Occupancy.from_distances(distances, box, cell_mm, BAND_WIDTHS * epsilon_mm)


def field_occupancy(field: NeuralField, box: np.ndarray, cell_mm: float, epsilon_mm: float,
                    lipschitz: float = 1.5) -> Occupancy:
    """Where the learned distances put a surface (refreshed as training goes); a margin for a field
    that is not yet exactly 1-Lipschitz."""
    return Occupancy.from_distances(field.distances, box, cell_mm, BAND_WIDTHS * epsilon_mm, lipschitz)
