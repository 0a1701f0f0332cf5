"""A batch of rays on the device, as shaders/sample_buffers.slang lays it out: per sample its distances, per
shaded segment its surface values, the work lists, and the gradients a backward pass asks for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..gpu.device import GpuContext, device_memory
from .scene import WorkLists

OUTPUTS = 8  # shaders/composite.slang: r, g, b, a, normal xyz, depth (sums)


KEPT_FLOATS = OUTPUTS + 2  # shaders/composite.slang: what the forward keeps per segment for the backward


SURFACE_VALUES_PER_STRUCTURE = 7  # shaders/sample_buffers.slang: normal xyz, albedo rgb, specular


#: Shaded segments per ray a batch makes room for at first (their surface values; more when needed).
SHADED_PER_RAY = 16


@dataclass(frozen=True)
class RayTiles:
    """A batch's rays as rows of pixels (a camera band, or patches stacked), which the listing kernels take
    in tiles of TILE pixels, one wave a tile (shaders/ray_tiles.slang)."""

    width: int
    rows: int

    TILE = (8, 4)  # shaders/ray_tiles.slang: TILE_WIDTH, TILE_HEIGHT

    def launch(self) -> Any:
        """One thread per pixel of every tile covering the rows (those past their ends have no ray)."""
        import slangpy as spy

        tile_width, tile_height = self.TILE
        tiles = -(-self.width // tile_width) * -(-self.rows // tile_height)
        return spy.grid((tiles * tile_width * tile_height,))

    def struct(self) -> dict:
        return {"width": self.width, "rows": self.rows}


class RayBatch:
    """Device buffers for up to ``capacity`` rays with ``max_samples`` samples each: per sample its distances,
    per shaded segment its surface values (room for more is made once a batch's lists are counted), and
    their gradients once a backward pass asks for them."""

    def __init__(self, gpu: GpuContext, capacity: int, max_samples: int, structures: int) -> None:
        import slangpy as spy

        device = gpu.device
        slots = capacity * max_samples
        self.device = device
        self.capacity, self.max_samples, self.structures = capacity, max_samples, structures
        self.rays = spy.Tensor.zeros(device, shape=(capacity * 6,), dtype="float")
        self.samples = spy.Tensor.zeros(device, shape=(slots * 2,), dtype="float")
        self.counts = spy.Tensor.zeros(device, shape=(capacity,), dtype="int")
        self.distances = spy.Tensor.zeros(device, shape=(slots * structures,), dtype="float")
        self.surface_entry = spy.Tensor.zeros(device, shape=(slots,), dtype="int")
        self.visibility = spy.Tensor.zeros(device, shape=(slots,), dtype="float")
        self.sums = spy.Tensor.zeros(device, shape=(capacity * OUTPUTS,), dtype="float")
        self.d_sums = spy.Tensor.zeros_like(self.sums)
        self.shaded_slots = spy.Tensor.zeros(device, shape=(slots,), dtype="int")
        self.touched_slots = spy.Tensor.zeros(device, shape=(slots,), dtype="int")
        self.sampled_slots = spy.Tensor.zeros(device, shape=(slots,), dtype="int")
        self.list_counts = spy.Tensor.zeros(device, shape=(3,), dtype="int")
        self.lists = WorkLists(0, 0, 0)
        self.surface_capacity = 0
        self.surface = self.surface_grads = self.distance_grads = self.kept = None
        self.kept_for_backward = False  # the last forward kept what the backward needs (and zeroed its gradients)
        self.struct = {
            "rays": self.rays.storage.device_address,
            "samples": self.samples.storage.device_address,
            "counts": self.counts.storage.device_address,
            "distances": self.distances.storage.device_address,
            "distanceGrads": 0,
            "surface": 0,
            "surfaceGrads": 0,
            "surfaceEntry": self.surface_entry.storage.device_address,
            "surfaceCapacity": 0,
            "visibility": self.visibility.storage.device_address,
            "shadows": 0,
            "maxSamples": max_samples,
            "rayCount": capacity,  # the stride from a ray's slot to its next: the rays of this pass (set_rays)
            "structures": structures,
            "shadedSlots": self.shaded_slots.storage.device_address,
            "touchedSlots": self.touched_slots.storage.device_address,
            "sampledSlots": self.sampled_slots.storage.device_address,
            "listCounts": self.list_counts.storage.device_address,
            "launched": 1 << 30,  # (set for each launch over a forward pass's list: list_launch)
            "kept": 0,
        }
        self.reserve_surfaces(capacity * SHADED_PER_RAY)

    def set_rays(self, rays: int) -> None:
        """Lay the slots out for ``rays`` rays (sample j of ray r in slot j · rays + r, shaders/sample_buffers.slang):
        the passes over these rays, and the gradient buffers sized for them, use exactly their slots."""
        self.struct["rayCount"] = rays

    def next_slots(self, slots: np.ndarray) -> np.ndarray:
        """The slots of the same rays' next samples."""
        return slots + self.struct["rayCount"]

    @staticmethod
    def bytes_per_ray(max_samples: int, structures: int) -> int:
        """Device memory a ray takes in a rendering batch (no gradients): per sample its t and link,
        distances, visibility, surface entry and three list entries; its first shaded segments' values."""
        return 4 * (max_samples * (7 + structures) + SHADED_PER_RAY * SURFACE_VALUES_PER_STRUCTURE * structures)

    @staticmethod
    def training_bytes_per_ray(max_samples: int, structures: int) -> int:
        """Device memory a ray takes in a training batch: :meth:`bytes_per_ray` with the gradient buffers a
        backward pass adds (per sample the distances' gradients and what compositing keeps; the surface
        values' gradients)."""
        per_sample = max_samples * (structures + KEPT_FLOATS)
        gradients = per_sample + SHADED_PER_RAY * SURFACE_VALUES_PER_STRUCTURE * structures
        return RayBatch.bytes_per_ray(max_samples, structures) + 4 * gradients

    @property
    def surface_width(self) -> int:
        return SURFACE_VALUES_PER_STRUCTURE * self.structures

    def reserve_surfaces(self, entries: int) -> None:
        """Room for the surface values (and their gradients, once kept) of ``entries`` shaded segments.
        The values are stored value by value (shaders/sample_buffers.slang): see :meth:`surface_values`."""
        import slangpy as spy

        if entries <= self.surface_capacity:
            return
        capacity = max(entries, self.surface_capacity + self.surface_capacity // 4)
        shape = (capacity * self.surface_width,)
        with device_memory(f"the surface values of {capacity:,} shaded segments"):
            self.surface = spy.Tensor.zeros(self.device, shape=shape, dtype="float")
            self.struct["surface"] = self.surface.storage.device_address
            if self.surface_grads is not None:
                self.surface_grads = spy.Tensor.zeros(self.device, shape=shape, dtype="float")
                self.struct["surfaceGrads"] = self.surface_grads.storage.device_address
        self.surface_capacity = self.struct["surfaceCapacity"] = capacity

    def surface_planes(self, tensor: Any) -> np.ndarray:
        """The surface values (or gradients) in ``tensor`` as one row per value, a column per shaded-list entry."""
        return np.asarray(tensor.to_numpy()).reshape(self.surface_width, -1)

    def surface_values(self, tensor: Any, entries: int) -> np.ndarray:
        """The first ``entries`` shaded segments' surface values (or gradients) in ``tensor``, a row each."""
        return self.surface_planes(tensor)[:, :entries].T

    def keep_gradients(self, rays: int) -> None:
        """Buffers for ∂L/∂(sample values) and for what the forward pass keeps for the backward, for the first
        ``rays`` rays: a rendering-only batch does without them, and a batch made for a rendered band (far more
        rays) holds them only for the rays trained on it."""
        import slangpy as spy

        slots = rays * self.max_samples
        if self.kept is None or self.kept.shape[0] < slots * KEPT_FLOATS:
            self.distance_grads = self.kept = None  # free the smaller ones first
            with device_memory(f"the gradient buffers of {rays:,} rays"):
                self.distance_grads = spy.Tensor.zeros(self.device, shape=(slots * self.structures,), dtype="float")
                self.kept = spy.Tensor.zeros(self.device, shape=(slots * KEPT_FLOATS,), dtype="float")
            self.struct["distanceGrads"] = self.distance_grads.storage.device_address
        if self.surface_grads is None:
            self.surface_grads = spy.Tensor.zeros_like(self.surface)
            self.struct["surfaceGrads"] = self.surface_grads.storage.device_address
