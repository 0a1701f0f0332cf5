"""GPU time per kernel, from timestamps the device writes around each launch (for the benchmark).

The passes' own clock (gpu.PassClock) waits for the device after each pass: simple, but every wait adds the
host's latency to the pass and leaves the device idle while the next pass is sent, so a short fit step
measures markedly longer that way. Here every slangpy call made inside the block is bracketed by two
timestamp writes, each submitted on its own, and nothing waits: where the host sends work faster than the
device runs it, each bracket holds its kernel alone. Where the device runs dry (short kernels, or a read in
between), a bracket also holds the time the host took to send the kernel, so the brackets are an upper bound
for short kernels.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..gpu.device import GpuContext

#: Timestamps of one block at most (two per launch).
MAX_STAMPS = 8192


@dataclass
class KernelTimes:
    """Milliseconds of device time per kernel name (summed over its launches) and the launches counted."""

    milliseconds: dict[str, float] = field(default_factory=dict)
    launches: dict[str, int] = field(default_factory=dict)
    span_ms: float = 0.0  # from the first launch's start to the last one's end

    @property
    def total_ms(self) -> float:
        return sum(self.milliseconds.values())

    def per(self, repeats: int) -> KernelTimes:
        """The same times divided by ``repeats`` (the block ran the same work that many times)."""
        return KernelTimes({name: ms / repeats for name, ms in self.milliseconds.items()},
                           {name: -(-count // repeats) for name, count in self.launches.items()},
                           self.span_ms / repeats)

    def summary(self) -> str:
        """``name ms (launches)``, the longest first."""
        ordered = sorted(self.milliseconds.items(), key=lambda item: -item[1])
        return "; ".join(f"{name} {ms:.2f} ms" + (f" ({self.launches[name]} launches)" if self.launches[name] > 1
                                                   else "") for name, ms in ordered)


@contextmanager
def kernel_clock(gpu: GpuContext) -> Iterator[KernelTimes]:
    """Times every slangpy call made inside the block on ``gpu``; the yielded KernelTimes is filled when the
    block ends (after waiting for the device). Devices without timestamp queries give empty times."""
    import slangpy as spy

    times = KernelTimes()
    device = gpu.device
    try:
        pool = device.create_query_pool(type=spy.QueryType.timestamp, count=MAX_STAMPS)
    except Exception:  # noqa: BLE001 - a device without timestamp queries: nothing to time with
        yield times
        return
    names: list[str] = []
    call = spy.Function.__call__

    def stamp(index: int) -> None:
        encoder = device.create_command_encoder()
        encoder.write_timestamp(pool, index)
        device.submit_command_buffer(encoder.finish())

    def timed_call(function, *args, **kwargs):
        first = 2 * len(names)
        if first + 2 > MAX_STAMPS:
            return call(function, *args, **kwargs)
        stamp(first)
        result = call(function, *args, **kwargs)
        stamp(first + 1)
        names.append(function.name)
        return result

    spy.Function.__call__ = timed_call
    try:
        yield times
    finally:
        spy.Function.__call__ = call
    device.wait()
    if not names:
        return
    stamps = pool.get_timestamp_results(0, 2 * len(names))  # seconds
    for i, name in enumerate(names):
        times.milliseconds[name] = times.milliseconds.get(name, 0.0) + (stamps[2 * i + 1] - stamps[2 * i]) * 1e3
        times.launches[name] = times.launches.get(name, 0) + 1
    times.span_ms = (stamps[-1] - stamps[0]) * 1e3
