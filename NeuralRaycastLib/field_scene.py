"""The neural field as a scene of the differentiable renderer (shaders/field_render.slang): its
distances, normals (tetrahedral differences), albedo and specular weight at sample points, fed the study's
normalised MRI channels and P(x) as the appearance network's local inputs.

Where the field is ``cooperative`` (CUDA) the kernels run the geometry network on tensor cores, from the
tiled copy of its weights: uploaded before each forward and backward pass, its gradients added back to
the field's after the backward."""

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
        self.cooperative = field.cooperative
        self.module = field.fit_module  # the tensor-core kernels where the field is cooperative
        self._inputs, self.inputs = volume_stack(gpu, inputs, np.linalg.inv(prepared.affine))

    @property
    def structures(self) -> int:
        return self.field.structures

    def struct(self) -> dict[str, Any]:
        return {"field": self.field.shader_struct(self.cooperative), "inputs": self.inputs}

    def _upload(self) -> None:
        if self.cooperative:
            self.field.upload_tiled_geometry()

    def distances(self, grid: Any, buffers: dict) -> None:
        if self.cooperative and buffers["maxSamples"] % WAVE:
            raise ValueError(f"tensor-core kernels need max_samples in multiples of {WAVE}")
        self._upload()
        self.module.fieldDistances(grid, self.struct(), buffers)

    def surface(self, lists: WorkLists, buffers: dict, step_mm: float) -> None:
        self.module.fieldSurface(WorkLists.launch(lists.shaded), self.struct(), buffers, step_mm)

    def backward(self, lists: WorkLists, buffers: dict, step_mm: float) -> None:
        self._upload()
        struct = self.struct()
        self.module.fieldBackwardDistances(WorkLists.launch(lists.touched), struct, buffers)
        self.module.fieldBackwardSurface(WorkLists.launch(lists.shaded), struct, buffers, step_mm)
        if self.cooperative:
            self.field.add_tiled_gradients()

    def backward_appearance(self, lists: WorkLists, buffers: dict) -> None:
        """The backward pass with the geometry frozen: gradients of the appearance network only."""
        self.module.fieldAppearanceBackward(WorkLists.launch(lists.shaded), self.struct(), buffers)


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
