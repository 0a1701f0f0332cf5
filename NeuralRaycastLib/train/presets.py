"""Training presets and the settings of one run.

One table (:data:`PRESETS`) says what each preset trains on (reference views, their size, how far the study
is downsampled) and how long (the stages' schedule); the command line's help, its messages, the demo's report
and the Slicer module's choices are all read from it. :class:`RunSettings` is a preset with the user's
overrides, the one description of a run that every path (command line, demo, Slicer, warm-up workers) hands
to :func:`~NeuralRaycastLib.train.run.train_study`.

This module imports nothing heavy, so the Slicer module can read the preset names before its dependencies
are installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..study.drawn_labels import MIN_PIECE_ML, check_min_piece_ml

if TYPE_CHECKING:
    from ..field.field import FieldLayout
    from ..gpu.device import GpuContext
    from ..study.preprocess import PreparedStudy
    from .trainer import TrainConfig

#: The preset chosen by the device: ``quick`` on a software device (no GPU), ``standard`` on a GPU.
AUTO = "auto"


@dataclass(frozen=True)
class Preset:
    name: str
    purpose: str  # who it is for, in a few words
    views: int  # reference views rendered to train on (every held_out_every-th held out)
    size: int  # pixels of those square views
    max_voxels: int | None  # the study is downsampled so that no axis is longer (None: as it is)
    fit: dict[str, Any] = field(default_factory=dict)  # stage 1: FitConfig fields
    stages: dict[str, Any] = field(default_factory=dict)  # stages 2 and 3: TrainConfig fields
    # Stage 1 where it is the whole fit (``fit --appearance pretrained``): FitConfig fields over ``fit``'s, the
    # warm-up scaled with the steps. Fewer steps, where the geometry is as good by the held-out picture and the Dice
    # (docs/pretrained-appearance.md): on a CPU a fit costs its points, so half the steps; on a GPU a step's fixed
    # cost outweighs its points, so a third of the steps at four times the points.
    pretrained_fit: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for help texts and messages, e.g. ``quick (a CPU: study at most 96 voxels a side, 16
        views of 128²)``."""
        study = f"study at most {self.max_voxels} voxels a side" if self.max_voxels else "study at full resolution"
        return f"{self.name} ({self.purpose}: {study}, {self.views} views of {self.size}²)"

    def schedule(self, seed: int = 0, pretrained: bool = False) -> TrainConfig:
        """The stages' training schedule (step counts, batch sizes, learning rates, render settings);
        ``pretrained``: stage 1 as :attr:`pretrained_fit` sets it for a pretrained appearance."""
        from ..field.sdf_fit import FitConfig
        from .trainer import TrainConfig

        fit = {**self.fit, **self.pretrained_fit} if pretrained else self.fit
        return TrainConfig(FitConfig(seed=seed, **fit), seed=seed, **self.stages)


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        # Small batches for a CPU device. Coarser occupancy cells (2 mm) than a GPU's place fewer samples and
        # give a better held-out picture in the same time; its pictures keep them, since a finer grid is slow
        # to make on a CPU. Shading down to 3e-3 while training trades nothing measurable for more
        # rays per second (BENCHMARKS.md).
        Preset("quick", "a CPU", views=16, size=128, max_voxels=96,
               fit=dict(steps=300, batch=1 << 13),
               stages=dict(appearance_steps=120, joint_steps=60, patches=4, max_samples=192, sdf_batch=1 << 12,
                           eval_every=60, occupancy_cell_mm=2.0, shade_weight=3e-3, render_cell_mm=2.0),
               pretrained_fit=dict(steps=150, warmup_steps=25)),
        # Sized to train a full-resolution study in seconds on one GPU: large batches (128 patches, 32,768 rays
        # a step) for few steps. Its pictures shade down to 4e-3, the largest weight that keeps its views within
        # 63 dB of exact shading (BENCHMARKS.md).
        Preset("standard", "a GPU", views=24, size=512, max_voxels=None,
               fit=dict(steps=600, batch=1 << 16),
               stages=dict(appearance_steps=150, joint_steps=75, patches=128, eval_every=25, rate_table=1e-3,
                           rate_geometry=5e-4, rate_appearance=2e-3, shade_weight=3e-3, render_shade_weight=4e-3),
               pretrained_fit=dict(steps=200, batch=1 << 18, warmup_steps=17)),
        Preset("high", "a GPU, longer", views=24, size=512, max_voxels=None,
               fit=dict(steps=4000, batch=1 << 18),
               stages=dict(appearance_steps=600, joint_steps=5000, patches=64)),
    )
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset '{name}' (choose from {', '.join(PRESETS)})")
    return PRESETS[name]


def default_preset(software: bool) -> str:
    """The preset :data:`AUTO` stands for on a device: ``quick`` on a software device, else ``standard``."""
    return "quick" if software else "standard"


def training_schedule(name: str, seed: int = 0, pretrained: bool = False) -> TrainConfig:
    """The named preset's training schedule (see :meth:`Preset.schedule`)."""
    return get_preset(name).schedule(seed, pretrained)


