"""A run's field, made once its study's boundary maps are done, or (``NEURALRAYCAST_FIELD_BESIDE_MAPS=1``) while
they are still being computed.

The field is sized by the study's box, which the brain mask gives long before the maps are done
(``prepare``'s ``with_outline``), not by the maps themselves; the kernels the run loads next (the SDF fit's, the
renderer's, the pretrained appearance's) need nothing of the study but its counts. So the run's memory check
(train/memory.py), its field and those kernels' modules can be made on a thread of their own beside the maps (a
phase beside "boundary maps": train/phases.py), the SDF fit's calls set up there too, its kernels built but not
launched (field/sdf_fit.py's set_up_fit_calls: slangpy sets up a function's call on its first call, which would
otherwise hold up the fit's first step); the field is left as it was. What the run still waits for once the maps are
done is a phase of its own, "field". Before the field, that thread gives the boundary maps' device kernels
(study/device_distance.py) their first calls, where the maps take their transforms on the device (``prepare``'s
``before_maps``: only where the maps are computed, once the study's size is checked), a phase beside the maps of its
own.

That is not the default: slangpy's native calls keep the interpreter lock for their whole length and its call
set-up is Python, so the work beside the maps holds up the maps' own Python (their longest way, the brain's mask and
signed distance, is Python and numpy between such stretches) about as long as it saves the run later, on a GPU host
of 16 cores as on two (BENCHMARKS.md, "The field beside the boundary maps, and the interpreter lock"). By default the
field is made on the run's thread once the maps are done, and the maps' kernels take their first calls in the maps.

Beside the maps, the thread holds the device's lock (``GpuContext.lock``) for each of its calls on the device, as the
maps' transforms do for theirs. Where the device takes no calls from that thread (a CUDA context that cannot be made
current there), or the preparation gave no outline, the field is made on the run's thread once the maps are done.
The field is the one the prepared study's layout asks for: one made ahead for another layout is made again, so
what the run trains never depends on what was made ahead.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..field.field import FieldLayout, NeuralField
from ..field.sdf_fit import set_up_fit_calls
from ..gpu.device import GpuContext, device_memory
from ..study.device_distance import maps_device
from .memory import check_run_fits
from .phases import PhaseClock
from .presets import RunSettings

if TYPE_CHECKING:
    from ..appearance.latent_scene import PretrainedAppearance
    from ..gpu.memory_budget import MemoryBudget
    from ..study.preprocess import StudyOutline

#: The phase of the field made beside the maps, and the run's own phase that takes what is left of it.
BESIDE_PHASE, FIELD_PHASE = "field and kernels", "field"
#: The phase of the maps' kernels' first calls, beside the maps.
MAPS_KERNELS_PHASE = "maps kernels"
#: The run's phase the field is made beside.
MAPS_PHASE = "boundary maps"
#: 1: the field (and the maps' kernels' first calls) beside the maps; anything else, or unset: once the maps are done.
BESIDE_MAPS_VARIABLE = "NEURALRAYCAST_FIELD_BESIDE_MAPS"
#: The modules of the differentiable renderer, which every run makes once its field is fitted (render/neural_render.py's
#: DiffRenderer loads them, for the field's structures, as it is made).
RENDERER_MODULES = ("ray_samples", "composite", "segment_lists")


class FieldAhead:
    """The run's field, made from the study's outline on a thread of its own (:meth:`start`), or on the run's
    thread where that could not be (:meth:`field`)."""

    def __init__(self, gpu: GpuContext, settings: RunSettings, budget: MemoryBudget, schedule: Any,
                 clock: PhaseClock, appearance: PretrainedAppearance | None = None) -> None:
        self.gpu, self.settings, self.budget, self.schedule = gpu, settings, budget, schedule
        self.clock, self.appearance = clock, appearance
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="field-ahead")
        self._made: Future | None = None
        self._maps_kernels_set_up: Future | None = None
        self._beside_maps = os.environ.get(BESIDE_MAPS_VARIABLE, "").strip() == "1"

    def set_up_maps_kernels(self) -> None:
        """Give the boundary maps' device kernels their first calls on the thread (it returns at once), where the
        maps take their transforms on the device (``prepare``'s ``before_maps``: the study's size is checked)."""
        if self._beside_maps and maps_device(self.gpu) is not None:
            self._maps_kernels_set_up = self._pool.submit(self._maps_kernels)

    def start(self, outline: StudyOutline) -> None:
        """Make the field for ``outline`` on the thread (``prepare``'s ``with_outline``: it returns at once)."""
        if self._made is None and self._beside_maps:
            self._made = self._pool.submit(self._beside, outline)

    def field(self, prepared) -> NeuralField:
        """The field of the prepared study: the one made beside its maps (waited for; its error raised here), or
        made now."""
        if self._maps_kernels_set_up is not None:
            self._maps_kernels_set_up.result()  # an error of its own (not the device's refusal) raised here
        made = self._made.result() if self._made is not None else None
        if made is None or made.layout != self.settings.field_layout(self.gpu, prepared):
            made = self._make(prepared)
        return made

    def close(self) -> None:
        """Wait for the thread: a run that stops leaves nothing of its own working on the device."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _maps_kernels(self) -> None:
        """train/warmup.py's tiny transform and mesh distances, calls as the maps make them. A device that refuses
        them is left to the maps, which take the processor's transforms then and say why."""
        from .warmup import warm_up_maps

        with self.clock.phase(MAPS_KERNELS_PHASE, beside=MAPS_PHASE):
            if self.gpu.use_on_this_thread():
                with contextlib.suppress(RuntimeError):
                    warm_up_maps(self.gpu)

    def _beside(self, outline: StudyOutline) -> NeuralField | None:
        """The field and the kernels the run loads next, made beside the maps (the device's lock taken for each
        step, so the maps' transforms wait for one at most)."""
        with self.clock.phase(BESIDE_PHASE, beside=MAPS_PHASE):
            if not self.gpu.use_on_this_thread():
                return None
            layout = self._checked_layout(outline)
            parameters = layout.initial_parameters(self.settings.seed)  # the host's part: the maps' calls go on
            with self.gpu.lock, device_memory(self._what):
                field = NeuralField(self.gpu, layout, parameters)
            with self.gpu.lock:  # the fit's first step then sets up no call (the field is as it was)
                set_up_fit_calls(self.gpu, field, self.schedule.geometry, outline)
            with self.gpu.lock:
                for name in RENDERER_MODULES:
                    self.gpu.load_module(name, field.structures)
            if self.appearance is not None:
                with self.gpu.lock:
                    self.appearance.load_kernels(self.gpu, field)
            return field

    def _make(self, outline: StudyOutline) -> NeuralField:
        """The run's memory check, then its field."""
        layout = self._checked_layout(outline)
        with device_memory(self._what):
            return NeuralField(self.gpu, layout, seed=self.settings.seed)

    def _checked_layout(self, outline: StudyOutline) -> FieldLayout:
        """The field's layout, the run refused (GpuMemoryError) before its own work on the device where the budget
        cannot hold it."""
        layout = self.settings.field_layout(self.gpu, outline)
        check_run_fits(self.budget, layout, outline, self.schedule)
        return layout

    @property
    def _what(self) -> str:
        """What a buffer the device refuses was for (a GpuMemoryError's words)."""
        return f"this run ({self.budget.describe()})"
