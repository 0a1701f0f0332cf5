"""A PyTorch peer of the stage-1 SDF fit, for ``neuralraycast bench --suite torch_peer``.

Why: hand-written Slang kernels are only worth their complexity if they beat the same model written in a
mainstream framework on the same GPU. This module writes the hash grid, the geometry network, the fit's
loss, its point batches and its optimiser in PyTorch, checks on every run that it computes what the Slang
field computes, and then measures both: points per second (eager and ``torch.compile``) and the error each
reaches in the same wall time. PyTorch is not a dependency of NeuralRaycast: it is imported inside
functions only, and this module imports without it.

The same as the Slang fit (shaders/hash_encoding.slang, mlp.slang, neural_field.slang, sdf_fit.slang,
sampling.slang, volume.slang, adam.slang; fit.py):

- the parameters: the field's own flat vector (the table of every level, then the geometry network), so
  the same initialisation;
- the hash grid: per-level cell sizes and vertex counts, dense indexing of the coarse levels, the
  XOR-of-primes hash into 2^T entries, clamping to the grid, trilinear weights, zeros beyond the active
  levels;
- the geometry network: row-major [out][in] weights then biases, ReLU hidden layers, linear output,
  distances = ``distance_scale_mm`` × the first K outputs;
- the loss: truncated L1 with τ, the Eikonal term (‖∇s_k‖ − 1)² by tetrahedral differences of the same step on
  the same whole waves of 32 points, the same scales 1 / (N·K) and λ / (N_e·K); even the derivative of
  ‖∇s‖, which Slang's standard library floors (see ``gradient_length``);
- the points: the same counter-based random numbers (the PCG hash of seed and thread) and the same seed per
  step, so a batch holds the same band and uniform points and the same trilinear targets as the Slang
  batch of that step, up to the rounding of the voxel-to-RAS transform;
- Adam: the same rates per group, betas, epsilon and bias corrections, the warm-up + cosine rate schedule
  and the coarse-to-fine level schedule of fit.py, the guard against non-finite gradients, and table
  entries without gradient in a step keep their moments (as Instant-NGP). It is written out in torch ops
  because ``torch.optim.Adam`` has no such sparse skip.

What differs:

- the order of floating-point sums (features over corners, gradients gathered by index_put, atomics in
  Slang): distances agree to about 1e-7 relative, gradients to about 1e-5; Adam's tiny epsilon turns the
  sign of near-zero gradients into whole steps, so a few table entries part after the first steps and the
  trajectories drift apart slowly, as two Slang runs on different GPUs would;
- on CUDA the Slang fit runs the geometry network on tensor cores with half operands (fp32 accumulation);
  the peer stays fp32 with TF32 off, PyTorch's default for matrix products;
- the table's gradient is gathered by PyTorch's backward of indexing (eager) or Inductor's scatter-adds
  (compiled), the Slang kernel adds it with atomics;
- only the geometry path: the appearance network gets no gradient in this stage and is left out;
- ``torch.compile`` specialises on the number of active levels: it compiles each level count the schedule
  will reach before the race starts; that time is reported as compile time and is not part of the race.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..field.field import FieldLayout, NeuralField
from ..field.sdf_fit import WAVE, FitConfig, SdfFitter, active_levels, band_errors, band_voxels, learning_rate_factor
from ..progress import Progress

if TYPE_CHECKING:
    import torch

    from ..gpu.device import GpuContext
    from ..study.preprocess import PreparedStudy
    from .report import BenchRow

TORCH_MISSING = "PyTorch is not installed: the peer benchmark needs it (it is not a dependency of NeuralRaycast)"
HASH_PRIME_Y, HASH_PRIME_Z = 2654435761, 805459861  # shaders/hash_encoding.slang
UINT32 = 0xFFFFFFFF
SQRT_SLOPE_FLOOR = 1e-7  # Slang differentiates sqrt(u) as 0.5 / sqrt(max(1e-7, u))
DISTANCE_TOLERANCE_MM = 1e-5  # allowed |s_torch − s_slang|, plus DISTANCE_TOLERANCE_RELATIVE × max |s|
DISTANCE_TOLERANCE_RELATIVE = 1e-4
LOSS_TOLERANCE = 1e-3  # allowed relative difference of one batch's loss
CHECK_POINTS = 4096
RACE_CHUNK = 25  # steps between looks at the clock, as bench_sdf_fit
WARM_UP_STEPS = 3  # steps that compile (torch.compile) or warm up (eager) before anything is timed
TARGET_ERROR_MM = 0.5
BAND_MM = 5.0
SUITE = "torch_peer"


#: the corners v_j of the tetrahedral differences in shaders/neural_field.slang
TETRAHEDRON = ((1.0, -1.0, -1.0), (-1.0, -1.0, 1.0), (-1.0, 1.0, -1.0), (1.0, 1.0, 1.0))


class PeerMismatchError(RuntimeError):
    """The PyTorch peer does not compute what the Slang field computes: its timings would mean nothing."""


def import_torch():
    """PyTorch, or a RuntimeError that says it is optional (it is never imported at module level)."""
    try:
        import torch
    except ImportError as error:
        raise RuntimeError(TORCH_MISSING) from error
    return torch


def torch_device() -> torch.device:
    """CUDA where PyTorch sees a GPU, else the CPU."""
    torch = import_torch()
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that wall-clock times cover it."""
    if device.type == "cuda":
        import_torch().cuda.synchronize(device)


def geometry_widths(layout: FieldLayout) -> list[int]:
    """Layer widths of the geometry network: L·F encoded inputs, the hidden layers, K + G outputs."""
    enc, net = layout.config.encoding, layout.config.network
    return [enc.levels * enc.features] + [net.hidden] * net.hidden_layers + [layout.structures + net.geometry_features]


