"""Training a Gaussian scene on a study's reference views, with the loss the field trains with.

    prepared study -> Gaussians on the structures' surfaces (the voxels of their boundary bands), coloured from
    the training views -> steps of patches (L1 + DSSIM, render/image_loss.py's device loss, as the field's
    trainer: no picture nor gradient crosses to the host) -> Adam on every parameter
    (shaders/adam.slang, a learning rate per kind) -> every few steps: pruning of near-transparent or oversized
    Gaussians, and splitting (large) or cloning (small) of those whose positions get large gradients, never past
    the cap that the GPU memory budget allows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from math import erf

import numpy as np
from scipy import special
from scipy.spatial import cKDTree

from ..gpu.device import GpuContext, GpuMemoryError, device_memory, memory_budget
from ..gpu.memory_budget import MemoryBudget
from ..progress import Progress, ShouldStop
from ..render.camera import Camera
from ..render.image_loss import DeviceImageLoss
from ..render.patches import PatchSampler, pack_cameras
from ..render.reference_views import ReferenceViews
from ..render.style import RenderStyle
from ..study.preprocess import PreparedStudy
from .geometry import JointStructures, StructureTrainConfig
from .look import LOOK_FLOATS, MAX_CHANNELS, Highlights, structure_looks, study_channels, texture_factors
from .scene import (
    COLOUR_TERMS,
    FRAME_FLOATS,
    GAUSSIAN_FLOATS,
    GaussianBatch,
    GaussianScene,
    GaussianSet,
    GridShape,
    MarchSettings,
)

SH_C0 = 0.28209479177387814  # shaders/gaussian_scene.slang
#: The share of a Gaussian's mass that G = exp(-m²/2) - exp(-9/2) inside m < 3 keeps (shaders/gaussian_scene.slang):
#: P(m < 3) for three degrees of freedom, less the subtracted constant over the ball, relative to (2π)^1.5.
TRUNCATED_MASS = float(erf(3 / np.sqrt(2)) - np.sqrt(2 / np.pi) * 3 * np.exp(-4.5)
                       - np.exp(-4.5) * 4 / 3 * np.pi * 27 / (2 * np.pi) ** 1.5)
#: Device bytes a Gaussian takes while training: parameters, gradients and Adam's two moments (4 floats each of
#: its 29), its entries in the grid's lists (a few cells each, with room to grow), densification's 2 statistics,
#: its structure weights with their gradients and moments (4 floats each, two for each of up to 8 structures), its
#: frame (16 floats: what the march reads of it) and its look record.
TRAINING_BYTES_PER_GAUSSIAN = (4 * 4 * GAUSSIAN_FLOATS + 4 * 32 + 4 * 2 + 4 * 4 * 2 * 8 + 4 * FRAME_FLOATS
                               + 4 * LOOK_FLOATS)


@dataclass(frozen=True)
class GaussianTrainConfig:
    steps: int = 400
    patches: int = 8
    patch_size: int = 16
    initial: int = 6000
    max_gaussians: int = 500_000
    density_per_voxel: float = 2.0  # w_max · voxel: the densest a Gaussian gets, in voxels' optical depth
    step_voxels: float = 1.0  # segment length, in voxels of the prepared study
    cell_voxels: float = 3.0  # grid cells, in voxels
    scale_voxels: float = 0.6  # standard deviation above which densification splits a Gaussian, in voxels
    spread: float = 0.8  # initial width (standard deviation) along the surface, in spacings of the Gaussians
    thickness_voxels: float = 1.0  # initial standard deviation across the surface, in voxels
    #: The share of a Gaussian's thickness with which the structure weights read it (GaussianScene): thick
    #: Gaussians make even layers for the pictures, thin ones say which side of a surface a point is on.
    geometry_thickness: float = 0.5
    #: The study's channels texture each Gaussian's colour as the reference views texture its structure's albedo
    #: (gaussians/look.py); False: one colour over a Gaussian's width, the grain left to more Gaussians.
    textured: bool = True
    rate_position: float = 0.02  # in voxels (the rate is multiplied by the voxel size)
    #: Small: the layers start even (``even_layers``), and a Gaussian's width or turn changes that evenness faster
    #: than the pictures' gradient mends it (docs/gaussians.md's learning rates).
    rate_shape: float = 0.001
    #: The density's and the colour's are small: the Gaussians start with the opacity and the shading the reference
    #: views give their surfaces (docs/gaussians.md's learning rates).
    rate_density: float = 0.003
    rate_colour: float = 0.0015
    densify_every: int = 60
    densify_until: float = 0.7  # fraction of the steps after which the count stays
    densify_fraction: float = 0.1  # of the Gaussians, those with the largest mean |∂loss/∂position| split or cloned
    #: The optical depth through a Gaussian's centre along its third axis, w √(2π) s_3, below which it is dropped as
    #: transparent. A depth rather than the density logit's sigmoid: in an even layer of wide Gaussians each holds a
    #: small share of the layer's depth, and a threshold on the logit dropped a quarter of such a layer at once
    #: (docs/gaussians.md).
    prune_depth: float = 1e-3
    max_scale_voxels: float = 6.0  # Gaussians whose largest standard deviation passes this are dropped
    eval_every: int = 100
    structure_steps: int = 60  # of the structure weights' occupancy loss, once the Gaussians are placed
    #: The occupancy loss's weight during the picture steps (its gradient also moves and shapes the Gaussians;
    #: 0: the structure weights are fitted only after them), and its points a step. With the weights' slopes the
    #: Gaussians need not move to draw the structures, and moving them unevens the pictures' layers: 0 by
    #: default (docs/gaussians.md gives the figures of each weight tried).
    structure_weight: float = 0.0
    structure_points: int = 4096
    seed: int = 0
    #: A training time budget in seconds (None: the steps alone): the run ends before a step that would pass it
    #: (budget_spent), or at ``steps``, whichever comes first, and the schedule (the learning rates' decay,
    #: densification's end) follows the larger of the steps' and the time's fractions.
    seconds: float | None = None


@dataclass
class GaussianTrainLog:
    steps: int = 0
    seconds: float = 0.0  # training after the first step, without the held-out scores taken on the way
    #: The first step, apart: on a machine that has not compiled the step's kernels it compiles them, which the
    #: time budget (GaussianTrainConfig.seconds) leaves out.
    first_step_seconds: float = 0.0
    eval_seconds: float = 0.0  # those scores
    losses: list[tuple[int, float]] = field(default_factory=list)
    counts: list[tuple[int, int]] = field(default_factory=list)
    scores: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out PSNR)
    cancelled: bool = False
    cap: int = 0
    #: (N, 2K) structure weights trained with the pictures (None: structure_weight 0), and the occupancy loss's
    #: mean over each stretch of steps, by the step that ends it.
    structures: np.ndarray | None = None
    structure_losses: list[tuple[int, float]] = field(default_factory=list)


def voxel_mm(prepared: PreparedStudy) -> float:
    return float(np.min(prepared.spacing))


def gaussian_cap(budget: MemoryBudget, config: GaussianTrainConfig) -> int:
    """The most Gaussians a run may hold: the configuration's, or fewer where the training share of the GPU
    memory budget cannot hold them (GpuMemoryError where it cannot hold the initial ones' tenth)."""
    cap = int(min(config.max_gaussians, budget.share("training") // TRAINING_BYTES_PER_GAUSSIAN))
    if cap < max(config.initial // 10, 1):
        raise GpuMemoryError(f"{budget.describe()} holds {cap:,} Gaussians while training, fewer than a tenth of "
                             f"the {config.initial:,} a run starts with")
    return cap


@dataclass
class SurfaceSamples:
    """Points on the structures' surfaces: RAS positions (N, 3), unit outward normals (N, 3), the surface area
    each stands for (N,, mm²), the optical depth one crossing of its structure's surface has in the reference
    views (N,) and that structure's index (N,)."""

    positions: np.ndarray
    normals: np.ndarray
    areas: np.ndarray
    depths: np.ndarray
    structures: np.ndarray


def crossing_depths(prepared: PreparedStudy) -> list[float]:
    """Each structure's optical depth per crossing of its surface in the reference views' image formation
    (render/style.py's default style, the one the views are rendered with)."""
    style = RenderStyle.default(prepared.structures, prepared.channel_names)
    return [style.structures[s.name].optical_depth() for s in prepared.structures]


def spread_evenly(points: np.ndarray, count: int, area: float, rng: np.random.Generator) -> np.ndarray:
    """Indices of about ``count`` of ``points`` (on a surface of ``area`` mm²) spread evenly over it: one a cell
    of a grid whose cell size is tuned to give that many, so that no two lie much closer than the cells and
    no patch of surface is left bare (a random choice clumps them, and a clumped layer speckles the picture)."""
    order = rng.permutation(len(points))
    if count >= len(points):
        return order
    offset = rng.uniform(0.0, 1.0, 3)
    size = np.sqrt(area / count)

    def one_a_cell(size: float) -> np.ndarray:
        cells = np.floor(points[order] / size + offset).astype(np.int64)
        return order[np.unique(cells, axis=0, return_index=True)[1]]

    chosen = one_a_cell(size)
    for _ in range(8):  # the cells a surface crosses depend on its orientation: tune the size to the count
        size *= np.sqrt(len(chosen) / count)
        chosen = one_a_cell(size)
    for _ in range(40):
        if len(chosen) >= count:
            break
        size *= 0.97
        chosen = one_a_cell(size)
    return rng.permutation(chosen)[:count]


def surface_points(prepared: PreparedStudy, count: int, rng: np.random.Generator) -> SurfaceSamples:
    """About ``count`` points on the structures' surfaces: voxels of their boundary bands (|B_k| under a voxel)
    moved onto the zero level along ∇B_k, each structure's share that of its band's voxels (a tenth of an
    equal share at least: small structures keep detail), spread evenly over each surface."""
    band = voxel_mm(prepared)
    linear = prepared.affine[:3, :3]
    voxel_volume = abs(float(np.linalg.det(linear)))
    depths = crossing_depths(prepared)
    per_structure = [(k, np.argwhere(np.abs(b) < band)) for k, b in enumerate(prepared.boundary)]
    per_structure = [(k, v) for k, v in per_structure if len(v)]
    if not per_structure:
        raise ValueError("the study has no structure surface to place Gaussians on")
    sizes = np.array([len(v) for _, v in per_structure], np.float64)
    shares = np.maximum(sizes / sizes.sum(), 0.1 / len(sizes))
    shares = np.ceil(count * shares / shares.sum()).astype(np.int64)
    parts: list[SurfaceSamples] = []
    to_ras = np.linalg.inv(linear).T  # ∇ in RAS from ∇ in voxel indices
    for (k, voxels), share in zip(per_structure, shares, strict=True):
        boundary = prepared.boundary[k]
        gradient = np.stack([g[tuple(voxels.T)] for g in np.gradient(boundary)], axis=1) @ to_ras.T
        length = np.linalg.norm(gradient, axis=1, keepdims=True)
        normals = np.where(length > 1e-6, gradient / np.maximum(length, 1e-6), np.array([0.0, 0.0, 1.0]))
        distance = boundary[tuple(voxels.T)].astype(np.float64)
        positions = voxels @ linear.T + prepared.affine[:3, 3] - distance[:, None] * normals
        area = len(voxels) * voxel_volume / (2.0 * band)  # the band is two voxels thick
        chosen = spread_evenly(positions, int(share), area, rng)
        # each point stands for the part of the surface nearer to it than to the others (the band's points it is
        # the nearest chosen one of): an even layer where the choice left the points unevenly spaced
        nearest = cKDTree(positions[chosen]).query(positions)[1]
        areas = area * np.bincount(nearest, minlength=len(chosen)) / len(positions)
        parts.append(SurfaceSamples(positions[chosen], normals[chosen], areas, np.full(len(chosen), depths[k]),
                                    np.full(len(chosen), k)))
    return SurfaceSamples(*(np.concatenate([getattr(p, name) for p in parts])
                            for name in ("positions", "normals", "areas", "depths", "structures")))


def rotations_to(normals: np.ndarray) -> np.ndarray:
    """(N, 4) unit quaternions (w, x, y, z) turning the z axis onto each unit normal (a Gaussian's third axis)."""
    x, y, z = np.asarray(normals, np.float64).T
    q = np.stack([1.0 + z, -y, x, np.zeros_like(z)], axis=1)
    norm = np.linalg.norm(q, axis=1, keepdims=True)
    flipped = norm[:, 0] < 1e-6  # the normal is -z: half a turn about x
    q[flipped] = (0.0, 1.0, 0.0, 0.0)
    return q / np.where(flipped[:, None], 1.0, norm)


def style_colours(prepared: PreparedStudy, samples: SurfaceSamples, textured: bool = False) -> np.ndarray:
    """(N, COLOUR_TERMS, 3) colour coefficients of Gaussians on the surfaces ``samples``: the diffuse shading the
    reference views give a crossing of their structure's surface there (docs/image-formation.md: the structure's
    albedo lit by the ambient light, the headlight |n · v| and the key light on the side the viewer is on), which
    the linear colour holds exactly for a surface along the Gaussian's plane: a constant on each side (the side
    term) and the headlight's share in |d · a| (the facing term). The structures behind others start with their
    own colour, not the colour of the pixel in front of them. The albedo is textured by its channel at the point
    unless ``textured`` (the Gaussians then take the texture at every sample: gaussians/look.py); the specular
    term is the look's too."""
    style = RenderStyle.default(prepared.structures, prepared.channel_names)
    light = style.lighting
    key = np.asarray(Highlights.of_style(prepared).key_direction)  # unit
    colours = np.array([style.structures[s.name].color or s.color for s in prepared.structures], np.float64)
    albedo = colours[samples.structures]
    if not textured:  # the texture at the Gaussian's voxel, once
        ijk = np.rint((samples.positions - prepared.affine[:3, 3]) @ np.linalg.inv(prepared.affine[:3, :3]).T)
        ijk = np.clip(ijk.astype(np.int64), 0, np.array(prepared.boundary.shape[1:]) - 1)
        values = np.zeros((len(ijk), MAX_CHANNELS))
        channels = prepared.channels[:MAX_CHANNELS]
        values[:, : len(channels)] = channels[(slice(None), *ijk.T)].T
        albedo = albedo * texture_factors(structure_looks(prepared)[samples.structures], values)[:, None]
    lit = samples.normals @ key
    # seen from outside (d · n < 0, side -1) the key light falls on n, from inside (side +1) on -n
    outside, inside = (albedo * (light.ambient + light.key * np.maximum(s * lit, 0.0))[:, None] for s in (1, -1))
    sh = np.zeros((len(albedo), COLOUR_TERMS, 3))
    sh[:, 0] = 0.5 * (outside + inside) / SH_C0
    sh[:, 4] = light.headlight * albedo
    sh[:, 5] = 0.5 * (inside - outside)
    return sh


#: Rounds of :func:`even_layers`.
EVENING_ROUNDS = 8


def crossing_profile(a: np.ndarray) -> np.ndarray:
    """The optical depth across a flat Gaussian of unit density and thickness, along its normal, at a squared
    in-plane distance of ``a`` standard deviations: the integral of its truncated shape exp(-m²/2) - exp(-9/2)
    (m < 3; shaders/gaussian_scene.slang) over the thickness."""
    a = np.asarray(a, np.float64)
    inside = np.sqrt(np.maximum(9.0 - a, 0.0))
    return np.where(a < 9.0, np.sqrt(2 * np.pi) * np.exp(-a / 2) * special.erf(inside / np.sqrt(2))
                    - 2 * np.exp(-4.5) * inside, 0.0)


def even_layers(samples: SurfaceSamples, width: np.ndarray, thickness: np.ndarray, w: np.ndarray,
                cap: float) -> np.ndarray:
    """Densities (at most ``cap``) that give each structure's layer its crossing's optical depth at every
    Gaussian's centre, from ``w``: each one's share of the area alone leaves the sum of overlapping neighbours
    uneven, which the pictures show as a speckle. The optical depth at a centre sums the crossing profiles of
    the structure's Gaussians that reach it (along each one's normal); each round scales every density by the
    square root of its centre's shortfall (a damped Jacobi step towards the target)."""
    positions, normals = samples.positions.astype(np.float64), samples.normals.astype(np.float64)
    pairs = cKDTree(positions).query_pairs(3.0 * float(width.max()), output_type="ndarray")
    pairs = pairs[samples.structures[pairs[:, 0]] == samples.structures[pairs[:, 1]]]
    receiver = np.concatenate([pairs[:, 0], pairs[:, 1], np.arange(len(positions))])
    giver = np.concatenate([pairs[:, 1], pairs[:, 0], np.arange(len(positions))])
    offset = positions[receiver] - positions[giver]
    across = np.einsum("pc,pc->p", offset, normals[giver])
    profile = thickness[giver] * crossing_profile(((offset**2).sum(axis=1) - across**2) / width[giver] ** 2)
    w = np.asarray(w, np.float64).copy()
    for _ in range(EVENING_ROUNDS):
        depth = np.bincount(receiver, weights=w[giver] * profile, minlength=len(w))
        w = np.minimum(w * np.sqrt(samples.depths / np.maximum(depth, 1e-12)), cap)
    return w


def initial_gaussians(prepared: PreparedStudy, config: GaussianTrainConfig, count: int) -> GaussianSet:
    """Flat Gaussians on the structures' surfaces, their third axis along the normal, that together make a
    layer of even optical depth: each as wide as its share of the surface (``spread`` of the spacing, so that
    neighbours overlap), ``thickness_voxels`` thick, of the density that gives its structure's surface the
    optical depth a crossing has in the reference views, and of the colour those views give it
    (:func:`style_colours`)."""
    rng = np.random.default_rng(config.seed)
    samples = surface_points(prepared, count, rng)
    sh = style_colours(prepared, samples, config.textured)
    looks = structure_looks(prepared, config.textured)[samples.structures]
    voxel = voxel_mm(prepared)
    width = np.minimum(config.spread * np.sqrt(samples.areas), 0.5 * config.max_scale_voxels * voxel)
    thickness = np.minimum(config.thickness_voxels * voxel, width)
    # A layer of Gaussians, one per area a, has the optical depth w (2π)^1.5 s_t² s_n · TRUNCATED_MASS / a across it.
    w = samples.depths * samples.areas / ((2 * np.pi) ** 1.5 * width**2 * thickness * TRUNCATED_MASS)
    w = even_layers(samples, width, thickness, w, 0.99 * config.density_per_voxel / voxel)
    opacity = np.clip(w * voxel / config.density_per_voxel, 0.01, 0.99)
    logit = np.log(opacity / (1 - opacity))
    log_scales = np.log(np.stack([width, width, thickness], axis=1))
    return GaussianSet(samples.positions, log_scales, rotations_to(samples.normals), logit, sh, looks)


def scene_grid(prepared: PreparedStudy, config: GaussianTrainConfig) -> GridShape:
    """The grid over the study's box, widened by a few voxels so that surfaces on its faces keep their Gaussians."""
    margin = 3.0 * voxel_mm(prepared)
    bounds = np.asarray(prepared.bounds, np.float64) + np.array([[-margin], [margin]])
    return GridShape.for_box(bounds, config.cell_voxels * voxel_mm(prepared))


def scene_for_study(gpu: GpuContext, prepared: PreparedStudy, gaussians: GaussianSet,
                    config: GaussianTrainConfig) -> GaussianScene:
    voxel = voxel_mm(prepared)
    return GaussianScene(gpu, gaussians, scene_grid(prepared, config), density_scale=config.density_per_voxel / voxel,
                         march=MarchSettings(config.step_voxels * voxel, 1e-3),
                         geometry_thickness=config.geometry_thickness,
                         channels=study_channels(gpu, prepared, gaussians), highlights=Highlights.of_style(prepared))


class GaussianAdam:
    """Adam (shaders/adam.slang) over a scene's flat parameters, a learning rate per kind."""

    def __init__(self, gpu: GpuContext, scene: GaussianScene, config: GaussianTrainConfig, voxel: float) -> None:
        self.gpu, self.scene, self.config, self.voxel = gpu, scene, config, voxel
        self.module = gpu.load_module("adam")
        self.step_count = 0
        self.reset()

    def reset(self, m: np.ndarray | None = None, v: np.ndarray | None = None) -> None:
        """Moments for the scene's current Gaussians (zero, or given in the flat layout)."""
        import slangpy as spy

        size = GAUSSIAN_FLOATS * self.scene.count + 4
        self.m = spy.Tensor.from_numpy(self.gpu.device, np.zeros(size, np.float32) if m is None else m)
        self.v = spy.Tensor.from_numpy(self.gpu.device, np.zeros(size, np.float32) if v is None else v)

    def moments(self) -> tuple[GaussianSet, GaussianSet]:
        n = self.scene.count
        return (GaussianSet.from_flat(np.asarray(self.m.to_numpy()), n),
                GaussianSet.from_flat(np.asarray(self.v.to_numpy()), n))

    def step(self, factor: float = 1.0) -> None:
        import slangpy as spy

        c, n = self.config, self.scene.count
        self.step_count += 1
        t = self.step_count
        buffers = {"values": self.scene.values.storage.device_address, "grads": self.scene.grads.storage.device_address,
                   "m": self.m.storage.device_address, "v": self.v.storage.device_address,
                   "count": GAUSSIAN_FLOATS * n, "groupStart": [3 * n, 10 * n, 11 * n], "shifted": 0,
                   "shiftedCount": 0}
        rates = [c.rate_position * self.voxel, c.rate_shape, c.rate_density, c.rate_colour]
        settings = {"rates": spy.float4(*(r * factor for r in rates)), "beta1": 0.9, "beta2": 0.999,
                    "epsilon": 1e-15, "correction1": 1.0 / (1.0 - 0.9**t), "correction2": 1.0 / (1.0 - 0.999**t),
                    "sparseGroups": 0}
        threads = -(-GAUSSIAN_FLOATS * n // int(self.module.adamWidth()))
        self.module.adamStep(spy.grid((threads,)), buffers, settings)


class GaussianStep:
    """A training step's work on the device: the patches' rays, their sums, the image loss and its gradient
    (render/image_loss.DeviceImageLoss, the field's), the backward pass, and densification's statistics, which
    stay on the device until :meth:`statistics` reads them. Only the patch corners and their reference go up,
    and only the loss's terms come back."""

    def __init__(self, gpu: GpuContext, scene: GaussianScene, views: ReferenceViews,
                 config: GaussianTrainConfig) -> None:
        import slangpy as spy

        self.gpu, self.scene, self.config = gpu, scene, config
        self.batch = GaussianBatch(gpu, config.patches * config.patch_size**2)
        self.cameras = spy.Tensor.from_numpy(gpu.device, pack_cameras(views.cameras).reshape(-1))
        self.image_loss = DeviceImageLoss(gpu, config.patch_size)
        self.reset_statistics()

    def loss_and_gradients(self, rows: np.ndarray, reference: np.ndarray) -> float:
        """Render patches ``rows`` (view, x0, y0), and add the gradients of their loss against ``reference``
        (P, size, size, 8: the views' G-buffer; RGBA compared) to the scene's; returns the loss."""
        self.scene.patch_rays(self.batch, self.cameras, rows, self.config.patch_size)
        self.scene.forward(self.batch)
        loss = self.image_loss(self.batch, reference)["loss"]
        if np.isfinite(loss):
            self.scene.backward(self.batch)
        return float(loss)

    def accumulate_statistics(self) -> None:
        self.scene.accumulate_position_gradients(self.stats)

    def reset_statistics(self) -> None:
        """Zeros for the scene's current Gaussians (after pruning and densification change their count)."""
        import slangpy as spy

        with device_memory(f"the statistics of {self.scene.count:,} Gaussians"):
            self.stats = spy.Tensor.zeros(self.gpu.device, shape=(2 * self.scene.count,), dtype=float)

    def statistics(self) -> tuple[np.ndarray, np.ndarray]:
        """Per Gaussian, the sum of |∂loss/∂position| since the last reset and the steps where it was not zero."""
        stats = np.asarray(self.stats.to_numpy(), np.float64).reshape(-1, 2)
        return stats[:, 0], stats[:, 1]


#: How much narrower the two halves of a split Gaussian are than the original, in its plane: √2, so that each
#: half has the original's density over half its area, and no density has to pass its cap to keep the mass.
SPLIT_SHRINK = float(np.sqrt(2.0))


def adapt(scene: GaussianScene, adam: GaussianAdam, gradient_sum: np.ndarray, seen: np.ndarray,
          config: GaussianTrainConfig, voxel: float, cap: int, rng: np.random.Generator,
          densify: bool) -> tuple[np.ndarray, np.ndarray]:
    """Prune and (``densify``) split or clone, keeping Adam's moments of the Gaussians that stay. Returns the
    indices (before the change) of the Gaussians kept and of those the new ones were grown from: the scene now
    holds the kept ones in order, then one new Gaussian per grown index."""
    gaussians = scene.gaussians()
    m, v = adam.moments()
    opacity = 1.0 / (1.0 + np.exp(-gaussians.density))
    depth = scene.density_scale * opacity * np.sqrt(2.0 * np.pi) * np.exp(gaussians.log_scales[:, 2])
    largest = np.exp(gaussians.log_scales.max(axis=1))
    finite = np.isfinite(gaussians.positions).all(axis=1) & np.isfinite(gaussians.log_scales).all(axis=1)
    keep = (depth >= config.prune_depth) & (largest <= config.max_scale_voxels * voxel) & finite
    if not keep.any():  # a scene keeps its most opaque Gaussian
        keep[np.argmax(np.where(finite, depth, -1.0))] = True
    parts, m_parts, v_parts = [gaussians.subset(keep)], [m.subset(keep)], [v.subset(keep)]
    grow = np.zeros(0, np.int64)
    if densify:
        mean = gradient_sum / np.maximum(seen, 1)
        grow = np.flatnonzero(keep & (mean > 0))
        room = min(cap - int(keep.sum()), int(config.densify_fraction * keep.sum()))
        grow = grow[np.argsort(-mean[grow])][: max(room, 0)]
        if len(grow):
            chosen = gaussians.subset(grow)
            big = np.exp(chosen.log_scales[:, :2].max(axis=1)) > config.scale_voxels * voxel  # wide in its plane
            # a large one splits in its plane (its first two axes; the third is the surface's normal) into two
            # narrower halves; a small one is cloned, each copy of half the density. Either pair keeps the
            # original's mass, so a layer's optical depth is what it was, and the training moves the pair apart.
            offsets = rng.normal(size=(len(grow), 3)) * np.exp(chosen.log_scales) * np.array([1.0, 1.0, 0.0])
            offsets = np.einsum("nab,nb->na", chosen.rotation_matrices(), offsets) * big[:, None]
            shrink = np.where(big, np.log(SPLIT_SHRINK), 0.0)[:, None] * np.array([1.0, 1.0, 0.0])
            share = np.where(big, SPLIT_SHRINK**2 / 2.0, 0.5)
            opacity = np.clip(share / (1.0 + np.exp(-chosen.density.astype(np.float64))), 1e-4, 0.999)
            density = np.log(opacity / (1.0 - opacity))
            grown_in_kept = np.searchsorted(np.flatnonzero(keep), grow)
            parts[0].positions[grown_in_kept] -= offsets
            parts[0].log_scales[grown_in_kept] -= shrink
            parts[0].density[grown_in_kept] = density
            parts.append(GaussianSet(chosen.positions + offsets, chosen.log_scales - shrink, chosen.rotations,
                                     density, chosen.colours, chosen.looks))
            zeros = GaussianSet.from_flat(np.zeros(GAUSSIAN_FLOATS * len(grow) + 4, np.float32), len(grow))
            m_parts.append(zeros)
            v_parts.append(zeros)
    merged = GaussianSet.concatenate(parts)
    scene.set_gaussians(merged)
    adam.reset(GaussianSet.concatenate(m_parts).flat(), GaussianSet.concatenate(v_parts).flat())
    return np.flatnonzero(keep), grow


def render_picture(scene: GaussianScene, camera: Camera) -> np.ndarray:
    """A camera's colour over black, (H, W, 3) in [0, 1], as the held-out scores compare them."""
    return np.clip(scene.render(camera)[..., :3], 0.0, 1.0)


def score_views(scene: GaussianScene, views: ReferenceViews, indices: list[int]) -> dict[str, float]:
    """Mean PSNR and SSIM of the scene's pictures against the reference views ``indices``."""
    return views.score(lambda index: render_picture(scene, views.cameras[index]), indices)


def schedule_fraction(config: GaussianTrainConfig, step: int, seconds: float) -> float:
    """How far a run is through its schedule after ``step`` steps and ``seconds`` of training: the steps' fraction,
    or the time budget's where that is larger."""
    done = step / config.steps
    return max(done, seconds / config.seconds) if config.seconds else done


def budget_spent(config: GaussianTrainConfig, steps: int, seconds: float, longest_step: float) -> bool:
    """Whether a run ends after ``steps`` steps and ``seconds`` of training: its steps are taken, or its time budget
    has no room for another step as long as the longest so far, so that training stays within the budget."""
    return steps >= config.steps or (config.seconds is not None and seconds + longest_step > config.seconds)


def train_gaussians(gpu: GpuContext, prepared: PreparedStudy, views: ReferenceViews,
                    config: GaussianTrainConfig | None = None, progress: Progress | None = None,
                    should_stop: ShouldStop | None = None) -> tuple[GaussianScene, GaussianTrainLog]:
    """Fit Gaussians to the training views; ``should_stop`` is polled between steps (a cancel keeps the state
    reached, ``log.cancelled``)."""
    config = config or GaussianTrainConfig()
    report = progress or (lambda message, fraction: None)
    voxel, rng = voxel_mm(prepared), np.random.default_rng(config.seed + 1)
    cap = gaussian_cap(memory_budget(gpu), config)
    scene = scene_for_study(gpu, prepared, initial_gaussians(prepared, config, min(config.initial, cap)), config)
    adam = GaussianAdam(gpu, scene, config, voxel)
    sampler = PatchSampler(views.targets(), views.training, size=config.patch_size, seed=config.seed)
    step_on_device = GaussianStep(gpu, scene, views, config)
    joint = None
    if config.structure_weight > 0:
        joint = JointStructures.for_study(scene, prepared, config.structure_weight,
                                          StructureTrainConfig(points=config.structure_points, seed=config.seed))
    log = GaussianTrainLog(cap=cap)
    logged_at = 0
    start = time.perf_counter()
    longest = 0.0  # the longest step after the first, held-out scores left out

    def trained() -> float:  # seconds of training so far, the held-out scores left out
        return time.perf_counter() - start - log.eval_seconds

    for step in range(config.steps):
        if should_stop is not None and should_stop():
            log.cancelled = True
            break
        began = trained()
        rows = sampler.sample(config.patches)
        loss = step_on_device.loss_and_gradients(rows, sampler.reference_patches(rows))
        done = schedule_fraction(config, step, trained())
        schedule = 0.1 + 0.9 * (1.0 - done)
        if np.isfinite(loss):
            step_on_device.accumulate_statistics()  # densification follows the pictures' gradients
            if joint is not None:
                joint.step(schedule)
            adam.step(schedule)
        else:  # a step whose loss is not finite moves nothing
            scene.zero_gradients()
        log.losses.append((step, loss))
        if step == 0:  # the time budget starts once the first step has compiled the step's kernels
            log.first_step_seconds = trained()
            start += log.first_step_seconds
        after = schedule_fraction(config, step + 1, trained())
        last = budget_spent(config, step + 1, trained(), longest)
        if config.densify_every and (step + 1) % config.densify_every == 0 and not last:
            gradient_sum, seen = step_on_device.statistics()
            kept, grown = adapt(scene, adam, gradient_sum, seen, config, voxel, cap, rng,
                                densify=done < config.densify_until)
            if joint is not None:
                joint.follow(kept, grown)
            step_on_device.reset_statistics()
            log.counts.append((step + 1, scene.count))
        else:
            scene.build_grid()
        if joint is not None and (last or (config.eval_every and (step + 1) % config.eval_every == 0)):
            log.structure_losses.append((step, joint.take_loss() / max(step + 1 - logged_at, 1)))
            logged_at = step + 1
        if config.eval_every and ((step + 1) % config.eval_every == 0 or last) and views.held_out:
            scored = time.perf_counter()
            score = score_views(scene, views, views.held_out)["heldout_psnr"]
            log.eval_seconds += time.perf_counter() - scored
            log.scores.append((step + 1, score))
            report(f"Gaussians: step {step + 1}, loss {loss:.4f}, {scene.count:,} Gaussians, "
                   f"held-out PSNR {score:.2f} dB", min(after, 1.0))
        log.steps = step + 1
        if step > 0:
            longest = max(longest, trained() - began)
        if last:
            break
    log.seconds = trained()
    if joint is not None:
        log.structures = joint.state()[0]
    return scene, log
