"""Per-structure geometry from the Gaussians: structure weights, their occupancy, Dice and meshes.

Each Gaussian carries, per structure of the study, a logit and a slope across its surface: its structure weight
at x is sigmoid(logit + slope · z), z the coordinate of x along the Gaussian's normal, so that one Gaussian on a
surface says which of its sides is inside. The occupancy of structure k at x is the Gaussians' structure weights
averaged by their shapes there (shaders/gaussian_occupancy.slang, ``occupancyAt``), started from the boundary maps and
trained against the inside / outside of the prepared study's boundary maps (B_k(x) < 0) at points near the
surfaces. A study of K structures has (N, 2K) weights: the N Gaussians' K logits, then their K slopes. On the
study's grid, voxels no Gaussian covers take the occupancy of the nearest covered voxel (the Gaussians lie on
the surfaces, so the inside of a large structure is reached only that way); the inside {o_k > 1/2} then gives
a signed distance (mm) that train/evaluate.py's functions and mesh/mesh.py's helpers take as they take the
field's learned distances.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..gpu.device import device_memory
from ..grid import sample_at
from ..mesh.mesh import Mesh, extract_surface, grid_points, mesh_sdf_grid
from ..progress import ShouldStop
from ..study.preprocess import PreparedStudy
from .scene import GaussianScene

#: A voxel is covered where the Gaussians' summed shapes reach this (a Gaussian's peak is about 1).
COVERED = 0.05
#: Logit per voxel of signed distance at the Gaussian's centre when the weights start.
INITIAL_LOGIT_PER_VOXEL = 2.0
#: Points per occupancy call: bounds the device buffers on a large study grid.
CHUNK = 1 << 20


@dataclass(frozen=True)
class StructureTrainConfig:
    steps: int = 60
    points: int = 4096
    rate: float = 0.1
    seed: int = 0


def initial_structure_weights(prepared: PreparedStudy, scene: GaussianScene) -> np.ndarray:
    """(N, 2K) structure weights of the scene's Gaussians from the boundary maps, linear across each Gaussian as
    the maps are: the logit -``INITIAL_LOGIT_PER_VOXEL`` B_k / voxel at its centre (inside positive), the slope that
    logit's change per unit of z along its normal (the maps' derivative there, by central differences half a voxel
    either side), both clipped to ±8."""
    voxel = float(np.min(prepared.spacing))
    gaussians = scene.gaussians()
    positions = gaussians.positions.astype(np.float64)
    normals = gaussians.rotation_matrices()[:, :, 2].astype(np.float64)  # the third axes
    across = np.exp(gaussians.log_scales[:, 2].astype(np.float64)) * scene.geometry_thickness  # mm per unit of z
    k = len(prepared.boundary)

    def boundary(points: np.ndarray) -> np.ndarray:
        return sample_at(prepared.boundary, prepared.affine, points).reshape(k, -1).T

    step = 0.5 * voxel
    derivative = (boundary(positions + step * normals) - boundary(positions - step * normals)) / (2.0 * step)
    logits = -INITIAL_LOGIT_PER_VOXEL * boundary(positions) / voxel
    slopes = -INITIAL_LOGIT_PER_VOXEL * derivative * across[:, None] / voxel
    return np.clip(np.concatenate([logits, slopes], axis=1), -8.0, 8.0).astype(np.float32)


#: The most structures the occupancy kernels take (shaders/gaussian_occupancy.slang, OCCUPANCY_MAX_STRUCTURES):
#: the most a study has (gpu/device.STRUCTURE_SLOTS).
MAX_STRUCTURES = 8


def weights_shape(weights: np.ndarray, count: int) -> int:
    """The structures of (N, 2K) structure weights for ``count`` Gaussians; a ValueError for any other shape or for
    more than MAX_STRUCTURES structures."""
    shape = np.shape(weights)
    if len(shape) != 2 or shape[0] != count or shape[1] % 2 or not shape[1]:
        raise ValueError(f"structure weights of shape {shape} for {count} Gaussians (a logit and a slope per "
                         "Gaussian and structure)")
    if shape[1] // 2 > MAX_STRUCTURES:
        raise ValueError(f"the Gaussians' occupancy takes at most {MAX_STRUCTURES} structures "
                         f"(the weights hold {shape[1] // 2})")
    return shape[1] // 2


class StructureOccupancy:
    """A scene's Gaussians with their (N, 2K) structure weights on the device: occupancy at points and its
    backward."""

    def __init__(self, scene: GaussianScene, weights: np.ndarray) -> None:
        self.scene = scene
        self.set_weights(weights)

    def set_weights(self, weights: np.ndarray) -> None:
        import slangpy as spy

        weights = np.asarray(weights, np.float32)
        self.structures = weights_shape(weights, self.scene.count)
        with device_memory(f"the structure weights of {self.scene.count:,} Gaussians"):
            self.weights = spy.Tensor.from_numpy(self.scene.gpu.device, np.ascontiguousarray(weights).reshape(-1))

    def _points(self, points: np.ndarray) -> Any:
        import slangpy as spy

        flat = np.ascontiguousarray(np.asarray(points, np.float32).reshape(-1))
        with device_memory(f"{len(flat) // 3:,} points"):
            return spy.Tensor.from_numpy(self.scene.gpu.device, flat)

    def occupancy(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(M, K) occupancy and (M,) coverage at RAS points (M, 3), in chunks."""
        import slangpy as spy

        points = np.asarray(points, np.float32).reshape(-1, 3)
        k, parts = self.structures, []
        for first in range(0, len(points), CHUNK):
            chunk = points[first : first + CHUNK]
            with device_memory(f"the occupancy of {len(chunk):,} points"):
                results = spy.Tensor.zeros(self.scene.gpu.device, shape=(len(chunk) * (k + 1),), dtype=float)
            uploaded = self._points(chunk)  # held until the results are read: the kernel sees only its address
            self.scene.module.occupancyAt(spy.grid((len(chunk),)), self.scene.shader_struct(),
                                          self.scene.grid_struct(), self.weights.storage.device_address, k,
                                          uploaded.storage.device_address, len(chunk), results.storage.device_address)
            parts.append(np.asarray(results.to_numpy()).reshape(len(chunk), k + 1))
        values = np.concatenate(parts) if parts else np.zeros((0, k + 1), np.float32)
        return values[:, :k], values[:, k]

    def backward(self, points: np.ndarray, d_occupancy: np.ndarray) -> np.ndarray:
        """(N, 2K) ∂loss/∂weights of a loss whose ∂/∂o_k at the points is ``d_occupancy`` (M, K)."""
        import slangpy as spy

        device, count = self.scene.gpu.device, len(points)
        d = spy.Tensor.from_numpy(device, np.ascontiguousarray(d_occupancy, np.float32).reshape(-1))
        grads = spy.Tensor.zeros(device, shape=(self.scene.count * 2 * self.structures,), dtype=float)
        uploaded = self._points(points)  # held until the gradients are read: the kernel sees only its address
        self.scene.module.occupancyBackward(spy.grid((count,)), self.scene.shader_struct(), self.scene.grid_struct(),
                                            self.weights.storage.device_address, self.structures,
                                            uploaded.storage.device_address, count, d.storage.device_address,
                                            grads.storage.device_address)
        return np.asarray(grads.to_numpy()).reshape(self.scene.count, 2 * self.structures)