# --- the geometry path of shaders/neural_field.slang ----------------------------------------------------------


def _define_geometry_field() -> type:
    """The ``TorchGeometryField`` class (defined on first use: it subclasses ``torch.nn.Module``)."""
    torch = import_torch()

    class TorchGeometryField(torch.nn.Module):
        """The Slang field's geometry path in PyTorch (fp32): hash grid → MLP → K signed distances in mm.

        Built from a layout and the field's flat parameter vector (``NeuralField.parameters()``). The table is
        one (rows, F) parameter and every layer's weights and biases are parameters of their own, so that
        Adam can give the table and the network their own rates.
        """

        def __init__(self, layout: FieldLayout, parameters: np.ndarray, device: torch.device | None = None) -> None:
            super().__init__()
            values = np.asarray(parameters, dtype=np.float32).reshape(-1)
            if values.size != layout.count:
                raise ValueError(f"expected {layout.count} parameters, got {values.size}")
            self.layout = layout
            self.features = layout.config.encoding.features
            self.structures = layout.structures
            self.distance_scale = float(layout.config.network.distance_scale_mm)
            flat = torch.from_numpy(values[: layout.appearance_offset].copy())
            self.table = torch.nn.Parameter(flat[: layout.geometry_offset].reshape(-1, self.features))
            weights, biases, offset = [], [], layout.geometry_offset
            widths = geometry_widths(layout)
            for fan_in, fan_out in zip(widths[:-1], widths[1:], strict=True):
                weights.append(torch.nn.Parameter(flat[offset : offset + fan_in * fan_out].reshape(fan_out, fan_in)))
                offset += fan_in * fan_out
                biases.append(torch.nn.Parameter(flat[offset : offset + fan_out]))
                offset += fan_out
            self.weights = torch.nn.ParameterList(weights)
            self.biases = torch.nn.ParameterList(biases)
            self._register_levels(layout)
            if device is not None:
                self.to(device)

        def _register_levels(self, layout: FieldLayout) -> None:
            """Per-level constants as buffers, in the precision the shader gets them (fp32 and integers)."""
            levels = layout.levels
            dims = torch.tensor([level.dims for level in levels], dtype=torch.int64)
            dense = torch.tensor([level.dense for level in levels])
            strides = torch.stack([torch.ones_like(dims[:, 0]), dims[:, 0], dims[:, 0] * dims[:, 1]], dim=1)
            primes = torch.tensor([1, HASH_PRIME_Y, HASH_PRIME_Z], dtype=torch.int64)
            # Per axis, what a vertex coordinate is multiplied by: the strides when dense, the primes when hashed.
            self.register_buffer("factors", torch.where(dense[:, None], strides, primes))
            self.register_buffer("dense", dense)
            self.xor_hash = layout.config.encoding.hash == "xor"
            self.register_buffer("origin", torch.tensor(layout.origin, dtype=torch.float32))
            self.register_buffer("cell_inv", torch.tensor([1.0 / level.cell_mm for level in levels],
                                                          dtype=torch.float32))
            self.register_buffer("high", (dims - 1).to(torch.float32))
            self.register_buffer("last_base", dims - 2)
            self.register_buffer("hash_mask", torch.tensor([level.size - 1 for level in levels], dtype=torch.int64))
            self.register_buffer("first_row", torch.tensor([level.offset // self.features for level in levels],
                                                           dtype=torch.int64))

        @property
        def levels(self) -> int:
            return len(self.layout.levels)

        def table_rows(self, base: torch.Tensor, active: int) -> torch.Tensor:
            """Table rows (N, A, 8) of the corners of each point's cell in the first ``active`` levels, corner
            c = (c & 1, c >> 1 & 1, c >> 2 & 1) as ``GridCell.corner``."""
            terms = torch.stack([base, base + 1], dim=2) * self.factors[:active, None, :]  # (N, A, 2, 3)
            tx, ty, tz = terms[..., 0], terms[..., 1], terms[..., 2]
            summed = tz[..., :, None, None] + ty[..., None, :, None] + tx[..., None, None, :]
            yz = tz[..., :, None, None] ^ ty[..., None, :, None]
            hashed = yz ^ tx[..., None, None, :] if self.xor_hash else yz + tx[..., None, None, :]
            hashed = hashed & self.hash_mask[:active, None, None, None]
            entry = torch.where(self.dense[:active, None, None, None], summed, hashed)
            return entry.flatten(2) + self.first_row[:active, None]

        def encode(self, x: torch.Tensor, active: int | None = None) -> torch.Tensor:
            """Hash-grid features (N, L·F) at RAS points x (N, 3); the levels from ``active`` on are zeros."""
            active = self.levels if active is None else max(1, min(int(active), self.levels))
            g = (x[:, None, :] - self.origin) * self.cell_inv[:active, None]
            g = torch.minimum(torch.clamp(g, min=0.0), self.high[:active])
            base = torch.minimum(torch.floor(g).to(torch.int64), self.last_base[:active]).clamp(min=0)
            f = g - base.to(torch.float32)
            w = torch.stack([1.0 - f, f], dim=2)  # (N, A, 2, 3): weights of the low and high vertex per axis
            wx, wy, wz = w[..., 0], w[..., 1], w[..., 2]
            weights = ((wx[..., None, None, :] * wy[..., None, :, None]) * wz[..., :, None, None]).flatten(2)
            values = self.table[self.table_rows(base, active)]  # (N, A, 8, F)
            features = (weights[..., None] * values).sum(dim=2).flatten(1)
            if active < self.levels:
                features = torch.nn.functional.pad(features, (0, (self.levels - active) * self.features))
            return features

        def network(self, encoded: torch.Tensor) -> torch.Tensor:
            """Raw geometry outputs (N, K + G): ReLU hidden layers, a linear output layer."""
            h, last = encoded, len(self.weights) - 1
            for index, (weight, bias) in enumerate(zip(self.weights, self.biases, strict=True)):
                h = torch.nn.functional.linear(h, weight, bias)
                if index < last:
                    h = torch.relu(h)
            return h

        def forward(self, x: torch.Tensor, active: int | None = None) -> torch.Tensor:
            """Signed distances (N, K) in mm at RAS points x (N, 3) inside the field's box."""
            return self.distance_scale * self.network(self.encode(x, active))[:, : self.structures]

        def table_parameters(self) -> list[torch.nn.Parameter]:
            return [self.table]

        def network_parameters(self) -> list[torch.nn.Parameter]:
            return [*self.weights, *self.biases]

        def flat_parameters(self, template: np.ndarray) -> np.ndarray:
            """The field's flat parameter vector: ``template`` (for the appearance network) with the table and
            the geometry network replaced by this module's current values."""
            values = np.array(template, dtype=np.float32).reshape(-1)
            offset = 0
            for tensor in [self.table] + [t for pair in zip(self.weights, self.biases, strict=True) for t in pair]:
                flat = tensor.detach().cpu().numpy().reshape(-1)
                values[offset : offset + flat.size] = flat
                offset += flat.size
            return values

    return TorchGeometryField


_CLASSES: dict[str, type] = {}


def geometry_field_class() -> type:
    """``TorchGeometryField``, defined once on first use (importing this module needs no PyTorch)."""
    if "TorchGeometryField" not in _CLASSES:
        _CLASSES["TorchGeometryField"] = _define_geometry_field()
    return _CLASSES["TorchGeometryField"]


def __getattr__(name: str) -> Any:
    """``from NeuralRaycastLib.bench.torch_peer import TorchGeometryField`` works, and imports PyTorch only then."""
    if name == "TorchGeometryField":
        return geometry_field_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- the loss of shaders/sdf_fit.slang ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LossSettings:
    """The ``FitSettings`` of shaders/sdf_fit.slang that shape the loss, and the level count of the step."""

    active: int
    truncation: float
    eikonal_step: float
    data_scale: float
    eikonal_scale: float


def _fp32(value: float) -> float:
    """``value`` rounded as the shader receives it (a float uniform)."""
    return float(np.float32(value))


def loss_settings(layout: FieldLayout, config: FitConfig, batch: int, active: int) -> LossSettings:
    """What ``SdfFitter.settings`` gives the shader for a batch of ``batch`` points and ``active`` levels."""
    waves = batch // WAVE
    eikonal_points = WAVE * math.ceil(waves / config.eikonal_every)
    return LossSettings(
        active=active,
        truncation=_fp32(config.truncation_mm),
        eikonal_step=_fp32(config.eikonal_step_cells * layout.levels[active - 1].cell_mm),
        data_scale=_fp32(1.0 / (batch * layout.structures)),
        eikonal_scale=_fp32(config.eikonal_weight / (eikonal_points * layout.structures)),
    )


def truncated_error(distance: torch.Tensor, target: torch.Tensor, truncation: float) -> torch.Tensor:
    """e_τ(s, B): |s − B| where |B| < τ; beyond, only a distance on the wrong side of ±τ is penalised."""
    torch = import_torch()
    beyond = torch.where(target >= truncation, torch.relu(truncation - distance), torch.relu(distance + truncation))
    return torch.where(target.abs() < truncation, (distance - target).abs(), beyond)


def gradient_length(gradient: torch.Tensor) -> torch.Tensor:
    """‖∇s‖ over the last axis, with the derivative Slang's ``length`` has: its standard library differentiates
    sqrt(u) as 0.5 / sqrt(max(1e-7, u)), so the Eikonal term pulls less where ‖∇s‖ < 3.2e-4 (a field near
    its initial state). The value itself is the exact length."""
    torch = import_torch()
    squared = (gradient * gradient).sum(dim=-1)
    slope = 0.5 / torch.sqrt(torch.clamp(squared, min=SQRT_SLOPE_FLOOR))
    return torch.sqrt(squared).detach() + slope.detach() * (squared - squared.detach())


def sdf_fit_loss(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, eikonal_index: torch.Tensor,
                 settings: LossSettings) -> torch.Tensor:
    """The batch loss of shaders/sdf_fit.slang: the sum of ``pointLoss`` over the batch.

    x (N, 3), target (N, K); ``eikonal_index`` are the points that also carry the Eikonal term. Their gradients
    come from the tetrahedron of ``eikonalStencil``, whose first corner is the point itself: the other three
    corners x + e·(v_j − v_0) (e = h / √3) are evaluated with the batch in one go.
    """
    torch = import_torch()
    n = x.shape[0]
    e = _fp32(settings.eikonal_step * _fp32(0.57735026919))
    corners = torch.tensor(TETRAHEDRON, dtype=x.dtype, device=x.device)
    offsets = e * (corners[1:] - corners[0])
    points = torch.cat([x, (x[eikonal_index][None] + offsets[:, None]).reshape(-1, 3)])
    distances = model(points, settings.active)
    distance, others = distances[:n], distances[n:].reshape(3, -1, distances.shape[1])
    at_corner = [distance[eikonal_index], *others]
    weight = _fp32(0.25 / e)  # the shader adds (weight · s(corner j)) · v_j per corner
    gradient = sum((weight * at_corner[j])[..., None] * corners[j] for j in range(4))
    data = truncated_error(distance, target, settings.truncation).sum()
    eikonal = ((gradient_length(gradient) - 1.0) ** 2).sum()
    return settings.data_scale * data + settings.eikonal_scale * eikonal


# --- the point batches of shaders/sdf_fit.slang ------------------------------------------------------------------


def pcg_hash(v: torch.Tensor) -> torch.Tensor:
    """``pcgHash`` of shaders/sampling.slang, on int64 tensors that hold uint32 values."""
    state = (v * 747796405 + 2891336453) & UINT32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & UINT32
    return (word >> 22) ^ word


def batch_seed(config: FitConfig, step: int) -> int:
    """The random seed of a step's batch, as ``SdfFitter.settings`` makes it."""
    return (config.seed * 1_000_003 + step * 7919 + 1) & UINT32


def _affine_rows(matrix: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """mul(M, float4(p, 1)).xyz, summed in the shader's order (no matrix product, whose rounding differs)."""
    torch = import_torch()
    return torch.stack([matrix[a, 0] * points[:, 0] + matrix[a, 1] * points[:, 1] + matrix[a, 2] * points[:, 2]
                        + matrix[a, 3] for a in range(3)], dim=1)


class PeerBatches:
    """The SDF fit's point batches in PyTorch: ``drawSample`` of shaders/sdf_fit.slang for every thread.

    The shader's random numbers are a counter-based hash of (seed, thread), so they are reproduced exactly: a
    batch holds the points of the Slang batch of the same step, up to the rounding of the voxel-to-RAS
    transform (where the GPU may fuse multiply-adds).
    """

    def __init__(self, prepared: PreparedStudy, config: FitConfig, device: torch.device) -> None:
        torch = import_torch()
        self.config, self.device = config, device
        self.batch = -(-config.batch // WAVE) * WAVE
        self.structures = int(prepared.boundary.shape[0])
        voxels, offsets, counts = band_voxels(prepared, config.band_mm)

        def tensor(values, dtype) -> torch.Tensor:
            return torch.as_tensor(np.asarray(values), dtype=dtype, device=device)

        self.threads = torch.arange(self.batch, dtype=torch.int64, device=device)
        self.eikonal_index = torch.nonzero((self.threads // WAVE) % config.eikonal_every == 0).reshape(-1)
        self.voxels = tensor(voxels, torch.int64)
        self.offsets, self.counts = tensor(offsets, torch.int64), tensor(counts, torch.int64)
        self.count_floats = tensor(counts, torch.float32)
        self.ijk_to_ras = tensor(np.asarray(prepared.affine, dtype=np.float32), torch.float32)
        self.ras_to_ijk = tensor(np.linalg.inv(prepared.affine).astype(np.float32), torch.float32)
        low, high = (np.asarray(bound, dtype=np.float32) for bound in prepared.bounds)
        self.low, self.span = tensor(low, torch.float32), tensor(high - low, torch.float32)
        self.band_fraction = _fp32(config.band_fraction)
        boundary = np.ascontiguousarray(prepared.boundary, dtype=np.float32)
        self.dims = tensor(boundary.shape[1:], torch.int64)
        self.boundary = tensor(boundary.reshape(self.structures, -1), torch.float32)

    def seed(self, step: int) -> torch.Tensor:
        """Step ``step``'s seed as a device scalar (a tensor, so that a compiled loss does not specialise on it)."""
        torch = import_torch()
        return torch.tensor(batch_seed(self.config, step), dtype=torch.int64, device=self.device)

    def draw(self, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Points (N, 3) and their targets B_k (N, K) of the batch of ``seed`` (``samplePoint`` per thread)."""
        torch = import_torch()
        state = pcg_hash(seed ^ pcg_hash(self.threads))
        draws = []
        for _ in range(6):  # pick, structure, u.x, u.y, u.z, voxel: the order of samplePoint
            state = pcg_hash(state)
            draws.append((state >> 8).to(torch.float32) * (1.0 / 16777216.0))
        pick, which, ux, uy, uz, r = draws
        k = torch.clamp((which * float(self.structures)).to(torch.int64), max=self.structures - 1)
        count = self.counts[k]
        slot = torch.minimum((r * self.count_floats[k]).to(torch.int64), count - 1)
        index = torch.clamp(self.offsets[k] + slot, 0, self.voxels.shape[0] - 1)  # valid even where unused
        u = torch.stack([ux, uy, uz], dim=1)
        band = _affine_rows(self.ijk_to_ras, self.voxels[index].to(torch.float32) + u - 0.5)
        uniform = self.low + u * self.span
        x = torch.where(((pick < self.band_fraction) & (count > 0))[:, None], band, uniform)
        return x, self.targets(x)

    def targets(self, x: torch.Tensor) -> torch.Tensor:
        """B_k (N, K) at RAS points: trilinear, clamped to the edge voxels, as ``VolumeStack.sample``."""
        torch = import_torch()
        p = torch.minimum(torch.clamp(_affine_rows(self.ras_to_ijk, x), min=0.0), (self.dims - 1).to(torch.float32))
        base = torch.minimum(torch.floor(p).to(torch.int64), self.dims - 2).clamp(min=0)
        f = p - base.to(torch.float32)
        rows, columns = self.dims[1], self.dims[2]

        def corner(i: int, j: int, k: int) -> torch.Tensor:
            return self.boundary[:, ((base[:, 0] + i) * rows + base[:, 1] + j) * columns + base[:, 2] + k]

        def lerp(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return a + (b - a) * t

        def face(i: int) -> torch.Tensor:
            low = lerp(corner(i, 0, 0), corner(i, 0, 1), f[:, 2])
            return lerp(low, lerp(corner(i, 1, 0), corner(i, 1, 1), f[:, 2]), f[:, 1])

        return lerp(face(0), face(1), f[:, 0]).T


# --- Adam of shaders/adam.slang, and the fit of fit.py ----------------------------------------------------------


def adam_update(values: list[torch.Tensor], grads: list[torch.Tensor], firsts: list[torch.Tensor],
                seconds: list[torch.Tensor], groups: list[int], sparse: list[bool], scalars: torch.Tensor,
                beta1: float, beta2: float, epsilon: float) -> None:
    """``adamStep`` of shaders/adam.slang on lists of tensors, in place: non-finite gradients count as 0, and the
    entries of a sparse group without gradient keep their value and moments. ``scalars`` holds the step's rate
    of each group, then the bias corrections 1 / (1 − β1^t) and 1 / (1 − β2^t): a tensor, since they change
    every step and a compiled update must not specialise on them."""
    torch = import_torch()
    correction1, correction2 = scalars[-2], scalars[-1]
    with torch.no_grad():
        for value, grad, m, v, group, skip in zip(values, grads, firsts, seconds, groups, sparse, strict=True):
            g = torch.where(torch.isfinite(grad), grad, 0.0)
            new_m = g + beta1 * (m - g)
            new_v = g * g + beta2 * (v - g * g)
            new_value = value - scalars[group] * (new_m * correction1) / (torch.sqrt(new_v * correction2) + epsilon)
            if skip:
                touched = g != 0.0
                new_m, new_v = torch.where(touched, new_m, m), torch.where(touched, new_v, v)
                new_value = torch.where(touched, new_value, value)
            m.copy_(new_m)
            v.copy_(new_v)
            value.copy_(new_value)


class PeerFitter:
    """``SdfFitter.step`` in PyTorch (level and rate schedules, batch, loss, backward, Adam) on a
    ``TorchGeometryField``; ``compiled`` runs the loss (forward and backward) and Adam through ``torch.compile``.
    """

    def __init__(self, model: torch.nn.Module, batches: PeerBatches, config: FitConfig,
                 compiled: bool = False) -> None:
        torch = import_torch()
        self.model, self.batches, self.config, self.compiled = model, batches, config, compiled
        networks = model.network_parameters()
        self.parameters = model.table_parameters() + networks
        self.groups = [0] + [1] * len(networks)  # index of the rate in adam_scalars: table, geometry network
        self.sparse = [True] + [False] * len(networks)
        self.firsts = [torch.zeros_like(p) for p in self.parameters]
        self.seconds = [torch.zeros_like(p) for p in self.parameters]
        self.step_index = 0
        self.level_counts: set[int] = set()  # level counts stepped with (compiled: the variants made)
        self._loss: Callable = torch.compile(self._batch_loss, dynamic=False) if compiled else self._batch_loss
        self._adam: Callable = torch.compile(adam_update, dynamic=False) if compiled else adam_update

    def _batch_loss(self, seed: torch.Tensor, settings: LossSettings) -> torch.Tensor:
        x, target = self.batches.draw(seed)
        return sdf_fit_loss(self.model, x, target, self.batches.eikonal_index, settings)

    def settings(self, step: int, active: int | None = None) -> LossSettings:
        """The loss settings of a step: the schedule's level count unless ``active`` is given."""
        levels = self.model.levels
        active = active_levels(step, self.config, levels) if active is None else active
        return loss_settings(self.model.layout, self.config, self.batches.batch, active)

    def loss(self, step: int, active: int | None = None) -> float:
        """The loss of step ``step``'s batch with the current parameters, without gradients (eager)."""
        torch = import_torch()
        with torch.no_grad():
            return float(self._batch_loss(self.batches.seed(step), self.settings(step, active)))

    def adam_scalars(self, step: int) -> torch.Tensor:
        """A step's rates (table, geometry network) and bias corrections, as ``Adam.settings`` makes them."""
        torch = import_torch()
        c, factor, t = self.config, learning_rate_factor(step, self.config), step + 1
        values = [c.rate_table * factor, c.rate_geometry * factor, 1.0 / (1.0 - c.beta1**t), 1.0 / (1.0 - c.beta2**t)]
        return torch.tensor(values, dtype=torch.float32).to(self.batches.device, non_blocking=True)

    def step(self, active: int | None = None) -> bool:
        """One step: forward, backward, Adam. ``active`` overrides the schedule's level count. True when the step
        was the first with its level count (for a compiled fitter: it compiled)."""
        c, step = self.config, self.step_index
        settings = self.settings(step, active)
        first = settings.active not in self.level_counts
        self.level_counts.add(settings.active)
        for parameter in self.parameters:
            parameter.grad = None
        self._loss(self.batches.seed(step), settings).backward()
        self._adam(self.parameters, [p.grad for p in self.parameters], self.firsts, self.seconds, self.groups,
                   self.sparse, self.adam_scalars(step), c.beta1, c.beta2, c.epsilon)
        self.step_index += 1
        return first

    def warm_up(self, level_counts: Iterable[int], steps: int = WARM_UP_STEPS) -> float:
        """Seconds of ``steps`` steps at each level count (compiling them, for a compiled fitter), after which the
        parameters, moments and step count are put back as they were."""
        torch = import_torch()
        saved = [[t.detach().clone() for t in tensors] for tensors in (self.parameters, self.firsts, self.seconds)]
        step_index, start = self.step_index, time.perf_counter()
        for active in level_counts:
            for _ in range(steps):
                self.step(active)
        synchronize(self.batches.device)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            for tensors, copies in zip((self.parameters, self.firsts, self.seconds), saved, strict=True):
                for tensor, copy in zip(tensors, copies, strict=True):
                    tensor.copy_(copy)
        self.step_index = step_index
        return seconds


def recompile_limit(levels: int):
    """A dynamo config patch that lets torch.compile keep one variant per level count."""
    import torch._dynamo.config as dynamo

    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    return dynamo.patch({name: max(getattr(dynamo, name), 2 * levels + 8)})


# --- checks against the Slang field ------------------------------------------------------------------------------


def box_points(layout: FieldLayout, count: int, seed: int = 0) -> np.ndarray:
    """Uniform random points inside the field's box (float32, as both sides evaluate them)."""
    rng = np.random.default_rng(seed)
    low, extent = np.asarray(layout.origin), np.asarray(layout.extent)
    return (low + rng.uniform(0.0, 1.0, (count, 3)) * extent).astype(np.float32)


def perturbed_parameters(layout: FieldLayout, seed: int = 0) -> np.ndarray:
    """Initial parameters with the table in U(−1, 1): distances of millimetres, so that a wrong hash, level or
    interpolation shows (at the initial parameters every distance is within a few micrometres of 0)."""
    values = layout.initial_parameters(seed)
    values[: layout.geometry_offset] = np.random.default_rng(seed + 1).uniform(-1.0, 1.0, layout.geometry_offset)
    return values


def torch_distances(model: torch.nn.Module, points: np.ndarray, active: int | None = None) -> np.ndarray:
    """The peer's distances (N, K) at points, as numpy."""
    torch = import_torch()
    with torch.no_grad():
        x = torch.from_numpy(np.ascontiguousarray(points, np.float32)).to(model.table.device)
        return model(x, active).cpu().numpy()


def distance_difference(slang: NeuralField, model: torch.nn.Module, points: np.ndarray,
                        active: int) -> tuple[float, float]:
    """(max |s_torch − s_slang|, max |s_slang|) at points, with ``active`` levels on both sides."""
    previous, slang.active_levels = slang.active_levels, active
    try:
        reference = slang.distances(points)
    finally:
        slang.active_levels = previous
    return (float(np.max(np.abs(torch_distances(model, points, active) - reference))),
            float(np.max(np.abs(reference))))


def check_distances(slang: NeuralField, model: torch.nn.Module, points: np.ndarray, active: int, what: str) -> float:
    """Max |s_torch − s_slang|; a PeerMismatchError beyond the tolerance, so that a wrong peer is never timed."""
    difference, scale = distance_difference(slang, model, points, active)
    tolerance = DISTANCE_TOLERANCE_MM + DISTANCE_TOLERANCE_RELATIVE * scale
    if not difference <= tolerance:
        raise PeerMismatchError(f"the PyTorch peer's distances differ from the Slang field's by {difference:.3g} mm "
                                f"({what}, {active} levels; tolerance {tolerance:.3g} mm, values up to {scale:.3g} mm)")
    return difference


def check_loss(slang_loss: float, peer_loss: float) -> float:
    """|loss_torch / loss_slang − 1| for the same batch; a PeerMismatchError beyond the tolerance."""
    relative = abs(peer_loss / slang_loss - 1.0)
    if not relative <= LOSS_TOLERANCE:
        raise PeerMismatchError(f"the PyTorch peer's batch loss {peer_loss:.6g} differs from the Slang fitter's "
                                f"{slang_loss:.6g} (relative {relative:.3g}, tolerance {LOSS_TOLERANCE:g})")
    return relative


# --- the benchmark -----------------------------------------------------------------------------------------------


def band_sample(prepared: PreparedStudy, count: int = 20_000) -> tuple[np.ndarray, np.ndarray]:
    """bench_sdf_fit's evaluation points, voxel centres within 5 mm of any surface (a sample), and B_k there."""
    rng = np.random.default_rng(0)
    near = np.argwhere(np.abs(prepared.boundary).min(axis=0) < BAND_MM)
    near = near[rng.choice(len(near), min(len(near), count), replace=False)]
    points = near @ prepared.affine[:3, :3].T + prepared.affine[:3, 3]
    return points, prepared.boundary[:, near[:, 0], near[:, 1], near[:, 2]].T


def slang_points_per_second(fitter: SdfFitter, seconds: float, max_steps: int) -> tuple[float, int]:
    """(points/s, steps timed) of a Slang fitter (forward + backward + Adam), after a step that compiles."""
    fitter.step()
    fitter.gpu.device.wait()
    steps, start = 0, time.perf_counter()
    while True:
        fitter.step()
        steps += 1
        if steps % 5 == 0 or steps >= max_steps:
            fitter.gpu.device.wait()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds or steps >= max_steps:
                return steps * fitter.batch / elapsed, steps


def peer_points_per_second(fitter: PeerFitter, seconds: float, max_steps: int) -> tuple[float, int, float]:
    """(points/s, steps timed, warm-up seconds) of a peer fitter with every level active; the warm-up steps
    compile (torch.compile) or warm the caches (eager) and are not timed."""
    levels, device = fitter.model.levels, fitter.batches.device
    warm = fitter.warm_up([levels])
    steps, start = 0, time.perf_counter()
    while True:
        fitter.step(levels)
        steps += 1
        if steps % 5 == 0 or steps >= max_steps:
            synchronize(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds or steps >= max_steps:
                return steps * fitter.batches.batch / elapsed, steps, warm


@dataclass
class RaceResult:
    """One contestant's fit for a wall-clock budget, from the shared initial parameters."""

    steps: int
    seconds: float  # training time; compiles are not part of it
    error_mm: float = float("nan")  # mean |s − B| within 5 mm of each surface
    compile_seconds: float = 0.0


def race_slang(fitter: SdfFitter, points: np.ndarray, reference: np.ndarray, budget: float, progress) -> RaceResult:
    """bench_sdf_fit's loop: chunks of steps until the mean |s − B| is at most 0.5 mm or the budget is spent."""
    result = RaceResult(0, 0.0, float("inf"))
    while result.seconds < budget:
        start = time.perf_counter()
        for _ in range(RACE_CHUNK):
            fitter.step()
        fitter.gpu.device.wait()
        result.seconds += time.perf_counter() - start
        result.steps += RACE_CHUNK
        result.error_mm = band_errors(fitter.field, points, reference, BAND_MM)["mean_abs_error_mm"]
        progress(f"torch peer: Slang {result.steps} steps, {result.seconds:.1f} s, mean |s - B| "
                 f"{result.error_mm:.3f} mm", 0.4 + 0.2 * min(result.seconds / budget, 1.0))
        if result.error_mm <= TARGET_ERROR_MM:
            break
    return result


def race_levels(config: FitConfig, levels: int, budget: float, step_seconds: float) -> list[int]:
    """The level counts a fit of ``budget`` seconds may reach at ``step_seconds`` a step (with a margin)."""
    steps = int(2 * budget / max(step_seconds, 1e-9)) + RACE_CHUNK
    reached = {active_levels(step, config, levels) for step in range(0, steps, max(1, steps // 4096))}
    return sorted(reached | {active_levels(steps, config, levels)})


def race_peer(fitter: PeerFitter, budget: float, step_seconds: float) -> RaceResult:
    """Peer steps for ``budget`` seconds of training time, looking at the host clock after every step (the
    device is waited for at the end of each chunk). A step with a level count not compiled ahead is timed
    apart, as compile time."""
    device, result = fitter.batches.device, RaceResult(0, 0.0)
    while result.seconds < budget:
        chunk = int(min(RACE_CHUNK, max(1, (budget - result.seconds) / max(step_seconds, 1e-9))))
        start = time.perf_counter()
        for _ in range(chunk):
            first = fitter.step()
            result.steps += 1
            if first and fitter.compiled:
                synchronize(device)
                now = time.perf_counter()
                result.compile_seconds += now - start
                start = now
            elif result.seconds + time.perf_counter() - start >= budget:
                break
        synchronize(device)
        result.seconds += time.perf_counter() - start
    return result


def peer_error(eval_field: NeuralField, fitter: PeerFitter, template: np.ndarray, points: np.ndarray,
               reference: np.ndarray) -> float:
    """bench_sdf_fit's metric for the peer: its parameters copied into a Slang field with the level count of its
    last step, measured by the same ``band_errors``."""
    eval_field.set_parameters(fitter.model.flat_parameters(template))
    eval_field.active_levels = active_levels(max(fitter.step_index - 1, 0), fitter.config, fitter.model.levels)
    return band_errors(eval_field, points, reference, BAND_MM)["mean_abs_error_mm"]


@dataclass
class PeerBench:
    """One run of the peer benchmark: the study, the shared start, and the rows so far."""

    gpu: GpuContext
    prepared: PreparedStudy
    quick: bool
    progress: Progress
    rows: list[BenchRow] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        torch = import_torch()
        self.device = torch_device()
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "no CUDA: CPU"
        self.where = f"torch {torch.__version__} on {self.device.type} ({name})"
        self.layout = FieldLayout.for_study(self.prepared, small=self.gpu.report.software)
        self.size = "small field (software device)" if self.gpu.report.software else "the study's field"
        batch = 1 << (14 if self.quick else 18)
        if self.gpu.report.software:
            batch = min(batch, 1 << 12)
        self.config = FitConfig(steps=100_000, batch=batch, monitor_every=1 << 30)  # as bench_sdf_fit
        self.all_levels = dataclasses.replace(self.config, coarse_to_fine=0.0)
        self.measure_seconds, self.max_steps = (1.0, 20) if self.quick else (5.0, 500)
        self.budget_cap = 5.0 if self.quick else 30.0
        self.initial = self.layout.initial_parameters(seed=0)
        self.model_class = geometry_field_class()
        self.batches = PeerBatches(self.prepared, self.config, self.device)

    def row(self, metric: str, value: float, unit: str, notes: str = "") -> None:
        from .report import BenchRow

        self.rows.append(BenchRow(SUITE, metric, value, unit, notes))

    def model(self, parameters: np.ndarray | None = None) -> torch.nn.Module:
        return self.model_class(self.layout, self.initial if parameters is None else parameters, self.device)

    def check_agreement(self) -> NeuralField:
        """Distances at the initial and at perturbed parameters, and one batch's loss, against the Slang field's;
        raises PeerMismatchError beyond the tolerances. Returns the per-thread Slang field used."""
        self.progress("torch peer: distances and loss against the Slang field", 0.0)
        layout, levels = self.layout, len(self.layout.levels)
        slang = NeuralField(self.gpu, layout, self.initial, cooperative=False)
        points = box_points(layout, CHECK_POINTS)
        at_start = check_distances(slang, self.model(), points, levels, "initial parameters")
        self.row("max |s_torch - s_slang|, initial parameters", at_start, "mm",
                 f"{CHECK_POINTS} random points in the box, every level; {self.where}")
        perturbed = perturbed_parameters(layout)
        slang.set_parameters(perturbed)
        start_levels = min(self.config.start_levels, levels)
        worst = max(check_distances(slang, self.model(perturbed), points, active, "table in U(-1, 1)")
                    for active in (levels, start_levels))
        self.row("max |s_torch - s_slang|, table in U(-1, 1)", worst, "mm",
                 f"every level and the first {start_levels}; tolerance {DISTANCE_TOLERANCE_MM:g} mm + "
                 f"{DISTANCE_TOLERANCE_RELATIVE:g} × max |s|")
        slang.set_parameters(self.initial)
        slang_loss = SdfFitter(self.gpu, self.prepared, slang, self.config).loss()
        peer_loss = PeerFitter(self.model(), self.batches, self.config).loss(0, active=levels)
        self.row("|loss_torch / loss_slang - 1|, one batch", check_loss(slang_loss, peer_loss), "",
                 f"step 0's {self.batches.batch} points, drawn by both from the same counter-based random numbers; "
                 f"loss {slang_loss:.5g}")
        return slang

    def measure_rates(self) -> tuple[NeuralField, dict[str, float]]:
        """Points/s of Slang, torch eager and torch.compile with every level active at the same batch."""
        self.progress("torch peer: Slang points/s", 0.1)
        slang_field = NeuralField(self.gpu, self.layout, self.initial)
        fitter = SdfFitter(self.gpu, self.prepared, slang_field, self.all_levels)
        slang, steps = slang_points_per_second(fitter, self.measure_seconds, self.max_steps)
        network = "tensor cores" if slang_field.cooperative else "per thread"
        self.row("Slang points/s (forward + backward + Adam)", slang, "1/s",
                 f"batch {fitter.batch}, every level active, {steps} steps; geometry network {network}; {self.size}")
        rates = {"slang": slang}
        self.progress("torch peer: torch eager points/s", 0.2)
        eager, steps, _ = peer_points_per_second(PeerFitter(self.model(), self.batches, self.all_levels),
                                                 self.measure_seconds, self.max_steps)
        rates["eager"] = eager
        self.row("torch eager points/s (forward + backward + Adam)", eager, "1/s",
                 f"same batch and levels, {steps} steps, synchronised; {self.where}")
        self.row("Slang / torch eager points/s", slang / eager, "×", "")
        self.progress("torch peer: torch.compile (compiling)", 0.3)
        try:
            compiled, steps, warm = peer_points_per_second(
                PeerFitter(self.model(), self.batches, self.all_levels, compiled=True), self.measure_seconds,
                self.max_steps)
        except Exception as error:  # no compiler toolchain, or a backend it does not support: eager still counts
            self.row("torch.compile", float("nan"), "", "failed: " + " ".join(str(error).split())[:160])
            return slang_field, rates
        rates["compiled"] = compiled
        self.row("torch.compile: compile time", warm, "s",
                 f"first {WARM_UP_STEPS} steps with every level active (loss, its backward and Adam)")
        self.row("torch.compile points/s (forward + backward + Adam)", compiled, "1/s",
                 f"same batch and levels, {steps} steps, synchronised; {self.where}")
        self.row("Slang / torch.compile points/s", slang / compiled, "×", "")
        return slang_field, rates

    def race(self, slang_field: NeuralField, eval_field: NeuralField, rates: dict[str, float]) -> None:
        """Slang until 0.5 mm (or the cap), then each PyTorch variant for the same training time, all from the same
        initial parameters with the same schedules; the mean |s − B| each reached."""
        points, reference = band_sample(self.prepared)
        self.progress("torch peer: Slang fit", 0.4)
        slang_field.set_parameters(self.initial)
        slang_field.zero_gradients()
        fitter = SdfFitter(self.gpu, self.prepared, slang_field, self.config)
        slang = race_slang(fitter, points, reference, self.budget_cap, self.progress)
        budget, reached = slang.seconds, slang.error_mm <= TARGET_ERROR_MM
        self.row("Slang: time to mean |s - B| <= 0.5 mm (5 mm band)" if reached
                 else f"Slang: mean |s - B| after {budget:.1f} s", budget if reached else slang.error_mm,
                 "s" if reached else "mm", f"{slang.steps} steps of {fitter.batch} points: the race's time"
                 + ("" if reached else f" (capped at {self.budget_cap:g} s)"))
        contestants = [("torch eager", "eager")] + ([("torch.compile", "compiled")] if "compiled" in rates else [])
        for index, (label, key) in enumerate(contestants):
            self.progress(f"torch peer: {label} for {budget:.1f} s", 0.6 + 0.2 * index)
            peer = PeerFitter(self.model(), self.batches, self.config, compiled=key == "compiled")
            step_seconds = self.batches.batch / rates[key]
            compile_seconds = 0.0
            if peer.compiled:
                compile_seconds = peer.warm_up(race_levels(self.config, peer.model.levels, budget, step_seconds))
            result = race_peer(peer, budget, step_seconds)
            result.error_mm = peer_error(eval_field, peer, self.initial, points, reference)
            counts = len(peer.level_counts)
            compiles = (f"; {counts} level count{'s' if counts > 1 else ''} compiled in "
                        f"{compile_seconds + result.compile_seconds:.1f} s, not counted") if peer.compiled else ""
            self.row(f"{label}: mean |s - B| after the same {budget:.1f} s", result.error_mm, "mm",
                     f"{result.steps} steps in {result.seconds:.2f} s, same start and schedules{compiles}")
            self.row(f"{label} / Slang mean |s - B| at equal time", result.error_mm / slang.error_mm, "×",
                     f"Slang {slang.error_mm:.3f} mm after {slang.steps} steps")


def bench_torch_peer(gpu: GpuContext, prepared: PreparedStudy, quick: bool, progress) -> list[BenchRow]:
    """The Slang SDF fit against the same fit in PyTorch (eager and torch.compile) on this machine: agreement of
    distances and loss, points/s at the same batch, and the mean |s − B| within 5 mm reached in the same time."""
    import_torch()
    bench = PeerBench(gpu, prepared, quick, progress)
    eval_field = bench.check_agreement()
    with recompile_limit(len(bench.layout.levels)):
        slang_field, rates = bench.measure_rates()
        bench.race(slang_field, eval_field, rates)
    progress("torch peer: done", 1.0)
    return bench.rows
