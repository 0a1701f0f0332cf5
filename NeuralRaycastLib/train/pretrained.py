"""The pretrained appearance's part of a fit (``fit --appearance pretrained``): the fitted field's latent grid
from the pretrained encoder, its optional fine-tune, and the renderer of the finished run. Used by
:func:`~NeuralRaycastLib.train.run.train_study` and by the warm-up's *pretrained* part alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..appearance.latent import LatentAppearance
    from ..appearance.latent_scene import PretrainedAppearance
    from ..field.field import NeuralField
    from ..gpu.device import GpuContext
    from ..progress import Progress
    from .phases import PhaseClock
    from .trainer import Trainer


def pretrained_appearance(gpu: GpuContext, prepared, field: NeuralField, appearance: PretrainedAppearance,
                          trainer: Trainer, clock: PhaseClock, progress: Progress | None, tuning: bool = True,
                          finished: Callable[[LatentAppearance], None] | None = None):
    """The fitted field's latent appearance (the encoder over the study, then, where ``tuning``, the optional
    fine-tune of the grid and the decoder) and its renderer, set up as a finished field's pictures are.
    ``finished`` is called with the latent appearance once it is final, before the renderer is set up (the run
    reads its model back there and writes it while the device works on: its own phase, "model read back")."""
    from ..appearance.latent_scene import fine_tune, latent_renderer

    with clock.phase("latent bricks"):  # where the field's surfaces are: the bricks the grid stores
        bricks = appearance.latent_bricks(prepared, field)
    with clock.phase("encode"):
        latent = appearance.encode_bricks(gpu, prepared, bricks, getattr(trainer.made_renderer, "scene", None))
        gpu.device.wait()
    if tuning and appearance.fine_tunes:
        with clock.phase("fine-tune"):
            losses = fine_tune(trainer, latent, appearance.fine_tune_steps, progress, appearance.fine_tune_seconds)
            gpu.device.wait()
        trainer.log.rows.append({"step": trainer.config.geometry.steps + len(losses), "stage": 2,
                                 "loss": losses[-1] if losses else float("nan"), "fine_tune_steps": len(losses)})
    if finished is not None:
        with clock.phase("model read back"):
            finished(latent)
    with clock.phase("picture settings"):
        c = trainer.config
        renderer = latent_renderer(gpu, prepared, field, latent, c.max_samples, c.render_cell_mm,
                                   c.render_shade_weight)
        gpu.device.wait()
    return latent, renderer
