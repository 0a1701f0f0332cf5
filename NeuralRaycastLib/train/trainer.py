"""Staged training of the neural field (geometry first):

1. geometry: the signed distances fit to the boundary maps B_k (SDF + Eikonal; fit.py), no rendering;
2. appearance: the appearance network learns the reference images through the differentiable renderer
   while the geometry stays fixed;
3. joint: the hash table and the appearance network train on the images (L1 + DSSIM on patches) while
   the SDF and Eikonal terms train the whole geometry and keep it a true signed distance that agrees with
   the segmentation (the geometry network's weights take no image gradient: field_scene.py says why).

Optional terms, each with its weight (0: off): ``normal_weight`` (L_norm: the volume-integrated normal
against the reference G-buffer's normal, the analytic gradient of the boundary maps) and ``depth_weight``
(L_depth: expected depth against the reference's) in stage 3, where the geometry trains;
``albedo_consistency_weight`` (L_shade: the spread of each structure's albedo over the batch, which keeps
lighting out of the albedo) in stages 2 and 3.

Every ``eval_every`` steps the held-out views are rendered and their PSNR logged; the occupancy grid
used to place samples is refreshed from the learned distances. With ``shadows`` (reference views lit
with shadows of the key light), the learned surfaces are meshed every ``mesh_every`` steps into a BVH
(on a grid at most ``mesh_grid_mm`` apart: shadows barely change, meshing is several times cheaper),
and the key light's visibility from those meshes is a fixed mask in the rendered pictures: no gradient
flows through it, so the shadows are explained by geometry and not baked into the albedo.

A step whose loss is not finite is skipped and the learning rate halved; the parameters are restored
from the last good state if they ever become non-finite. ``should_stop`` cancels between steps, keeping
the last good state.

The steps are sized to the GPU memory budget (train/memory.py: fewer patches a step where the budget cannot hold
the preset's, said through the progress); a step the device still cannot hold is taken again with half the
patches, a few times at most, and where not even one patch fits, GpuMemoryError says what to lower.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from ..field.field import NeuralField
from ..field.field_render import FieldScene, boundary_occupancy, field_occupancy
from ..field.sdf_fit import Adam, FitConfig, SdfFitter, learning_rate_factor
from ..gpu.device import GpuContext, GpuMemoryError, PassClock, memory_budget
from ..gpu.memory_budget import LOWER
from ..progress import Note, Progress, ShouldStop
from ..render.image_loss import DeviceImageLoss, albedo_consistency_and_gradient
from ..render.neural_render import SHADE_WEIGHT, DiffRenderer
from ..render.patches import PatchSampler, pack_cameras
from ..render.reference_render import march_settings
from ..render.reference_views import ReferenceViews
from ..render.style import RenderStyle
from ..render.view_score import DeviceViewScorer
from ..study.preprocess import PreparedStudy
from .memory import schedule_within_budget

#: Times a run halves its patches a step where the device could not hold a step's buffers.
MEMORY_RETRIES = 4


class TrainingError(RuntimeError):
    """Training cannot go on (the loss stays non-finite); the field keeps its last good state."""


@dataclass(frozen=True)
class TrainConfig:
    geometry: FitConfig = field(default_factory=FitConfig)  # stage 1
    appearance_steps: int = 300  # stage 2
    joint_steps: int = 1500  # stage 3
    patches: int = 32  # per step, of patch_size² rays each
    patch_size: int = 16
    max_samples: int = 256  # per ray
    image_weight: float = 1.0
    sdf_weight: float = 0.1  # of the SDF + Eikonal loss in stage 3 (relative to the image loss)
    sdf_batch: int = 1 << 14
    rate_table: float = 5e-3
    rate_geometry: float = 2e-3
    rate_appearance: float = 5e-3
    occupancy_cell_mm: float = 4.0
    # Composited segments adding less than this to their pixel borrow a shaded neighbour's surface values while
    # training (neural_render.SHADE_WEIGHT says more; the quick preset's is larger, see there).
    shade_weight: float = SHADE_WEIGHT
    # Occupancy cells of the finished field's pictures (Trainer.use_picture_settings, run renderers): finer than
    # training's, so rays place fewer samples in empty space and the distances pass takes less time, the picture
    # the same to well within 8-bit steps; the fine grid is made once (BENCHMARKS.md). Training keeps its coarser
    # grid, refreshed at every evaluation.
    render_cell_mm: float = 1.0
    # ... and in the finished field's pictures: at 3e-3 a trained quick field's views shade markedly fewer
    # segments per ray than at 1e-3, the pictures within 63 dB of exact shading (8-bit steps are 59 dB) and as
    # close to the references (BENCHMARKS.md). The standard preset's is 4e-3 (see there).
    render_shade_weight: float = 3e-3
    eval_every: int = 200
    seed: int = 0
    max_bad_steps: int = 5  # consecutive non-finite losses before giving up
    normal_weight: float = 0.0  # L_norm, stage 3
    depth_weight: float = 0.0  # L_depth (per depth_scale_mm of error), stage 3
    depth_scale_mm: float = 1.0
    albedo_consistency_weight: float = 0.0  # L_shade, stages 2 and 3
    shadows: bool = False  # the references have key-light shadows: shade through meshes of the learned SDF
    mesh_every: int = 50  # steps of stages 2 and 3 between re-extractions of those meshes
    mesh_grid_mm: float = 2.0  # those meshes: marching cubes on every n-th voxel while at most this far apart

    def with_total_steps(self, total: int) -> TrainConfig:
        """The same schedule scaled to ``total`` steps over the three stages (each at least one)."""
        steps = (self.geometry.steps, self.appearance_steps, self.joint_steps)
        scaled = [max(1, round(total * s / sum(steps))) for s in steps]
        evaluate = max(1, min(self.eval_every, scaled[1] + scaled[2]))
        return replace(self, geometry=replace(self.geometry, steps=scaled[0],
                                              monitor_every=min(self.geometry.monitor_every, scaled[0])),
                       appearance_steps=scaled[1], joint_steps=scaled[2], eval_every=evaluate)

    def render_fit_config(self, steps: int) -> FitConfig:
        """Adam settings for the rendering stages (the schedule spans ``steps``)."""
        return replace(self.geometry, steps=steps, batch=self.sdf_batch, rate_table=self.rate_table,
                       rate_geometry=self.rate_geometry, rate_appearance=self.rate_appearance,
                       warmup_steps=min(self.geometry.warmup_steps, max(steps // 10, 1)), coarse_to_fine=0.0)


@dataclass
class TrainLog:
    rows: list[dict] = dataclasses.field(default_factory=list)  # one per logged step
    seconds: float = 0.0
    stage_rays: dict[int, int] = dataclasses.field(default_factory=dict)  # rays, steps, seconds of stages 2, 3
    stage_steps: dict[int, int] = dataclasses.field(default_factory=dict)
    stage_seconds: dict[int, float] = dataclasses.field(default_factory=dict)
    # Each render stage's first step, device work included: it also loads that stage's kernels and sets up the
    # calls to them, so even with every cache warm it takes several times as long as the steps after it.
    first_step_seconds: dict[int, float] = dataclasses.field(default_factory=dict)
    sdf_first_step_seconds: float | None = None  # the SDF fit's first step, as the render stages' (None: no step)
    cancelled: bool = False
    skipped_steps: int = 0
    mesh_seconds: float = 0.0  # re-extracting the learned meshes and their BVH (training with shadows)
    mesh_extractions: int = 0
    # The memory budget and the sizes chosen under it: patches a step (the preset's and the last used), SDF
    # points a step, rays of a rendered band.
    memory: dict = dataclasses.field(default_factory=dict)
    # The run's phases before saving (train/phases.py: name, seconds, peak GPU memory), where train_study ran it.
    phases: list[dict] = dataclasses.field(default_factory=list)

    def last(self, key: str) -> float | None:
        return next((row[key] for row in reversed(self.rows) if key in row), None)

    @property
    def rays(self) -> int:
        """Rendered and back-propagated rays in stages 2 and 3."""
        return sum(self.stage_rays.values())

    @property
    def render_seconds(self) -> float:
        return sum(self.stage_seconds.values())

    def rays_per_second(self, stage: int | None = None, after_first_step: bool = False) -> float:
        """Training throughput (forward + backward + Adam) of stage 2 or 3, or of both; ``after_first_step``
        leaves out each stage's first step, and with it the one-time cost of loading its kernels."""
        stages = sorted(self.stage_rays) if stage is None else [stage]
        rays = sum(self.stage_rays.get(s, 0) for s in stages)
        seconds = sum(self.stage_seconds.get(s, 0.0) for s in stages)
        if after_first_step:
            firsts = [s for s in stages if s in self.first_step_seconds]
            rays -= sum(self.stage_rays[s] // self.stage_steps[s] for s in firsts)
            seconds -= sum(self.first_step_seconds[s] for s in firsts)
        return rays / seconds if seconds > 0 and rays > 0 else 0.0


def field_renderer(
    gpu: GpuContext,
    prepared: PreparedStudy,
    field: NeuralField,
    max_samples: int,
    style: RenderStyle | None = None,
    occupancy_cell_mm: float = 4.0,
    from_boundary: bool = False,
    shade_weight: float = SHADE_WEIGHT,
) -> DiffRenderer:
    """The differentiable renderer of a field, in the study's style; samples placed where the learned
    distances (or, before training, the boundary maps) put a surface."""
    style = style or RenderStyle.default(prepared.structures, prepared.channel_names)
    settings = march_settings(prepared, style)
    box = np.array([list(settings["boxMin"]), list(settings["boxMax"])], np.float64)
    epsilon = float(settings["epsilon"])
    occupancy = (boundary_occupancy(prepared, box, occupancy_cell_mm, epsilon) if from_boundary
                 else field_occupancy(field, box, occupancy_cell_mm, epsilon))
    renderer = DiffRenderer(gpu, FieldScene(gpu, field, prepared),
                            style.shader_look(prepared.structures, prepared.channel_names), style.shader_lighting(),
                            settings, occupancy, max_samples=max_samples,
                            shade_weight=shade_weight)
    return renderer


def learned_mesh_shadows(gpu: GpuContext, prepared: PreparedStudy, field: NeuralField, style: RenderStyle,
                         grid_mm: float = 0.0):
    """Key-light shadows from meshes of the field's learned surfaces (marching cubes on the study grid, or on
    every n-th voxel where that is still at most ``grid_mm`` apart; BVH), for ``set_mesh_shadows``."""
    from ..mesh.mesh import coarsened_grid, resample_sdf
    from ..render.reference_render import hybrid_shadows

    stride = max(1, int(grid_mm / float(prepared.spacing.max()) + 1e-9))
    affine, shape = coarsened_grid(prepared.affine, prepared.study.shape, stride)
    return hybrid_shadows(gpu, prepared, style, resample_sdf(field.distances, affine, shape), affine)


def score_views(renderer: DiffRenderer, views: ReferenceViews, indices: list[int],
                rendered: dict[int, np.ndarray] | None = None, rays_per_pass: int | None = None) -> dict[str, float]:
    """Mean PSNR and SSIM of the renderer's pictures against the reference views ``indices``
    (``rendered``: RGB pictures already made, by view index, so they are not rendered twice; ``rays_per_pass``:
    the bands' rays, default the renderer's)."""
    def picture(index: int) -> np.ndarray:
        if rendered and index in rendered:
            return rendered[index]
        return renderer.render(views.cameras[index], rays_per_pass).rgb()

    return views.score(picture, indices)


class Trainer:
    def __init__(
        self,
        gpu: GpuContext,
        prepared: PreparedStudy,
        field: NeuralField,
        views: ReferenceViews,
        config: TrainConfig,
        style: RenderStyle | None = None,
    ) -> None:
        budget = memory_budget(gpu)
        sized, self.memory_note = schedule_within_budget(config, budget, len(prepared.structures))
        self.gpu, self.prepared, self.field, self.views, self.config = gpu, prepared, field, views, sized
        self._report: Progress = lambda message, fraction: None
        self._memory_retries = 0
        self.style = style or RenderStyle.default(prepared.structures, prepared.channel_names)
        self._renderer: DiffRenderer | None = None  # made at first use (renderer)
        if config.appearance_steps + config.joint_steps:  # a schedule that renders: made with the trainer
            _ = self.renderer
        self._scorer: DeviceViewScorer | None = None  # made at the first evaluation
        self.log = TrainLog(memory={"budget_bytes": budget.bytes, "budget_source": budget.source,
                                    "held_bytes": budget.held, "preset_patches": config.patches,
                                    "patches": sized.patches, "sdf_points": sized.geometry.batch})

    @property
    def renderer(self) -> DiffRenderer:
        """The field's differentiable renderer, made at first use: a fit of the geometry alone (a pretrained
        appearance follows, with a renderer of its own) never renders, and making it uploads the study's local
        inputs and works out the boundary maps' occupancy."""
        if self._renderer is None:
            c = self.config
            self._renderer = field_renderer(self.gpu, self.prepared, self.field, c.max_samples, self.style,
                                            c.occupancy_cell_mm, from_boundary=True, shade_weight=c.shade_weight)
        return self._renderer

    @renderer.setter
    def renderer(self, renderer: DiffRenderer) -> None:
        self._renderer = renderer

    @property
    def made_renderer(self) -> DiffRenderer | None:
        """The renderer where it has been made (None: no step or caller has needed it yet)."""
        return self._renderer

    # What the image steps read, made at the first that needs them: a fit of the geometry alone (a pretrained
    # appearance without a fine-tune) never does, and the views' targets are hundreds of MB to gather.
    @cached_property
    def sampler(self) -> PatchSampler:
        return PatchSampler(self.views.targets(), self.views.training, self.config.patch_size, seed=self.config.seed)

    @cached_property
    def image_loss(self) -> DeviceImageLoss:
        return DeviceImageLoss(self.gpu, self.config.patch_size)

    @cached_property
    def _cameras(self):
        import slangpy as spy

        return spy.Tensor.from_numpy(self.gpu.device, pack_cameras(self.views.cameras).reshape(-1))

    # one step of stages 2 and 3 --------------------------------------------------------------------------
    def image_step(self, geometry: bool = True, rows: np.ndarray | None = None,
                   timings: dict[str, float] | None = None) -> dict[str, float]:
        """Render a batch of patches (``rows`` of view, x0, y0, default drawn at random), add the loss's
        gradient (to the appearance only, unless ``geometry``); returns the loss terms. ``timings``: add
        each phase's seconds there (waiting for the device after each; for profiling)."""
        c = self.config
        clock = PassClock(self.gpu, timings)
        rows = self.sampler.sample(c.patches) if rows is None else rows
        batch = self.renderer.patch_rays(self._cameras, rows, c.patch_size)
        clock.lap("rays")
        self.renderer.forward(batch, timings, for_backward=True)  # times its own passes
        clock.skip()
        terms = self.image_loss(batch, self.sampler.reference_patches(rows), c.image_weight,
                                c.normal_weight if geometry else 0.0, c.depth_weight if geometry else 0.0,
                                c.depth_scale_mm)
        clock.lap("image loss")
        if not np.isfinite(terms["loss"]):
            return {"loss": float("nan")}
        loss = terms.pop("loss")
        self.renderer.composite_backward_on_device(batch)
        clock.lap("composite backward")
        if c.albedo_consistency_weight:
            segments = self.renderer.segment_albedo(batch)
            spread, d_albedo = albedo_consistency_and_gradient(segments.albedo, segments.weight)
            self.renderer.add_albedo_gradient(batch, segments, c.albedo_consistency_weight * d_albedo)
            loss += c.albedo_consistency_weight * spread
            terms["albedo_spread"] = spread
            clock.lap("albedo consistency (host)")
        self.renderer.scene_backward(batch, geometry, timings)  # times its own passes
        clock.skip()
        return {"loss": loss, **terms}

    def _image_step_in_memory(self, geometry: bool, rows: np.ndarray | None,
                              timings: dict[str, float] | None) -> dict[str, float]:
        """:meth:`image_step`; where the device cannot hold its buffers, again with half the patches."""
        while True:
            try:
                return self.image_step(geometry=geometry, rows=rows, timings=timings)
            except GpuMemoryError as error:
                self._halve_patches(error)
                rows = None if rows is None else rows[: self.config.patches]

    def _halve_patches(self, error: GpuMemoryError) -> None:
        """Take the following steps with half the patches (the step that failed added no gradient), saying so;
        GpuMemoryError naming what to lower where already at one patch or after MEMORY_RETRIES halvings."""
        patches = self.config.patches
        if patches <= 1 or self._memory_retries >= MEMORY_RETRIES:
            raise GpuMemoryError(f"{error}, even with {patches} patch{'es' if patches > 1 else ''} a step; "
                                 f"{LOWER}") from error
        self._memory_retries += 1
        self.field.zero_gradients()
        self.renderer.release_batch()
        self.config = replace(self.config, patches=max(1, patches // 2))
        self.log.memory["patches"] = self.config.patches
        c = self.config
        done = (c.geometry.steps + sum(self.log.stage_steps.values())) / (
            c.geometry.steps + c.appearance_steps + c.joint_steps)
        self._report(Note(f"the GPU could not hold a step of {patches} patches: training on with {c.patches}"), done)

    def render_optimisers(self, steps: int) -> tuple[Adam, SdfFitter]:
        """Adam over stages 2 and 3 (``steps`` in all) and the SDF and Eikonal terms of the joint steps."""
        c = self.config
        adam = Adam(self.gpu, self.field, c.render_fit_config(steps))
        sdf = SdfFitter(self.gpu, self.prepared, self.field, replace(c.render_fit_config(steps), batch=c.sdf_batch,
                                                                     eikonal_weight=c.geometry.eikonal_weight))
        return adam, sdf

    def render_step(self, step: int, joint: bool, adam: Adam, sdf: SdfFitter, rate: float = 1.0,
                    rows: np.ndarray | None = None, timings: dict[str, float] | None = None) -> dict[str, float]:
        """One step of stage 3 (``joint``) or stage 2: the image step, the SDF and Eikonal terms when joint,
        then Adam (appearance only in stage 2) at ``rate`` times the schedule. A non-finite loss skips Adam
        and leaves the gradients accumulated; returns the loss terms (``timings``: see :meth:`image_step`)."""
        terms = self._image_step_in_memory(joint, rows, timings)
        clock = PassClock(self.gpu, timings)
        if joint:
            sdf.accumulate(step, self.config.sdf_weight)
            clock.lap("SDF and Eikonal terms")
        if np.isfinite(terms["loss"]):
            adam.step(learning_rate_factor(step, adam.config) * rate, (1.0, 1.0, 1.0) if joint else (0.0, 0.0, 1.0))
            clock.lap("Adam")
        return terms

    def profile_steps(self, joint: bool = True, steps: int = 10, patches: int | None = None) -> dict[str, float]:
        """Mean seconds per phase of a stage-3 (``joint``) or stage-2 step of ``patches`` patches (default:
        the configuration's), waiting for the device after each phase; the field is left as it was. A first,
        untimed step takes what only a first step costs (a fresh Adam's first update is several times slower
        than the next, and would make Adam look far slower in these profiles than in the SDF fit's)."""
        saved = self.field.parameters()
        adam, sdf = self.render_optimisers(steps + 1)
        timings: dict[str, float] = {}
        for step in range(steps + 1):
            self.render_step(step, joint, adam, sdf, rows=self.sampler.sample(patches or self.config.patches),
                             timings=timings if step else None)
        self.field.set_parameters(saved)
        self.field.zero_gradients()
        return {name: seconds / steps for name, seconds in timings.items()}

    def evaluate_views(self, indices: list[int] | None = None) -> dict[str, float]:
        """Held-out scores, rendered in bands of a training step's rays: the step's buffers serve them, where a
        band sized for rendering alone would replace them with larger ones that the following steps then fill
        with their gradients on top (what set the peak under a memory budget)."""
        rays = self.config.patches * self.config.patch_size**2
        if self._scorer is None:
            self._scorer = DeviceViewScorer(self.gpu)
        return self._scorer.score(self.renderer, self.views, self.views.held_out if indices is None else indices,
                                  rays_per_pass=rays)

    def refresh_meshes(self) -> None:
        """Mesh the learned surfaces (on a grid at most ``mesh_grid_mm`` apart) and shadow the key light with
        them from now on."""
        start = time.perf_counter()
        self.renderer.set_mesh_shadows(learned_mesh_shadows(self.gpu, self.prepared, self.field, self.style,
                                                            self.config.mesh_grid_mm))
        self.log.mesh_seconds += time.perf_counter() - start
        self.log.mesh_extractions += 1

    def refresh_occupancy(self, cell_mm: float | None = None) -> None:
        """Place samples where the learned distances now put a surface (cells of ``cell_mm``, default the
        training's)."""
        self.renderer.set_occupancy(field_occupancy(self.field, self.renderer.box,
                                                    cell_mm or self.config.occupancy_cell_mm, self.renderer.epsilon))

    def use_picture_settings(self) -> None:
        """Once training is over: the renderer set up for the finished field's pictures (occupancy cells of
        ``render_cell_mm``, shading down to ``render_shade_weight``)."""
        self.refresh_occupancy(self.config.render_cell_mm)
        self.renderer.forget_view_sizes()  # the fine cells' rays take a fraction of the slots training's took
        self.renderer.shade_weight = self.config.render_shade_weight

    # the whole schedule -----------------------------------------------------------------------------------
    def run(self, progress: Progress | None = None, should_stop: ShouldStop | None = None,
            phase: Callable[[str], AbstractContextManager] | None = None) -> TrainLog:
        """The whole schedule. ``phase``: where the geometry's setup (the boundary maps and their band on the
        device) and its fit are timed apart (a PhaseClock's ``phase``: "fit setup", then "SDF fit", which goes on
        to the end of the run)."""
        c = self.config
        report = progress or (lambda message, fraction: None)
        self._report = report
        stop = should_stop or (lambda: False)
        total = c.geometry.steps + c.appearance_steps + c.joint_steps
        start = time.perf_counter()
        if self.memory_note:
            report(Note(self.memory_note), 0.0)
        with ExitStack() as timed:
            if phase is not None:
                timed.enter_context(phase("fit setup"))
            fitter = SdfFitter(self.gpu, self.prepared, self.field, c.geometry)
        with (nullcontext() if phase is None else phase("SDF fit")):
            return self._run(fitter, report, stop, total, start)

    def _run(self, fitter: SdfFitter, report: Progress, stop: ShouldStop, total: int, start: float) -> TrainLog:
        c = self.config
        # stage 1: geometry from the boundary maps
        geometry = fitter.run(lambda message, fraction: report(f"geometry: {message}", fraction * c.geometry.steps
                                                               / total), stop)
        for step, loss in geometry.losses:
            self.log.rows.append({"step": step, "stage": 1, "sdf": loss})
        self.log.sdf_first_step_seconds = geometry.first_step_seconds
        if geometry.cancelled:
            return self._finish(start, cancelled=True)
        steps = c.appearance_steps + c.joint_steps
        if not steps:  # the geometry alone (a pretrained appearance follows): no render stage to set up
            return self._finish(start, cancelled=False)
        self.refresh_occupancy()
        if c.shadows:
            self.refresh_meshes()

        # stages 2 and 3: through the renderer
        adam, sdf = self.render_optimisers(steps)
        for made_now in ("sampler", "image_loss", "_cameras"):  # made here, not in the first step's time
            getattr(self, made_now)
        good = self.field.parameters()
        rate, bad = 1.0, 0
        for step in range(steps):
            if stop():
                return self._finish(start, cancelled=True)
            joint = step >= c.appearance_steps
            stage = 3 if joint else 2
            t0 = time.perf_counter()
            terms = self.render_step(step, joint, adam, sdf, rate)
            if not np.isfinite(terms["loss"]):
                self.field.zero_gradients()
                rate, bad = rate * 0.5, bad + 1
                self.log.skipped_steps += 1
                if bad > c.max_bad_steps:
                    self.field.set_parameters(good)
                    raise TrainingError(f"the loss stayed non-finite for {bad} steps at step {step}; "
                                        "the last good state is kept")
                continue
            bad = 0
            evaluate = (step + 1) % c.eval_every == 0 or step == steps - 1
            remesh = c.shadows and joint and (step + 1) % c.mesh_every == 0 and step < steps - 1
            first = stage not in self.log.first_step_seconds
            if evaluate or remesh or first or step == c.appearance_steps - 1:
                # Steps do not wait for the device: the next one is set up while it still works on this one, so
                # a step takes markedly less time than when each waits (BENCHMARKS.md).
                # A stage's time takes in its device work here, before anything else and where the stage ends;
                # each stage's first step waits too, so that its one-time cost is its own (TrainLog).
                self.gpu.device.wait()
            spent = time.perf_counter() - t0
            self.log.stage_seconds[stage] = self.log.stage_seconds.get(stage, 0.0) + spent
            self.log.stage_rays[stage] = self.log.stage_rays.get(stage, 0) + self.config.patches * c.patch_size ** 2
            self.log.stage_steps[stage] = self.log.stage_steps.get(stage, 0) + 1
            if first:
                self.log.first_step_seconds[stage] = spent
            done = c.geometry.steps + step + 1
            if step % 20 == 0 or step == steps - 1:
                self.log.rows.append({"step": done, "stage": stage, "seconds": time.perf_counter() - start,
                                      **terms})
            if evaluate:
                parameters = self.field.parameters()
                if not np.all(np.isfinite(parameters)):
                    self.field.set_parameters(good)
                    rate *= 0.5
                    self.log.skipped_steps += 1
                    continue
                good = parameters
                if joint:
                    self.refresh_occupancy()
                elapsed = time.perf_counter() - start  # before the evaluation renders
                scores = self.evaluate_views()
                self.log.rows.append({"step": done, "stage": stage, "seconds": elapsed, **scores})
                report(f"stage {stage}: loss {terms['loss']:.4f}, held-out PSNR {scores['heldout_psnr']:.2f} dB",
                       done / total)
            elif step % 10 == 0:
                report(f"stage {stage}: loss {terms['loss']:.4f}", done / total)
            if remesh:
                self.refresh_meshes()  # the geometry moved: so did its shadows
        return self._finish(start, cancelled=False)

    def _finish(self, start: float, cancelled: bool) -> TrainLog:
        if self.config.shadows:  # the renderer handed on shadows with the final geometry
            self.refresh_meshes()
        self.log.seconds = time.perf_counter() - start
        self.log.cancelled = cancelled
        if self._renderer is not None:  # a fit of the geometry alone never made one
            self.log.memory["band_rays"] = self._renderer.band_rays()
        return self.log

