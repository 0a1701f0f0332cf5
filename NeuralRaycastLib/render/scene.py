"""What the differentiable renderer asks of a scene (the neural field, or analytic spheres in the tests), and
the work lists its passes run over: launches cover whole waves of threads, each thread taking list entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class TrainableScene(Protocol):
    """What the renderer needs from a scene: its structure count and its sample kernels (the generic ones
    of shaders/diff_scene.slang instantiated for the scene), each launched over whole waves of a work list
    (``distances``: the sampled slots, ``surface``: the shaded segments, over the launch given, whose threads
    take entries i, i + launched, ... (SampleBuffers.launched, :func:`list_launch`); ``backward``: one thread
    per entry of the lists of :class:`WorkLists`). A scene
    whose appearance can train alone also has ``backward_appearance(lists, buffers, timings)``. The
    backward passes' ``timings``, where given: each pass's seconds added there (see :class:`PassClock`)."""

    structures: int

    def distances(self, grid: Any, buffers: dict) -> None: ...

    def surface(self, grid: Any, buffers: dict) -> None: ...

    def backward(self, lists: WorkLists, buffers: dict, timings: dict[str, float] | None = None) -> None: ...


WAVE = 32  # launches over a work list cover whole waves of this many threads


@dataclass(frozen=True)
class WorkLists:
    """Entries in a batch's work lists: shaded segments, the samples at the ends of composited ones, and
    every placed sample."""

    shaded: int
    touched: int
    sampled: int = 0

    @staticmethod
    def launch(entries: int) -> Any:
        """A 1-D launch over ``entries`` list entries, rounded up to whole waves."""
        import slangpy as spy

        return spy.grid((-(-entries // WAVE) * WAVE,))


def list_launch(buffers: dict, threads: int) -> Any:
    """A forward pass's launch over a work list: ``threads`` threads (whole waves, at least one), which take
    entries i, i + launched, ... of the list (``buffers["launched"]``, shaders/sample_buffers.slang), so it
    covers the list whatever its length: the list's own length (no thread idles), or a number fixed before the
    list is counted (the host need not wait for the count)."""
    launched = -(-max(threads, 1) // WAVE) * WAVE
    buffers["launched"] = launched
    return WorkLists.launch(launched)
