"""Stage 1 of training: fit the field's signed distances to the boundary maps (no rendering).

Each step draws a batch of points on the device (most near the surfaces, the rest uniform in the box),
accumulates the gradient of the truncated L1 + Eikonal loss (shaders/sdf_fit.slang) and applies Adam
(shaders/adam.slang). Coarse hash levels are trained first and finer ones switched on as the fit goes,
as Neuralangelo does, with the central-difference step following the finest active level.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from ..gpu.device import GpuContext, PassClock, kernel_floats
from ..progress import Progress, ShouldStop
from ..render.volume import interleaved_volumes
from ..study.preprocess import PreparedStudy, StudyOutline
from ..study.study import map_in_threads
from .field import GROUP_APPEARANCE, GROUP_GEOMETRY, GROUP_TABLE, NeuralField, coop_gradient_scale

WAVE = 32  # points per wave
STEPS_AHEAD = 4  # fit steps sent to the device before waiting for it (SdfFitter.run)


@dataclass(frozen=True)
class FitConfig:
    steps: int = 2000
    batch: int = 1 << 16
    band_mm: float = 5.0  # points are drawn near surfaces from voxels with |B_k| below this
    band_fraction: float = 0.75
    truncation_mm: float = 10.0  # τ of the truncated L1 term
    eikonal_weight: float = 0.1  # λ
    eikonal_every: int = 4  # every n-th point of a batch carries the Eikonal term too
    eikonal_step_cells: float = 0.5  # central-difference step, in cells of the finest active level
    rate_table: float = 1e-2
    rate_geometry: float = 1e-2
    rate_appearance: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.99
    epsilon: float = 1e-15  # Instant-NGP's choice: tiny, so rarely touched table entries still move
    warmup_steps: int = 50
    final_rate_fraction: float = 0.1  # cosine decay from 1 to this after the warm-up
    coarse_to_fine: float = 0.3  # fraction of the steps over which the finer levels are switched on
    start_levels: int = 4
    seed: int = 0
    monitor_every: int = 50  # steps between loss evaluations and progress reports


def learning_rate_factor(step: int, config: FitConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then a cosine decay to ``final_rate_fraction`` at the last step."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(config.steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    low = config.final_rate_fraction
    return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def active_levels(step: int, config: FitConfig, levels: int) -> int:
    """Coarse-to-fine: ``start_levels`` at first, all levels once ``coarse_to_fine`` of the steps are done."""
    start = min(max(config.start_levels, 1), levels)
    ramp = config.coarse_to_fine * config.steps
    if ramp <= 0 or step >= ramp:
        return levels
    return min(levels, start + int((levels - start) * step / ramp))


class Adam:
    """Adam state on the device for one field (moments, group ids) and its step kernel."""

    def __init__(self, gpu: GpuContext, field: NeuralField, config: FitConfig, moments: bool = True) -> None:
        import slangpy as spy

        self.field, self.config = field, config
        self.module = gpu.load_module("adam")
        # Without ``moments`` (an Adam whose step is only set up: set_up_call) no buffer is made for them.
        self.m = spy.Tensor.zeros_like(field.values) if moments else field.values
        self.v = spy.Tensor.zeros_like(field.values) if moments else field.values
        # The device's layout: the kernels' unused places get no gradient, so Adam leaves them at zero.
        layout = field.kernels
        self.buffers = {  # shaders/adam.slang's AdamBuffers: the groups are contiguous in the field's buffer
            "values": field.values.storage.device_address,
            "grads": field.grads.storage.device_address,
            "m": self.m.storage.device_address,
            "v": self.v.storage.device_address,
            "count": layout.count,
            "groupStart": [layout.geometry_offset, layout.appearance_offset, layout.count],
            "shifted": layout.shifted_gradients,  # the hash table's second gradient copy
            "shiftedCount": layout.geometry_offset,
        }
        self.threads = -(-layout.count // int(self.module.adamWidth()))  # a thread per few parameters
        self.step_count = 0

    def settings(self, factor: float, group_scales: tuple[float, float, float] = (1.0, 1.0, 1.0),
                 step: int | None = None) -> dict:
        """The step's settings: of the ``step``-th update (default: the one made last)."""
        import slangpy as spy

        c, t = self.config, self.step_count if step is None else step
        rates = [0.0] * 4
        rates[GROUP_TABLE] = c.rate_table * factor * group_scales[GROUP_TABLE]
        rates[GROUP_GEOMETRY] = c.rate_geometry * factor * group_scales[GROUP_GEOMETRY]
        rates[GROUP_APPEARANCE] = c.rate_appearance * factor * group_scales[GROUP_APPEARANCE]
        return {
            "rates": spy.float4(*rates),
            "beta1": c.beta1,
            "beta2": c.beta2,
            "epsilon": c.epsilon,
            "correction1": 1.0 / (1.0 - c.beta1**t),
            "correction2": 1.0 / (1.0 - c.beta2**t),
            "sparseGroups": 1 << GROUP_TABLE,
        }

    def step(self, factor: float = 1.0, group_scales: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> None:
        """One update with the gradients accumulated so far; they are zeroed. ``group_scales`` multiply
        the rates of the hash table, geometry and appearance groups (0 freezes a group)."""
        import slangpy as spy

        self.step_count += 1
        self.field.weights_changed()
        self.module.adamStep(spy.grid((self.threads,)), self.buffers, self.settings(factor, group_scales))

    def set_up_call(self) -> None:
        """The step's call set up, not made (see SdfFitter.set_up_calls): nothing changes."""
        import slangpy as spy

        self.module.adamStep.debug_build_call_data(spy.grid((self.threads,)), self.buffers, self.settings(1.0, step=1))


def band_voxels(prepared: PreparedStudy, band_mm: float) -> tuple[np.ndarray, list[int], list[int]]:
    """Voxel indices (n, 3) with |B_k| < band_mm, grouped by structure: (voxels, offsets, counts). The same as
    ``np.argwhere(np.abs(b) < band_mm)``, in the same order, without making |B_k| or argwhere's int64 indices; the
    structures in threads at once (each a few passes over the grid)."""
    _, rows, columns = prepared.boundary.shape[1:]

    def near(b: np.ndarray) -> np.ndarray:
        flat = np.flatnonzero((b > -band_mm) & (b < band_mm))
        i, rest = np.divmod(flat, rows * columns)
        j, k = np.divmod(rest, columns)
        return np.stack([i, j, k], axis=1).astype(np.int32)

    lists = map_in_threads(near, list(prepared.boundary))
    counts = [len(v) for v in lists]
    offsets = [int(o) for o in np.concatenate([[0], np.cumsum(counts)[:-1]])]
    voxels = np.concatenate(lists) if sum(counts) else np.zeros((1, 3), np.int32)
    return voxels, offsets, counts


@dataclass
class FitResult:
    steps: int
    seconds: float
    points_per_second: float  # forward + backward + Adam
    losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    cancelled: bool = False
    # The first step's seconds, device work included: it sets up the calls to the fit's kernels (None: no step).
    first_step_seconds: float | None = None


class SdfFitter:
    """Fits ``field``'s distances to ``prepared.boundary``; ``run`` or ``step`` by step."""

    def __init__(self, gpu: GpuContext, prepared: PreparedStudy, field: NeuralField, config: FitConfig) -> None:
        import slangpy as spy

        if prepared.boundary.shape[0] != field.structures:
            raise ValueError(f"the field has {field.structures} structures, the study {prepared.boundary.shape[0]}")
        self.gpu, self.prepared, self.field, self.config = gpu, prepared, field, config
        self._adam: Adam | None = None  # made on the first step: accumulate() alone never needs it
        self._boundary, self.boundary = interleaved_volumes(gpu, prepared.boundary, np.linalg.inv(prepared.affine))
        slots = field.kernels.structures  # the structures the kernels hold: those past the study's have no band
        voxels, offsets, counts = band_voxels(prepared, config.band_mm)
        self._voxels = spy.Tensor.from_numpy(gpu.device, np.ascontiguousarray(voxels.reshape(-1)))
        unused = [0] * (slots - len(counts))
        self.band = {"voxels": self._voxels.storage.device_address, "offset": offsets + unused,
                     "count": counts + unused}
        self.step_index = 0
        self._calls_only = False  # set_up_calls: the fit's kernels' calls set up, not made
        # Whole waves of 32 points: the tensor-core network needs every lane, and the Eikonal term is
        # carried by whole waves.
        self.batch = -(-config.batch // WAVE) * WAVE
        field.zero_gradients()
        _ = field.sdf_fit_module  # loaded here, with the rest of the setup, rather than in the first step

    @property
    def eikonal_points(self) -> int:
        """Points of a step that carry the Eikonal term (those of every ``eikonal_every``-th wave)."""
        return WAVE * math.ceil(self.batch // WAVE / self.config.eikonal_every)

    def settings(self, step: int, weight: float = 1.0) -> dict:
        """The ``FitSettings`` of ``step``'s batch, its loss scaled by ``weight`` (floats as the kernels read them)."""
        import slangpy as spy

        c, layout = self.config, self.field.layout
        finest = layout.levels[self.field.active_levels - 1].cell_mm
        low, high = self.prepared.bounds
        return kernel_floats({
            "boxMin": spy.float3(*map(float, low)),
            "boxMax": spy.float3(*map(float, high)),
            "ijkToRas": spy.float4x4(np.asarray(self.prepared.affine, dtype=np.float32)),
            "bandFraction": c.band_fraction,
            "truncation": c.truncation_mm,
            "eikonalStep": c.eikonal_step_cells * finest,
            "eikonalEvery": c.eikonal_every,
            "dataScale": weight / (self.batch * layout.structures),
            "eikonalScale": weight * c.eikonal_weight / (self.eikonal_points * layout.structures),
            "seed": (c.seed * 1_000_003 + step * 7919 + 1) & 0xFFFFFFFF,
            "structures": layout.structures,
        })

    def step(self, timings: dict[str, float] | None = None) -> None:
        """One fit step. ``timings``: add each phase's seconds there (waiting for the device after each)."""
        c, step = self.config, self.step_index
        self.field.active_levels = active_levels(step, c, len(self.field.layout.levels))
        self.accumulate(step, timings=timings)
        if self._adam is None:
            self._adam = Adam(self.gpu, self.field, c)
        clock = PassClock(self.gpu, timings)
        self._adam.step(learning_rate_factor(step, c))
        clock.lap("Adam")
        self.step_index += 1

    def accumulate(self, step: int, weight: float = 1.0, timings: dict[str, float] | None = None) -> None:
        """Add ``weight`` × the gradient of one batch's SDF + Eikonal loss to the field's gradient buffer."""
        clock = PassClock(self.gpu, timings)
        settings = self.settings(step, weight)
        field = self.field
        if field.coop_vectors is not None:
            field.coop_network("geometry").gradient_scale = coop_gradient_scale(settings["dataScale"])
        struct = self._field_struct()
        clock.lap("weights to tensor-core layout" if field.cooperative or field.coop_vectors is not None
                  else "settings")
        # The waves with the Eikonal term, then the others (shaders/sdf_fit.slang's pointIndex says why apart).
        module = field.sdf_fit_module
        for kernel, points in ((module.fitEikonalWaves, self.eikonal_points),
                               (module.fitPlainWaves, self.batch - self.eikonal_points)):
            if points:
                self._call(kernel, points, struct, self.boundary, self.band, settings)
        clock.lap("fit kernel (forward + backward)")
        if field.cooperative:
            field.add_tiled_gradients()
            clock.lap("tensor-core gradients back")
        if field.coop_vectors is not None:
            field.add_coop_vector_gradients()
            clock.lap("cooperative-vector gradients back")

    def set_up_calls(self) -> None:
        """The calls of a fit step and of its loss set up, the fit's own kernels' (and Adam's) not made: slangpy
        sets a function's call up (its kernel built and loaded) on its first call with each signature of
        arguments, once in a process, which the first step would otherwise wait for. Nothing the fit reads
        changes: no point is fitted, no parameter moves, and the networks' conversions to and from the tensor
        cores' (or cooperative vectors') layout run as in a step, their copies of the weights refreshed and of the
        gradients zero (so the field's gradients stay zero)."""
        self._calls_only = True
        try:
            self.loss()
            self.accumulate(self.step_index)
            Adam(self.gpu, self.field, self.config, moments=False).set_up_call()
        finally:
            self._calls_only = False

    def _call(self, kernel, points: int, *args, **options):
        """``kernel`` over ``points`` threads; while the calls are only set up, its call set up and not made
        (None)."""
        import slangpy as spy

        if self._calls_only:
            kernel.debug_build_call_data(spy.grid((points,)), *args, **options)
            return None
        return kernel(spy.grid((points,)), *args, **options)

    def profile_steps(self, steps: int = 10) -> dict[str, float]:
        """Mean seconds per phase of a fit step, waiting for the device after each phase (the field trains on)."""
        timings: dict[str, float] = {}
        self.step()  # compiles
        self.gpu.device.wait()
        for _ in range(steps):
            self.step(timings)
        return {name: seconds / steps for name, seconds in timings.items()}

    def _field_struct(self) -> dict:
        """The field for the fit kernels (with tensor cores or cooperative vectors, after copying the current
        weights to them)."""
        if self.field.coop_vectors is not None:
            self.field.upload_coop_vector_network()
            return self.field.shader_struct(coop_vectors=True)
        if not self.field.cooperative:
            return self.field.shader_struct()
        self.field.upload_tiled_networks()
        return self.field.shader_struct(cooperative=True)

    def loss(self) -> float:
        """The loss of the next step's batch, with the current parameters."""
        values = self._call(self.field.sdf_fit_module.fitLoss.return_type("numpy"), self.batch, self._field_struct(),
                            self.boundary, self.band, self.settings(self.step_index))
        return math.nan if values is None else float(np.sum(values, dtype=np.float64))

    def run(self, progress: Progress | None = None, should_stop: ShouldStop | None = None) -> FitResult:
        """Fit to the end, or until ``should_stop()`` says so (the result then says ``cancelled``)."""
        c = self.config
        report = progress or (lambda message, fraction: None)
        result = FitResult(steps=0, seconds=0.0, points_per_second=0.0)
        timed = 0.0

        def finish_device_work() -> float:
            """Seconds spent waiting for the steps sent so far (they count in the fit's time)."""
            start = time.perf_counter()
            self.gpu.device.wait()
            return time.perf_counter() - start

        # Steps do not wait for the device, up to STEPS_AHEAD of them: the next one is sent while it still works
        # on this one, and a cancel still stops within a few steps.
        while self.step_index < c.steps:
            if should_stop is not None and should_stop():
                result.cancelled = True
                break
            monitor = self.step_index % c.monitor_every == 0
            if monitor or result.steps % STEPS_AHEAD == 0:
                timed += finish_device_work()
            if monitor:
                loss = self.loss()
                result.losses.append((self.step_index, loss))
                report(f"step {self.step_index}/{c.steps} loss {loss:.4g}", self.step_index / c.steps)
            start = time.perf_counter()
            self.step()
            if result.first_step_seconds is None:  # waited for: its own figure
                self.gpu.device.wait()
                result.first_step_seconds = time.perf_counter() - start
            timed += time.perf_counter() - start
            result.steps += 1
        timed += finish_device_work()
        result.losses.append((self.step_index, self.loss()))
        result.seconds = timed
        result.points_per_second = result.steps * self.batch / timed if timed > 0 else 0.0
        report(f"done: loss {result.losses[-1][1]:.4g}", 1.0)
        return result


@dataclass(frozen=True)
class _MapsToCome:
    """What :class:`SdfFitter` reads of a prepared study, before its maps are made: one-voxel stand-ins for them
    (of every structure, so the calls' arguments are those of the study's fit), the study's grid and box."""

    boundary: np.ndarray
    affine: np.ndarray
    bounds: np.ndarray


def set_up_fit_calls(gpu: GpuContext, field: NeuralField, config: FitConfig, outline: StudyOutline) -> None:
    """The SDF fit's calls set up (:meth:`SdfFitter.set_up_calls`) for ``field`` fitted as ``config`` says to the
    study of ``outline``, whose maps are not made yet (train/field_ahead.py): the first
    step of the run's fit then takes no longer than the others. The field is as it was."""
    from slangpy.core.function import FunctionNode

    if not hasattr(FunctionNode, "debug_build_call_data"):  # (a slangpy without it: the first step sets up)
        return
    maps = _MapsToCome(np.zeros((field.structures, 1, 1, 1), np.float32), outline.study.affine, outline.bounds)
    SdfFitter(gpu, maps, field, config).set_up_calls()  # type: ignore[arg-type]


def fit_sdf(
    gpu: GpuContext,
    prepared: PreparedStudy,
    field: NeuralField,
    config: FitConfig | None = None,
    progress: Progress | None = None,
    should_stop: ShouldStop | None = None,
) -> FitResult:
    """Fit ``field`` (in place) to the study's boundary maps."""
    return SdfFitter(gpu, prepared, field, config or FitConfig()).run(progress, should_stop)


def band_errors(field: NeuralField, points: np.ndarray, reference: np.ndarray, band_mm: float) -> dict[str, float]:
    """Mean |s - reference| and mean |‖∇s‖ - 1| over the points within ``band_mm`` of each surface.

    ``reference`` (N, K) holds the true signed distances at ``points`` (N, 3); averaged over structures.
    """
    distance = field.distances(points)
    gradient = np.linalg.norm(field.distance_gradients(points), axis=-1)
    near = np.abs(reference) < band_mm
    errors, eikonal = [], []
    for k in range(reference.shape[1]):
        if near[:, k].any():
            errors.append(float(np.mean(np.abs(distance[near[:, k], k] - reference[near[:, k], k]))))
            eikonal.append(float(np.mean(np.abs(gradient[near[:, k], k] - 1.0))))
    return {"mean_abs_error_mm": float(np.mean(errors)), "mean_gradient_error": float(np.mean(eikonal))}