def surface_voxels(prepared: PreparedStudy) -> np.ndarray:
    """(V, 3) indices of the voxels within two voxels of some structure's surface."""
    voxel = float(np.min(prepared.spacing))
    near = np.argwhere((np.abs(prepared.boundary) < 2.0 * voxel).any(axis=0))
    if not len(near):
        raise ValueError("the study has no structure surface to train the Gaussians' structure weights on")
    return near


def surface_samples(prepared: PreparedStudy, count: int, rng: np.random.Generator,
                    near: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``count`` voxel centres (RAS) within two voxels of some structure's surface (of ``near``, the
    :func:`surface_voxels` found once, where given), and at each the inside (1) or outside (0) of every
    structure from the boundary maps: (M, 3), (M, K). Centres, where the labels are known and Dice counts,
    rather than points between them, where the maps are interpolated across a surface."""
    near = surface_voxels(prepared) if near is None else near
    ijk = near[rng.integers(0, len(near), count)]
    points = ijk @ prepared.affine[:3, :3].T + prepared.affine[:3, 3]
    inside = prepared.boundary[:, ijk[:, 0], ijk[:, 1], ijk[:, 2]].T < 0
    return points, inside.astype(np.float32)


def occupancy_loss(occupancy: np.ndarray, coverage: np.ndarray, inside: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean squared difference of the occupancy and the labels' inside at the covered points, and its
    gradient (uncovered points add nothing: no Gaussian there to move)."""
    covered = (coverage >= COVERED)[:, None]
    count = max(int(covered.sum()) * occupancy.shape[1], 1)
    difference = np.where(covered, occupancy - inside, 0.0)
    return float((difference**2).sum() / count), (2.0 * difference / count).astype(np.float32)