def presets_help() -> str:
    """The presets, one clause each, for command-line help."""
    return f"{AUTO} (default: quick without a GPU, standard with one); " + "; ".join(
        p.describe() for p in PRESETS.values())


@dataclass(frozen=True)
class RunSettings:
    """What one run trains: a preset with the user's overrides. Saved in the run folder's ``run.json``."""

    preset: str
    seed: int = 0
    views: int = 24
    size: int = 512  # pixels, square views
    held_out_every: int = 8
    max_voxels: int | None = None  # downsample the study so no axis is longer
    iterations: int | None = None  # steps of all stages together, split as the preset splits them
    shadows: bool = False  # key-light shadows in the references; the field is shaded through its own meshes
    # The voxel size (mm) the field's finest cells follow instead of the study's: a warm-up's downsampled
    # stand-in is given its study's, so that it compiles the study's kernels (warmup.py).
    field_voxel_mm: float | None = None
    min_piece_ml: float = MIN_PIECE_ML  # label pieces (and holes) smaller than this are left out (listed)
    keep_small_pieces: bool = False  # keep them as surfaces of their own instead

    @classmethod
    def for_device(cls, gpu: GpuContext, name: str | None = None, **overrides: Any) -> RunSettings:
        """The preset's settings (``None`` or :data:`AUTO`: the device's default, :func:`default_preset`) with
        ``overrides``; an override of None or 0 keeps the preset's value."""
        if name in (None, "", AUTO):
            name = default_preset(gpu.report.software)
        preset = get_preset(name)
        chosen = {key: value for key, value in overrides.items() if value is not None and value != 0}
        return replace(cls(preset.name, views=preset.views, size=preset.size, max_voxels=preset.max_voxels), **chosen)

    def check(self, training: bool = True) -> RunSettings:
        """Refuse settings no run can train with (ValueError naming the value and its limits), before any work:
        they come from a command line, the Slicer module's fields or a run folder's ``run.json``. ``training``:
        also that the views leave one held out and one to train on (a run trained before that was checked is
        still read, rendered and meshed; its evaluation says what is missing)."""
        get_preset(self.preset)
        check_run_values(seed=self.seed, views=self.views if training else None, held_out_every=self.held_out_every,
                         iterations=self.iterations)
        if not (_is_int(self.views) and self.views >= 1):
            raise ValueError(f"views must be a whole number of at least 1 (got {self.views!r})")
        for name in ("size", "max_voxels"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"{name} must be a whole number (got {value!r})")
        for name in ("shadows", "keep_small_pieces"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false (got {getattr(self, name)!r})")
        check_min_piece_ml(self.min_piece_ml)
        if self.field_voxel_mm is not None and not (isinstance(self.field_voxel_mm, (int, float))
                                                    and self.field_voxel_mm > 0):
            raise ValueError(f"field_voxel_mm must be a positive number of millimetres (got {self.field_voxel_mm!r})")
        return self

    def schedule(self, config: TrainConfig | None = None, pretrained: bool = False) -> TrainConfig:
        """The stages' schedule: the preset's, scaled to ``iterations`` where given, or ``config`` (which then
        replaces it whole); with this run's shadows either way. ``pretrained`` (a pretrained appearance): the
        geometry alone, no rendering stage, stage 1 as the preset's ``pretrained_fit`` sets it unless
        ``iterations`` or ``config`` say otherwise."""
        if config is None:
            config = training_schedule(self.preset, self.seed, pretrained=pretrained and not self.iterations)
            if self.iterations:
                config = config.with_total_steps(self.iterations)
        if pretrained:
            config = replace(config, appearance_steps=0, joint_steps=0)
        return replace(config, shadows=self.shadows)

    def field_layout(self, gpu: GpuContext, prepared: PreparedStudy) -> FieldLayout:
        """The field's layout for this run on ``prepared``: sized for its finest voxel (or
        ``field_voxel_mm``), smaller on a software device. Training, its warm-up and their kernels' key all
        take it from here, so they agree."""
        from ..field.field import FieldLayout

        return FieldLayout.for_study(prepared, small=gpu.report.software, voxel_mm=self.field_voxel_mm)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_run_values(*, seed: Any = 0, views: Any = None, held_out_every: Any = 8, iterations: Any = None) -> None:
    """Refuse a run's numbers out of their limits (ValueError naming the value and its limits): a seed of at
    least 0, at least one iteration, and views split so that at least one is held out and one trains.
    ``None`` is a value not given (the preset's)."""
    for name, value in (("seed", seed), ("views", views), ("held-out-every", held_out_every),
                        ("iterations", iterations)):
        if value is not None and not _is_int(value):
            raise ValueError(f"{name} must be a whole number (got {value!r})")
    if seed is not None and seed < 0:
        raise ValueError(f"seed must be at least 0 (got {seed})")
    if iterations is not None and iterations < 1:
        raise ValueError(f"iterations must be at least 1 (got {iterations}); leave it out for the preset's")
    from ..render.camera import check_view_split

    check_view_split(views, 8 if held_out_every is None else held_out_every)
