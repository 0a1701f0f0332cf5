"""The neural field as a scene of the differentiable renderer (shaders/field_render.slang): its
distances at sample points; normals (differences over a tetrahedron one of whose edges is the shaded segment),
albedo and specular weight on shaded segments, fed the study's
normalised MRI channels and P(x) as the appearance network's local inputs.

Where the field is ``cooperative`` (CUDA) the kernels run over whole waves with both networks on tensor
cores, from tiled copies of their weights uploaded at the start of each forward and backward pass; the
appearance network's gradients go back to the field's buffer after each backward pass. Where it has
``coop_vectors`` (Vulkan devices that report them) the same kernels as the SDF fit's run both networks on
cooperative vectors, a point a thread, from their half copies (made once per change of the weights); the appearance
network's weights' gradient sums go back to the field's buffer after each backward pass, taken into half at a scale
set from the batch's rays (:func:`appearance_gradient_scale`).

The image loss trains the hash table and the appearance network; the geometry network's weights follow
the SDF and Eikonal terms alone. Their image gradients are sums over every sample of a batch of terms that
cancel (a surface moved forward along a ray adds opacity on one side and removes it on the other), and
half-precision activations do not resolve them: after a short training on the sample, the
tensor-core backward's gradient for the geometry network pointed far from the fp32 per-thread one (with or
without loss scaling), while the hash table's and the appearance network's matched theirs. Dropping that
one group keeps every gradient the trainer uses accurate, on every backend alike, and makes a joint
training step several times faster, with geometry scores as good and the held-out PSNR slightly lower,
still above its target (BENCHMARKS.md). That comparison predates a fix to the order in which tensor-core
weight gradients are read back within their tiles, a fault that also lowered their agreement, and has not
been repeated. Neither backward computes that group's gradients at all: the per-thread one is given a null
gradient buffer (shaders/mlp.slang), the tensor-core one runs its backward pass without the weights' part
(MmaMlp.frozenBackward, in the field's ``frozen_module``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..gpu.device import GpuContext, PassClock
from ..grid import sample_at
from ..render.occupancy import Occupancy
from ..render.scene import WorkLists
from ..render.style import BAND_WIDTHS
from ..render.volume import interleaved_volumes
from ..study.preprocess import PreparedStudy
from .field import NeuralField, coop_gradient_scale


def appearance_gradient_scale(rays: int) -> float:
    """The gradient scale of the appearance network's weights on cooperative vectors for a backward pass over
    ``rays`` rays: the image loss is a mean over the batch's pixels, so a shaded segment's share of it is at most
    about a ray's, 1 / ``rays`` (coop_gradient_scale, as the SDF fit's points)."""
    return coop_gradient_scale(1.0 / max(int(rays), 1))


class FieldScene:
    def __init__(self, gpu: GpuContext, field: NeuralField, prepared: PreparedStudy) -> None:
        given = len(prepared.channels) + 1
        if given != field.layout.appearance_inputs:
            raise ValueError(f"the field expects {field.layout.appearance_inputs} local inputs, "
                             f"the study gives {given}")
        self.field = field
        # (The kernels read field.kernels.appearance_inputs inputs: those past the study's read as zeros.)
        self._inputs, self.inputs = interleaved_volumes(gpu, [prepared.channels, prepared.probability],
                                                        np.linalg.inv(prepared.affine))

    @property
    def structures(self) -> int:
        return self.field.structures

    @property
    def cooperative(self) -> bool:
        return self.field.cooperative

    @property
    def coop_vectors(self) -> bool:
        """Whether the geometry network runs on cooperative vectors (the field's ``sdf_fit_module``)."""
        return self.field.coop_vectors is not None

    def struct(self, cooperative: bool = False, geometry_network_gradients: bool = True) -> dict[str, Any]:
        return {"field": self.field.shader_struct(cooperative, geometry_network_gradients, self.coop_vectors),
                "inputs": self.inputs}

    def forward_module(self):
        """The module of the forward passes, its networks' copies brought up to date first where they have
        them (the surface pass of the same forward reads them too)."""
        if self.cooperative:
            self.field.upload_tiled_networks(unless_current=True)
            return self.field.fit_module
        if self.coop_vectors:
            self.field.upload_coop_vector_weights(unless_current=True)
            return self.field.sdf_fit_module
        return self.field.module

    def distances(self, grid: Any, buffers: dict) -> None:
        self.forward_module().fieldDistances(grid, self.struct(self.cooperative), buffers)

    def surface(self, grid: Any, buffers: dict) -> None:
        self.forward_module().fieldSurface(grid, self.struct(self.cooperative), buffers)

    def backward(self, lists: WorkLists, buffers: dict, timings: dict[str, float] | None = None) -> None:
        """The rendered values' gradients into the hash table and the appearance network; the geometry
        network's weights take theirs from the SDF and Eikonal terms only (the module docstring says why).
        The shaded segments' pass goes first: their normals send gradients to the distances at their ends,
        which the distances' pass takes on. ``timings``: each pass's seconds added there (waiting for the
        device after each; for profiling)."""
        clock = PassClock(self.field.gpu, timings)
        if self.cooperative:
            self.field.upload_tiled_networks()  # their gradients zeroed
            clock.lap("scene backward: weights to tensor-core layout")
            module, struct = self.field.frozen_module, self.struct(True)
        else:  # per thread, or on cooperative vectors with the geometry network's weights frozen alike
            self._start_appearance_sums(buffers)
            module, struct = self.forward_module(), self.struct(geometry_network_gradients=False)
        if lists.shaded:  # an empty list launches nothing, as in the forward pass
            module.fieldBackwardSurface(WorkLists.launch(lists.shaded), struct, buffers)
        clock.lap("scene backward: normals and appearance")
        if lists.touched:
            module.fieldBackwardDistances(WorkLists.launch(lists.touched), struct, buffers)
        clock.lap("scene backward: distances")
        if self.cooperative:
            self.field.add_tiled_gradients()
            clock.lap("scene backward: gradients back")
        self._end_appearance_sums(clock)

    def _start_appearance_sums(self, buffers: dict) -> None:
        """On cooperative vectors, before a backward pass: the appearance network's gradient scale for the batch's
        rays and its sums zeroed."""
        if self.coop_vectors:
            self.field.coop_network("appearance").gradient_scale = appearance_gradient_scale(buffers["rayCount"])
            self.field.upload_coop_vector_network("appearance", unless_current=True)

    def _end_appearance_sums(self, clock: PassClock) -> None:
        """On cooperative vectors, after a backward pass: the appearance network's weights' gradients back."""
        if self.coop_vectors:
            self.field.add_coop_vector_gradients("appearance")
            clock.lap("scene backward: gradients back")

    def backward_appearance(self, lists: WorkLists, buffers: dict, timings: dict[str, float] | None = None) -> None:
        """The backward pass with the geometry frozen: gradients of the appearance network only. The geometry
        network runs forward for its features, on tensor cores where the field has them, as the appearance
        network does (``timings``: see :meth:`backward`)."""
        clock = PassClock(self.field.gpu, timings)
        if not self.cooperative:
            self._start_appearance_sums(buffers)
            self.forward_module().fieldAppearanceBackward(WorkLists.launch(lists.shaded), self.struct(), buffers)
            clock.lap("scene backward: appearance")
            self._end_appearance_sums(clock)
            return
        self.field.upload_tiled_networks()  # their gradients start from zero
        clock.lap("scene backward: weights to tensor-core layout")
        self.field.frozen_module.fieldAppearanceBackward(WorkLists.launch(lists.shaded), self.struct(True), buffers)
        clock.lap("scene backward: appearance")
        self.field.add_tiled_gradients()
        clock.lap("scene backward: gradients back")


#: The last few boundary occupancies of this process, by study and grid: a second run in the same process
#: (Slicer, a Python session) starts without computing its study's again.
_BOUNDARY_OCCUPANCIES: dict[tuple, Occupancy] = {}


def boundary_occupancy(prepared: PreparedStudy, box: np.ndarray, cell_mm: float, epsilon_mm: float) -> Occupancy:
    """Where the boundary maps put a surface (the occupancy before anything is learnt)."""
    def distances(points: np.ndarray) -> np.ndarray:
        return sample_at(prepared.boundary, prepared.affine, points).T

    study = getattr(prepared, "key", "")  # a digest of what the study was prepared from ("" if unknown)
    key = (study, np.asarray(box, np.float64).tobytes(), float(cell_mm), float(epsilon_mm))
    occupancy = _BOUNDARY_OCCUPANCIES.get(key) if study else None
    if occupancy is None:
        occupancy = Occupancy.from_distances(distances, box, cell_mm, BAND_WIDTHS * epsilon_mm)
        if study:
            if len(_BOUNDARY_OCCUPANCIES) >= 4:  # the oldest goes
                del _BOUNDARY_OCCUPANCIES[next(iter(_BOUNDARY_OCCUPANCIES))]
            _BOUNDARY_OCCUPANCIES[key] = occupancy
    return occupancy.copy()


def field_occupancy(field: NeuralField, box: np.ndarray, cell_mm: float, epsilon_mm: float,
                    lipschitz: float = 1.5) -> Occupancy:
    """Where the learned distances put a surface (refreshed as training goes); a margin for a field
    that is not yet exactly 1-Lipschitz."""
    corners = tuple(int(n) + 1 for n in Occupancy.grid_cells(box, cell_mm))
    nearest = field.nearest_on_grid(np.asarray(box, np.float64)[0], cell_mm, corners)
    return Occupancy.from_nearest(nearest, box, cell_mm, BAND_WIDTHS * epsilon_mm, lipschitz)
