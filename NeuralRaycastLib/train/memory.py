"""A run sized to the GPU memory budget (gpu/memory_budget.py): the study's grid, the rays of a training step
and the points of an SDF-fit step, each cut down only where the budget's share for it cannot hold the preset's,
and always with a line that says so. Where not even the smallest step fits, :class:`GpuMemoryError` says what
to lower.

The bytes come from the buffers' own accounting (RayBatch, the image loss, the volumes' layout), not from
measurements, so they follow the code that allocates them.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..field.sdf_fit import WAVE
from ..gpu.device import GpuMemoryError
from ..gpu.memory_budget import LOWER, MemoryBudget, format_bytes
from ..render.image_loss import LOSS_BYTES_PER_PIXEL
from ..render.sample_buffers import RayBatch
from ..study.study import Study, downsample_factors

if TYPE_CHECKING:
    from ..field.field import FieldLayout
    from ..study.preprocess import PreparedStudy

#: Device memory a point of an SDF-fit step takes: the points are drawn on the device and never stored; only
#: each point's loss is written, when the loss is read (SdfFitter.loss).
SDF_POINT_BYTES = 4


def _padded(count: int) -> int:
    """Floats a voxel of ``count`` interleaved volumes takes (render/volume.py pads them to float4s)."""
    return -(-count // 4) * 4


def volume_bytes_per_voxel(structures: int, channels: int) -> int:
    """Device memory a voxel of the study takes while training: its boundary maps (the SDF fit's) and its
    channels with P(x) (the appearance network's inputs), each interleaved."""
    return 4 * (_padded(structures) + _padded(channels + 1))


def training_bytes_per_ray(max_samples: int, structures: int) -> int:
    """Device memory a ray of a training step takes: its sample buffers with their gradients and its pixel's
    share of the image loss."""
    return RayBatch.training_bytes_per_ray(max_samples, structures) + LOSS_BYTES_PER_PIXEL


def field_bytes(layout: FieldLayout) -> int:
    """The field on the device while it trains: its parameters, gradients and Adam's two moments."""
    return 4 * (3 * layout.count + layout.gradient_count)


def study_voxel_limit(study: Study, budget: MemoryBudget) -> int | None:
    """The longest axis (voxels) a study may keep so that its volumes fit the budget's share for them, or None
    where it fits as it is. Whole factors per axis, as :func:`~NeuralRaycastLib.study.study.downsample_study`
    takes them (near-cubic voxels: thin slices are not thinned further)."""
    per_voxel = volume_bytes_per_voxel(len(study.structures) + 1, len(study.channels))
    allowed = budget.share("volumes") // per_voxel
    if math.prod(study.shape) <= allowed:
        return None
    for limit in range(max(study.shape) - 1, 2, -1):  # the finest grid that fits
        factors = downsample_factors(study.shape, study.spacing, limit)
        shape = [n // f for n, f in zip(study.shape, factors, strict=True)]
        if math.prod(shape) <= allowed:
            # said as the longest axis it leaves, where that limit gives the same grid
            return max(shape) if downsample_factors(study.shape, study.spacing, max(shape)) == factors else limit
    return 2


def settings_within_budget(study: Study, settings: Any, budget: MemoryBudget) -> tuple[Any, str | None]:
    """The settings with a voxel limit that fits the study's volumes into the budget (kept where the user's or
    the preset's is already at least as strict), and the line saying so (None: nothing changed)."""
    limit = study_voxel_limit(study, budget)
    if limit is None or (settings.max_voxels is not None and settings.max_voxels <= limit):
        return settings, None
    per_voxel = volume_bytes_per_voxel(len(study.structures) + 1, len(study.channels))
    needed = math.prod(study.shape) * per_voxel
    note = (f"the study's {'×'.join(map(str, study.shape))} voxels take {format_bytes(needed)} on the GPU, more "
            f"than {budget.describe()} leaves for them ({format_bytes(budget.share('volumes'))}): trained at most "
            f"{limit} voxels a side (--max-voxels {limit})")
    return replace(settings, max_voxels=limit), note


def check_run_fits(budget: MemoryBudget, layout: FieldLayout, prepared: PreparedStudy, config: Any) -> None:
    """Refuse, before any work on the device, a run that even one training patch would take past the budget:
    GpuMemoryError, one line naming the sizes and what to lower."""
    structures = len(prepared.structures)
    volumes = int(np.prod(prepared.study.shape)) * volume_bytes_per_voxel(structures, len(prepared.channel_names))
    resident = field_bytes(layout) + volumes
    patch = config.patch_size**2 * training_bytes_per_ray(config.max_samples, structures)
    if resident + patch > budget.work_bytes or patch > budget.share("training"):
        raise GpuMemoryError(f"{budget.describe()} cannot hold this run: the field and the study's volumes take "
                             f"{format_bytes(resident)} and one training patch {format_bytes(patch)}; {LOWER}")


def schedule_within_budget(config: Any, budget: MemoryBudget,
                           structures: int) -> tuple[Any, str | None]:
    """The schedule with as many patches a step, and SDF points a step, as the budget's share for training holds
    (at most the schedule's), and the line saying what was cut (None: nothing)."""
    share = budget.share("training")
    patch = config.patch_size**2 * training_bytes_per_ray(config.max_samples, structures)
    patches = max(1, min(config.patches, share // patch))
    points = max(WAVE, share // SDF_POINT_BYTES // WAVE * WAVE)
    sized = replace(config, patches=patches, sdf_batch=min(config.sdf_batch, points),
                    geometry=replace(config.geometry, batch=min(config.geometry.batch, points)))
    cut = []
    if sized.patches < config.patches:
        cut.append(f"{sized.patches} of the preset's {config.patches} patches a step "
                   f"({sized.patches * config.patch_size**2:,} rays)")
    if sized.geometry.batch < config.geometry.batch or sized.sdf_batch < config.sdf_batch:
        cut.append(f"{sized.geometry.batch:,} SDF points a step (the preset's {config.geometry.batch:,})")
    if not cut:
        return config, None
    return sized, f"{budget.describe()} holds {' and '.join(cut)}: training takes smaller steps"
