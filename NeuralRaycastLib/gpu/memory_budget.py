"""The GPU memory a process may use: one budget, read by everything that sizes work on the device.

The budget is resolved once per device, in this order:

1. an explicit value: ``--gpu-memory 6G`` on the command line, the Slicer module's setting;
2. the ``NEURALRAYCAST_GPU_MEMORY`` environment variable;
3. the device: on CUDA the memory free when the device opened, less a safety margin
   (:data:`SAFETY_MARGIN`: the larger of 512 MiB and a twentieth of the GPU's memory), which other
   programs, the driver and the kernels' own memory need;
4. where the device cannot say (Vulkan, Metal): :data:`UNKNOWN_GPU_BYTES`, 8 GiB, the common size of the
   cards 3D Slicer runs on, or on a software device (lavapipe, whose memory is the computer's)
   :data:`SOFTWARE_BYTES`, 4 GiB. An allocation the device still refuses is retried smaller.

Amounts are written as a number with an optional unit: ``K``, ``M``, ``G``, ``T``, with or without ``i``
and ``B`` (``6G``, ``6GiB``, ``6GB``, ``6000M``, ``1.5G``); every unit is binary (``G`` is 2^30 bytes), as
GPU tools report memory; a bare number is bytes. ``auto`` (or nothing) is the device's.

The work is split by shares of the budget (:data:`SHARES`): a rendered view's band of rays, a training
step's rays, the study's volumes on the device, and the rest (the field and its optimiser, frames, copies).
This module imports nothing of the project, so the device, the renderer and the Slicer module can all read it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

GPU_MEMORY_ENV = "NEURALRAYCAST_GPU_MEMORY"

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
#: What a CUDA device keeps free beyond the budget: at least this, or this fraction of the GPU's memory.
SAFETY_MARGIN = (512 * MIB, 1 / 20)
UNKNOWN_GPU_BYTES = 8 * GIB
SOFTWARE_BYTES = 4 * GIB
#: What a CUDA process holds on the GPU before any work, once its device is open: the CUDA context and slangpy's
#: own heaps (measured with ``bench --suite workstation``: BENCHMARKS.md). A budget given by the user is the
#: process's whole footprint, so this part of it (at most half) is set aside before the work is sized.
CUDA_PROCESS_BYTES = 768 * MIB
#: The smallest budget accepted: less cannot hold a device's first kernels, let alone a field.
MIN_BYTES = 1 * MIB

#: Fractions of the budget each kind of work sizes itself to. They add to less than one: the field, its
#: optimiser state, a frame's sums and G-buffer and host copies take the rest.
SHARES = {"band": 0.25, "training": 0.4, "volumes": 0.25}

#: What to lower when work does not fit the budget, as the command line names it.
LOWER = ("raise --gpu-memory (or $NEURALRAYCAST_GPU_MEMORY) if the GPU has more free, or use a smaller preset "
         "(--preset quick), smaller views (--size) or a coarser study (--max-voxels)")

_UNITS = {"": 1, "k": KIB, "m": MIB, "g": GIB, "t": 1 << 40}
_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])i?)?b?\s*$", re.IGNORECASE)
_EXAMPLE = "write it as 6G, 6GiB or 6000M"


@dataclass(frozen=True)
class MemoryBudget:
    """``bytes`` of GPU memory the work may take, and where that figure came from (for messages)."""

    bytes: int
    source: str
    held: int = 0  # of ``bytes``, what the process holds before any work (CUDA_PROCESS_BYTES)

    @property
    def work_bytes(self) -> int:
        """The bytes the work itself may take."""
        return self.bytes - self.held

    def share(self, kind: str) -> int:
        """The bytes the work of ``kind`` (a key of :data:`SHARES`) sizes itself to."""
        return int(self.work_bytes * SHARES[kind])

    def describe(self) -> str:
        """E.g. ``a GPU memory budget of 4.0 GiB (--gpu-memory)``."""
        return f"a GPU memory budget of {format_bytes(self.bytes)} ({self.source})"


def format_bytes(count: int) -> str:
    """Bytes for people: ``512 MiB``, ``4.0 GiB``."""
    if count >= GIB:
        return f"{count / GIB:.1f} GiB"
    if count >= MIB:
        return f"{count / MIB:.0f} MiB"
    return f"{count / KIB:.0f} KiB"


def parse_memory(text: str | int, what: str = "--gpu-memory") -> int | None:
    """Bytes written as ``text`` (see the module's docstring), or None for ``auto`` or nothing (the device's).
    ValueError, one line naming ``what`` and how to write it, for anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        written = str(text).strip()
        if written.lower() in ("", "auto"):
            return None
        match = _AMOUNT.match(written)
        if match is None:
            raise ValueError(f"{what}: '{written}' is not an amount of memory; {_EXAMPLE} (or auto)")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if value < MIN_BYTES:
        raise ValueError(f"{what}: {text} is less than the smallest budget, {format_bytes(MIN_BYTES)}; {_EXAMPLE}")
    return value


def device_budget(free: int | None, total: int | None, software: bool) -> MemoryBudget:
    """The budget the device gives: its free memory less :data:`SAFETY_MARGIN` where it can be read (``free``
    and ``total`` bytes), else the default for a device of unknown memory."""
    if free is not None and total is not None:
        least, fraction = SAFETY_MARGIN
        margin = max(least, int(total * fraction))
        return MemoryBudget(max(MIN_BYTES, free - margin), "the GPU's free memory")
    if software:
        return MemoryBudget(SOFTWARE_BYTES, "the default of a software device")
    return MemoryBudget(UNKNOWN_GPU_BYTES, "the default of a GPU whose free memory cannot be read")


def resolve_budget(explicit: str | int | None, free: int | None, total: int | None, software: bool,
                   option: str = "--gpu-memory", cuda: bool = False) -> MemoryBudget:
    """The budget: ``explicit`` (a value given as ``option``), else $NEURALRAYCAST_GPU_MEMORY, else the
    device's (:func:`device_budget`; measured with the process's own share already taken). A bad value raises
    ValueError naming where it was given. On ``cuda``, a given budget sets aside what the process holds before
    any work (:data:`CUDA_PROCESS_BYTES`, at most half of it)."""
    given = None
    if explicit is not None and (chosen := parse_memory(explicit, option)) is not None:
        given = MemoryBudget(chosen, option)
    elif (variable := os.environ.get(GPU_MEMORY_ENV)) is not None and (
            chosen := parse_memory(variable, f"${GPU_MEMORY_ENV}")) is not None:
        given = MemoryBudget(chosen, f"${GPU_MEMORY_ENV}")
    if given is None:
        return device_budget(free, total, software)
    return MemoryBudget(given.bytes, given.source, min(CUDA_PROCESS_BYTES, given.bytes // 2)) if cuda else given