def train_structure_weights(scene: GaussianScene, prepared: PreparedStudy, config: StructureTrainConfig | None = None,
                            should_stop: ShouldStop | None = None,
                            initial: np.ndarray | None = None) -> tuple[np.ndarray, list[tuple[int, float]]]:
    """The Gaussians' (N, 2K) structure weights: started from ``initial`` (those trained with the pictures) or the
    boundary maps (:func:`initial_structure_weights`), then Adam on the occupancy loss at points near the
    surfaces, the Gaussians fixed; the losses by step. A stop keeps the weights reached."""
    config = config or StructureTrainConfig()
    rng = np.random.default_rng(config.seed)
    weights = initial_structure_weights(prepared, scene) if initial is None else np.asarray(initial, np.float32)
    occupancy = StructureOccupancy(scene, weights)
    m, v, losses = np.zeros_like(weights), np.zeros_like(weights), []
    near = surface_voxels(prepared) if config.steps else None
    for step in range(config.steps):
        if should_stop is not None and should_stop():
            break
        points, inside = surface_samples(prepared, config.points, rng, near)
        values, coverage = occupancy.occupancy(points)
        loss, d_values = occupancy_loss(values, coverage, inside)
        gradient = occupancy.backward(points, d_values)
        m = 0.9 * m + 0.1 * gradient
        v = 0.999 * v + 0.001 * gradient**2
        t = step + 1
        weights = weights - config.rate * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
        occupancy.set_weights(weights)
        losses.append((step, loss))
    return weights.astype(np.float32), losses


class JointStructures:
    """The occupancy loss added to the picture loss while the Gaussians train (shaders/gaussian_occupancy.slang's
    ``occupancyLossBackward``): each step, points near the surfaces with their inside / outside; the gradient of
    ``weight`` times the loss goes to the structure weights (their own Adam, shaders/adam.slang) and to the
    Gaussians' positions, scales and rotations, which the picture step's Adam then takes with the pictures'
    gradient. The structure weights live on the device; the loss is read back only when asked for."""

    def __init__(self, scene: GaussianScene, weights: np.ndarray, weight: float, config: StructureTrainConfig,
                 sample: Callable[[np.random.Generator], tuple[np.ndarray, np.ndarray]] | None = None,
                 shapes: bool = True) -> None:
        import slangpy as spy

        self.structures = weights_shape(weights, scene.count)
        self.scene, self.weight, self.config, self.sample, self.shapes = scene, weight, config, sample, shapes
        self.rng = np.random.default_rng(config.seed + 2)
        self.adam_module = scene.gpu.load_module("adam")
        self.steps = 0
        self._loss = spy.Tensor.zeros(scene.gpu.device, shape=(1,), dtype=float)
        self.set_weights(weights)

    @classmethod
    def for_study(cls, scene: GaussianScene, prepared: PreparedStudy, weight: float,
                  config: StructureTrainConfig) -> JointStructures:
        """Structure weights from the boundary maps; points near the study's surfaces (their voxels found once: a
        step only draws among them)."""
        near = surface_voxels(prepared)
        return cls(scene, initial_structure_weights(prepared, scene), weight, config,
                   lambda rng: surface_samples(prepared, config.points, rng, near))

    def set_weights(self, weights: np.ndarray, m: np.ndarray | None = None, v: np.ndarray | None = None) -> None:
        """(N, 2K) structure weights of the scene's current Gaussians, with Adam's moments (zeros where not given)."""
        import slangpy as spy

        weights = np.asarray(weights, np.float32)
        if weights_shape(weights, self.scene.count) != self.structures:
            raise ValueError(f"structure weights of shape {weights.shape} for {self.structures} structures")
        self.count = self.scene.count  # the Gaussians they are of (the scene's count changes before :meth:`follow`)
        device, size = self.scene.gpu.device, weights.size + 4  # four more for Adam's vector loads

        def padded(values: np.ndarray | None) -> Any:
            flat = np.zeros(size, np.float32)
            if values is not None:
                flat[: weights.size] = np.asarray(values, np.float32).reshape(-1)
            return spy.Tensor.from_numpy(device, flat)

        with device_memory(f"the structure weights of {self.scene.count:,} Gaussians while training"):
            self.weights, self.grads = padded(weights), padded(None)
            self.m, self.v = padded(m), padded(v)

    def _rows(self, tensor: Any) -> np.ndarray:
        """A device buffer of the weights' layout read back as (N, 2K), without Adam's padding."""
        n = self.count * 2 * self.structures
        return np.asarray(tensor.to_numpy())[:n].reshape(self.count, 2 * self.structures)

    def state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(weights, m, v), each (N, 2K)."""
        return tuple(self._rows(t) for t in (self.weights, self.m, self.v))

    def follow(self, kept: np.ndarray, grown: np.ndarray) -> None:
        """After pruning and densification: the weights and moments of the Gaussians kept, then copies of those
        of the Gaussians ``grown`` from (indices before the change, in the scene's new order)."""
        weights, m, v = self.state()
        order = np.concatenate([kept, grown]).astype(np.int64)
        zeros = np.zeros((len(grown), 2 * self.structures), np.float32)
        self.set_weights(weights[order], np.concatenate([m[kept], zeros]), np.concatenate([v[kept], zeros]))

    def backward(self, points: np.ndarray, inside: np.ndarray) -> None:
        """Add ``weight`` times the occupancy loss's gradient at ``points`` (M, 3) with their inside (M, K) to the
        structure weights' gradients and (``shapes``) the scene's, and the loss to :meth:`take_loss`'s sum."""
        import slangpy as spy

        device = self.scene.gpu.device
        uploaded = spy.Tensor.from_numpy(device, np.ascontiguousarray(points, np.float32).reshape(-1))
        labels = spy.Tensor.from_numpy(device, np.ascontiguousarray(inside, np.float32).reshape(-1))
        batch = {"weights": self.weights.storage.device_address, "dWeights": self.grads.storage.device_address,
                 "structures": self.structures, "points": uploaded.storage.device_address,
                 "inside": labels.storage.device_address, "count": len(points), "weight": float(self.weight),
                 "shapes": int(self.shapes), "loss": self._loss.storage.device_address}
        self.scene.module.occupancyLossBackward(spy.grid((len(points),)), self.scene.shader_struct(),
                                                self.scene.grid_struct(), batch)

    def weight_gradients(self) -> np.ndarray:
        return self._rows(self.grads)

    def step(self, rate_factor: float = 1.0) -> None:
        """Add the occupancy loss's gradient at a fresh batch of points to the scene's and update the weights."""
        import slangpy as spy

        if self.sample is None:
            raise ValueError("joint structure weights without points to train on")
        self.backward(*self.sample(self.rng))
        self.steps += 1
        t, count = self.steps, self.count * 2 * self.structures
        buffers = {"values": self.weights.storage.device_address, "grads": self.grads.storage.device_address,
                   "m": self.m.storage.device_address, "v": self.v.storage.device_address, "count": count,
                   "groupStart": [count, count, count], "shifted": 0, "shiftedCount": 0}
        rate = self.config.rate * rate_factor
        settings = {"rates": spy.float4(rate, rate, rate, rate), "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8,
                    "correction1": 1.0 / (1.0 - 0.9**t), "correction2": 1.0 / (1.0 - 0.999**t), "sparseGroups": 0}
        threads = -(-count // int(self.adam_module.adamWidth()))
        self.adam_module.adamStep(spy.grid((threads,)), buffers, settings)

    def take_loss(self) -> float:
        """The occupancy loss summed over the steps since the last call (a read of one float), then zero."""
        value = float(np.asarray(self._loss.to_numpy())[0])
        self._loss.copy_from_numpy(np.zeros(1, np.float32))
        return value


def filled_occupancy(occupancy: np.ndarray, coverage: np.ndarray) -> np.ndarray:
    """(K, I, J, K) occupancy where every voxel no Gaussian covers takes that of the nearest covered voxel
    (all outside where none is covered)."""
    from scipy.ndimage import distance_transform_edt

    covered = coverage >= COVERED
    if not covered.any():
        return np.zeros_like(occupancy)
    if covered.all():
        return occupancy
    nearest = distance_transform_edt(~covered, return_distances=False, return_indices=True)
    return occupancy[(slice(None), *nearest)]


def signed_distances(inside: np.ndarray, spacing: np.ndarray) -> np.ndarray:
    """A signed distance (mm, negative inside) of a voxel mask whose zero level runs halfway between its inside
    and outside voxels' centres."""
    from scipy.ndimage import distance_transform_edt

    half = 0.5 * float(np.min(spacing))
    if not inside.any():
        return np.full(inside.shape, 1e3, np.float32)
    if inside.all():
        return np.full(inside.shape, -1e3, np.float32)
    outward = distance_transform_edt(~inside, sampling=spacing) - half
    inward = distance_transform_edt(inside, sampling=spacing) - half
    return np.where(inside, -inward, outward).astype(np.float32)


def occupancy_signed_distances(occupancy: np.ndarray, spacing: np.ndarray) -> np.ndarray:
    """A signed distance (mm, negative inside) of the inside {occupancy > 1/2}: the mask's (signed_distances) away
    from its border, and on the voxels of the border (those with a face neighbour on the other side) the
    occupancy's own distance to its level 1/2, (1/2 - o) / |∇o|, within a voxel and on the voxel's side, so
    that the zero level lies where the occupancy crosses 1/2 between voxel centres instead of halfway."""
    inside = occupancy > 0.5
    distances = signed_distances(inside, spacing)
    voxel = float(np.min(spacing))
    border = np.zeros_like(inside)
    for axis in range(inside.ndim):
        change = np.diff(inside, axis=axis)
        before = [slice(None)] * inside.ndim
        after = [slice(None)] * inside.ndim
        before[axis], after[axis] = slice(0, -1), slice(1, None)
        border[tuple(before)] |= change
        border[tuple(after)] |= change
    gradient = np.stack(np.gradient(occupancy.astype(np.float64), *spacing))
    slope = np.maximum(np.sqrt((gradient**2).sum(axis=0)), 0.5 / voxel)  # no steeper than a half per voxel
    level = np.clip((0.5 - occupancy) / slope, -voxel, voxel)
    level = np.where(inside, np.minimum(level, -1e-3 * voxel), np.maximum(level, 1e-3 * voxel))
    return np.where(border, level, distances).astype(np.float32)


def occupancy_distances(scene: GaussianScene, weights: np.ndarray, prepared: PreparedStudy) -> np.ndarray:
    """(K, I, J, K): the signed distance (mm) of each structure's inside {o_k > 1/2} on the study's grid, its zero
    level where the occupancy crosses 1/2 (occupancy_signed_distances)."""
    shape = prepared.study.shape
    values, coverage = StructureOccupancy(scene, weights).occupancy(grid_points(prepared.affine, shape).reshape(-1, 3))
    occupancy = np.moveaxis(values, 1, 0).reshape(-1, *shape)
    filled = filled_occupancy(occupancy, coverage.reshape(shape))
    spacing = np.linalg.norm(np.asarray(prepared.affine, np.float64)[:3, :3], axis=0)
    return np.stack([occupancy_signed_distances(o, spacing) for o in filled])


def gaussian_geometry_metrics(distances: np.ndarray, prepared: PreparedStudy) -> dict[str, dict[str, Any]]:
    """Per structure name: Dice, mean surface distance, HD95, volumes, pieces and (the phantom) the distances to
    the exact surfaces and the ceilings, as train/evaluate.py figures them for a field, from the Gaussians'
    signed distances on the study grid."""
    from ..train.evaluate import ceilings, exact_surface_distances, pieces, structure_labels, surface_figures

    results: dict[str, dict[str, Any]] = {}
    for k, structure in enumerate(prepared.structures):
        truth, kept = structure_labels(prepared, k)
        distance = lambda points, k=k: sample_at(distances[k], prepared.affine, points)  # noqa: E731
        figures = surface_figures(distances[k], distance, truth, kept, prepared.boundary[k], prepared.affine)
        vertices, _ = extract_surface(distances[k], prepared.affine)
        results[structure.name] = {
            **figures,
            **pieces(truth, distances[k] < 0, prepared.affine),
            **exact_surface_distances(prepared.study.exact_surfaces, structure.name, vertices),
            **ceilings(prepared, structure.name, truth, kept, prepared.boundary[k], figures["dice"]),
        }
    return results


def gaussian_meshes(distances: np.ndarray, prepared: PreparedStudy, smoothing_iterations: int = 0,
                    decimation: float = 0.0) -> list[Mesh]:
    """One mesh per structure of the Gaussians' signed distances (empty where a structure has no inside)."""
    return mesh_sdf_grid(distances, prepared.affine, prepared.structures, smoothing_iterations, decimation)
