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
    PIXELS = 32  # TILE_PIXELS

    def count(self) -> int:
        """Tiles covering the rows."""
        tile_width, tile_height = self.TILE
        return -(-self.width // tile_width) * -(-self.rows // tile_height)

    def launch(self) -> Any:
        """One thread per pixel of every tile covering the rows (those past their ends have no ray)."""
        import slangpy as spy

        return spy.grid((self.count() * self.PIXELS,))

    def struct(self) -> dict:
        return {"width": self.width, "rows": self.rows}


class RayBatch:
    """Device buffers for up to ``capacity`` rays: per ray its sums, per sample slot its distances and the work
    lists' entries, per shaded segment its surface values, and their gradients once a backward pass asks for
    them. The slots are laid out strided (room for ``max_samples`` of every ray: a training batch) or compact
    (the rows its tiles' rays need, counted on the device first: a rendered band; shaders/sample_buffers.slang);
    either way the slot buffers grow to what a pass needs (:meth:`reserve_slots`), as the surface values do
    once a batch's lists are counted."""

    #: Bytes per ray of a rendered band (:meth:`band_bytes`): its ray and count, and a tile's first slot (4 bytes
    #: for a tile's rays, rounded up); its sums go to the frame.
    RAY_BYTES = 4 * (6 + 1) + 1

    def __init__(self, gpu: GpuContext, capacity: int, max_samples: int, structures: int) -> None:
        import slangpy as spy

        device = gpu.device
        self.device = device
        self.capacity, self.max_samples, self.structures = capacity, max_samples, structures
        self.rays = spy.Tensor.zeros(device, shape=(capacity * 6,), dtype="float")
        self.counts = spy.Tensor.zeros(device, shape=(capacity,), dtype="int")
        self._sums: Any = None  # made where asked for (a rendered band's sums go to its frame's rows)
        self._d_sums: Any = None
        self.list_counts = spy.Tensor.zeros(device, shape=(4,), dtype="int")
        self.tile_slots = spy.Tensor.zeros(device, shape=(1,), dtype="int")  # (per tile: made for a compact pass)
        self.segment_bits = spy.Tensor.zeros(device, shape=(1,), dtype="uint")  # (per ray: made for a compact pass)
        self.lists = WorkLists(0, 0, 0)
        self.slot_capacity = self.touched_capacity = self.surface_words = 0
        self._slot_room: Any = None  # the per-slot arrays' one buffer (slot_arrays)
        self._gradient_room: Any = None  # the distances' gradients' and the backward's (keep_gradients)
        self.samples = self.distances = self.surface_entry = self.visibility = None
        self.shaded_slots = self.touched_slots = self.sampled_slots = self.chunk_rays = None
        self.surface = self.surface_grads = self.distance_grads = self.kept = None
        self.kept_for_backward = False  # the last forward kept what the backward needs (and zeroed its gradients)
        self.struct = {
            "rays": self.rays.storage.device_address,
            "counts": self.counts.storage.device_address,
            "distanceGrads": 0,
            "surface": 0,
            "surfaceGrads": 0,
            "surfaceCapacity": 0,
            "halfSurface": 0,
            "surfaceHalves": 0,
            "shadows": 0,
            "maxSamples": max_samples,
            "rayCount": capacity,
            "slotStride": capacity,
            "compactSlots": 0,
            "tileSlots": self.tile_slots.storage.device_address,
            "chunkRays": 0,
            "slotCapacity": 0,
            "rowWidth": 1,
            "structures": structures,
            "listCounts": self.list_counts.storage.device_address,
            "launched": 1 << 30,  # (set for each launch over a forward pass's list: list_launch)
            "kept": 0,
        }
        self.reserve_slots(RayTiles.PIXELS)  # every pointer valid from the start (a kernel over empty lists reads one)
        self.reserve_touched(RayTiles.PIXELS)
        self.reserve_surfaces(RayTiles.PIXELS)

    @property
    def sums(self) -> Any:
        """Each ray's sums (shaders/composite.slang's OUTPUTS), where the forward pass is given no other place."""
        if self._sums is None:
            self._sums = self._per_ray_outputs("sums")
        return self._sums

    @property
    def d_sums(self) -> Any:
        """∂L/∂sums of each ray, for the backward pass."""
        if self._d_sums is None:
            self._d_sums = self._per_ray_outputs("the sums' gradients")
        return self._d_sums

    def _per_ray_outputs(self, what: str) -> Any:
        import slangpy as spy

        with device_memory(f"{what} of {self.capacity:,} rays"):
            return spy.Tensor.zeros(self.device, shape=(self.capacity * OUTPUTS,), dtype="float")

    def set_rays(self, rays: int, tiles: RayTiles | None = None, segment_words: int = 0) -> None:
        """Lay the slots out for ``rays`` rays: strided (sample j of ray r in slot j · rays + r), or compact for
        rays in these ``tiles`` (each tile's rows of slots, reserved on the device: shaders/sample_buffers.slang),
        with ``segment_words`` words a ray for its occupied segments (ray_samples.slang's countSamples).
        The passes over these rays, and the gradient buffers sized for them, use exactly their slots."""

        self.struct["rayCount"] = rays
        if tiles is None:
            self.struct.update(slotStride=rays, compactSlots=0, rowWidth=1)
        else:
            self.reserve_tiles(rays, tiles, segment_words)
            self.struct.update(slotStride=RayTiles.PIXELS, compactSlots=1,
                               tileSlots=self.tile_slots.storage.device_address, rowWidth=tiles.width)
        self._point_at_surface()

    def reserve_tiles(self, rays: int, tiles: RayTiles, segment_words: int) -> None:
        """Room for a compact layout's tiles and ``segment_words`` words a ray of occupied segments, for ``rays``
        rays in these ``tiles`` (:meth:`set_rays`); never shrunk."""
        import slangpy as spy

        count = tiles.count()
        if self.tile_slots.shape[0] < count:
            self.tile_slots = None
            with device_memory(f"the tiles of {rays:,} rays"):
                self.tile_slots = spy.Tensor.zeros(self.device, shape=(count,), dtype="int")
        if self.segment_bits.shape[0] < rays * segment_words:
            self.segment_bits = None
            with device_memory(f"the occupied segments of {rays:,} rays"):
                self.segment_bits = spy.Tensor.zeros(self.device, shape=(rays * segment_words,), dtype="uint")

    @property
    def compact(self) -> bool:
        return self.struct["compactSlots"] != 0

    def ray_slots(self) -> np.ndarray:
        """(rays, max_samples) slot of every sample index of every ray of the last :meth:`set_rays` (in the
        compact layout, where a ray's tile has rows for it: -1 past them)."""
        rays, stride = self.struct["rayCount"], self.struct["slotStride"]
        if not self.compact:
            return np.arange(rays)[:, None] + stride * np.arange(self.max_samples)[None, :]
        width = self.struct["rowWidth"]
        ray = np.arange(rays)
        tile_width, tile_height = RayTiles.TILE
        tile = (ray // width // tile_height) * -(-width // tile_width) + ray % width // tile_width
        lane = (ray // width % tile_height) * tile_width + ray % width % tile_width
        counts = np.asarray(self.counts.to_numpy())[:rays]
        first = np.asarray(self.tile_slots.to_numpy())[tile] + lane
        tiles = RayTiles(width, -(-rays // width))
        rows = np.zeros(tiles.count(), np.int64)
        np.maximum.at(rows, tile, counts)
        j = np.arange(self.max_samples)[None, :]
        return np.where(j < rows[tile][:, None], first[:, None] + stride * j, -1)

    def next_slots(self, slots: np.ndarray) -> np.ndarray:
        """The slots of the same rays' next samples."""
        return slots + self.struct["slotStride"]

    @staticmethod
    def bytes_per_ray(max_samples: int, structures: int) -> int:
        """Device memory a ray takes in a strided rendering batch (no gradients): per sample its t and link,
        distances, visibility, surface entry and three list entries; its first shaded segments' values. What a
        rendered band is sized by until the samples its rays take were counted."""
        return 4 * (max_samples * (7 + structures) + SHADED_PER_RAY * SURFACE_VALUES_PER_STRUCTURE * structures)

    @staticmethod
    def slot_bytes(structures: int) -> int:
        """Device memory a compact slot takes (:data:`RAY_BYTES`): 4 bytes for each of t, link, the distances,
        the surface entry, the visibility, the shaded and sampled lists' entries, and a row's tile (rounded up)."""
        return 4 * (2 + structures + 4) + 1

    @staticmethod
    def shaded_bytes(structures: int) -> int:
        """Device memory a rendered band's shaded segment's surface values take (halves)."""
        return 2 * SURFACE_VALUES_PER_STRUCTURE * structures

    @staticmethod
    def band_bytes(rays: int, slots: int, shaded: int, structures: int, segment_words: int) -> int:
        """Device memory of a rendered band of ``rays`` rays in ``slots`` compact slots with room for ``shaded``
        shaded segments, and ``segment_words`` words a ray for its occupied segments."""
        return (rays * (RayBatch.RAY_BYTES + 4 * segment_words) + slots * RayBatch.slot_bytes(structures)
                + shaded * RayBatch.shaded_bytes(structures))

    @staticmethod
    def training_bytes_per_ray(max_samples: int, structures: int) -> int:
        """Device memory a ray takes in a training batch: :meth:`bytes_per_ray` with the gradient buffers a
        backward pass adds (per sample the distances' gradients and what compositing keeps; the surface
        values' gradients)."""
        per_sample = max_samples * (structures + KEPT_FLOATS)
        gradients = per_sample + SHADED_PER_RAY * SURFACE_VALUES_PER_STRUCTURE * structures
        return RayBatch.bytes_per_ray(max_samples, structures) + 4 * gradients

    def slot_arrays(self, capacity: int) -> list[tuple[str, int, str]]:
        """The arrays of a room of ``capacity`` slots, in the order they lie in it: name, entries and type. They
        share one buffer: the device's heap (slang-rhi's, on CUDA) gives each buffer over 64 MiB a page of its
        own, rounded up to 256 MiB, so separate buffers of a large band would each round up."""
        return [("samples", 2 * capacity, "float"), ("distances", self.structures * capacity, "float"),
                ("surface_entry", capacity, "int"), ("visibility", capacity, "float"),
                ("shaded_slots", capacity, "int"), ("sampled_slots", capacity, "int"),
                ("chunk_rays", capacity // RayTiles.PIXELS, "int")]

    def reserve_slots(self, slots: int, most: int | None = None) -> None:
        """Room for ``slots`` sample slots (the touched list's apart: :meth:`reserve_touched`): grown where
        smaller, by a quarter at least (but to no more than ``most`` slots, where given and more than ``slots``),
        and never shrunk (a batch keeps the room its largest pass took). The values in them are not kept: a
        forward pass writes every slot it reads."""

        if slots <= self.slot_capacity:
            return
        capacity = grown(slots, self.slot_capacity, most)
        capacity = -(-capacity // RayTiles.PIXELS) * RayTiles.PIXELS  # whole rows of a tile
        self._slot_room = None  # free the smaller room first
        for name, _length, _dtype in self.slot_arrays(0):
            setattr(self, name, None)
        self.slot_capacity = self.struct["slotCapacity"] = 0
        with device_memory(f"the samples of {capacity:,} slots"):
            self._slot_room = self._arrays_in_one_buffer(self.slot_arrays(capacity))
        self.slot_capacity = capacity
        self._point_at_room()

    def _arrays_in_one_buffer(self, arrays: list[tuple[str, int, str]]) -> Any:
        """One buffer holding ``arrays`` (name, entries, type: 4-byte words each), each a tensor viewing its own
        128-byte aligned range of it, set as this batch's attribute of that name; the buffer is returned."""
        import slangpy as spy

        room = spy.Tensor.zeros(self.device, shape=(sum(aligned_words(n) for _, n, _ in arrays),), dtype="int")
        types = {"float": self.rays.dtype, "int": self.counts.dtype}
        offset = 0
        for name, length, dtype in arrays:
            setattr(self, name, spy.Tensor(room.storage, types[dtype], (length,), (1,), offset))
            offset += aligned_words(length)
        return room

    def reserve_touched(self, slots: int) -> None:
        """Room in the touched list (a batch a backward pass follows) for ``slots`` entries."""
        import slangpy as spy

        if slots <= self.touched_capacity:
            return
        self.touched_slots = None
        with device_memory(f"the touched list of {slots:,} slots"):
            self.touched_slots = spy.Tensor.zeros(self.device, shape=(slots,), dtype="int")
        self.touched_capacity = slots
        self.struct["touchedSlots"] = self.touched_slots.storage.device_address

    @property
    def surface_width(self) -> int:
        return SURFACE_VALUES_PER_STRUCTURE * self.structures

    @property
    def half_surface(self) -> bool:
        """Whether the surface values are kept as halves: in a rendered band's (compact) layout, not in training's
        (shaders/sample_buffers.slang's halfSurface)."""
        return self.compact

    @property
    def surface_capacity(self) -> int:
        """Shaded segments the surface values' buffer (``surface_words`` 4-byte words) has room for in the
        current layout (twice as many as halves)."""
        return self._surface_room(self.half_surface)

    def _surface_room(self, halves: bool) -> int:
        return self.surface_words * (2 if halves else 1) // self.surface_width

    def reserve_surfaces(self, entries: int, most: int | None = None, halves: bool | None = None) -> None:
        """Room for the surface values (and their gradients, once kept) of ``entries`` shaded segments, grown as
        :meth:`reserve_slots` grows its room. The values are stored value by value (shaders/sample_buffers.slang):
        see :meth:`surface_values`; they are not kept (the room grows before a pass writes them), so the smaller
        buffers are freed first. ``halves``: room for a rendered band's values (halves) or a training batch's
        (floats), where the batch is not yet laid out as it will be (None: as it is laid out now)."""
        import slangpy as spy

        halves = self.half_surface if halves is None else halves
        if entries <= self._surface_room(halves):
            return
        capacity = grown(entries, self._surface_room(halves), most)
        words = -(-capacity * self.surface_width // (2 if halves else 1))
        keeps_gradients = self.surface_grads is not None
        self.surface = self.surface_grads = None
        self.surface_words = 0
        self._point_at_surface()
        with device_memory(f"the surface values of {capacity:,} shaded segments"):
            self.surface = spy.Tensor.zeros(self.device, shape=(words,), dtype="float")
            self.surface_words = words
            self._point_at_surface()
            if keeps_gradients:
                self._make_surface_gradients()

    def _make_surface_gradients(self) -> None:
        """∂L/∂(surface values), floats for every shaded segment the surface values have room for as floats (a
        backward pass follows a training batch's strided layout, never a rendered band)."""
        import slangpy as spy

        self.surface_grads = spy.Tensor.zeros(self.device, shape=(self._surface_room(False) * self.surface_width,),
                                              dtype="float")
        self.struct["surfaceGrads"] = self.surface_grads.storage.device_address

    def surface_planes(self, tensor: Any) -> np.ndarray:
        """The surface values (or gradients) in ``tensor`` as one row per value, a column per shaded-list entry."""
        values = np.asarray(tensor.to_numpy())
        if tensor is self.surface and self.half_surface:
            values = values.view(np.float16)[: self.surface_capacity * self.surface_width].astype(np.float32)
        return values.reshape(self.surface_width, -1)

    def surface_values(self, tensor: Any, entries: int) -> np.ndarray:
        """The first ``entries`` shaded segments' surface values (or gradients) in ``tensor``, a row each."""
        return self.surface_planes(tensor)[:, :entries].T

    #: The buffers sized by slots or shaded segments (not the gradients' and the backward's, which training alone
    #: needs) and the shaders' fields that point at them; with their room, what :meth:`take_room` moves.
    ROOM_ADDRESSES = {"samples": "samples", "distances": "distances", "surface_entry": "surfaceEntry",
                      "visibility": "visibility", "shaded_slots": "shadedSlots", "sampled_slots": "sampledSlots",
                      "chunk_rays": "chunkRays", "surface": "surface"}
    ROOM_SIZES = ("slot_capacity", "surface_words")
    ROOM = (*ROOM_ADDRESSES, "_slot_room", *ROOM_SIZES)

    def _point_at_room(self) -> None:
        """The shaders' struct pointed at the buffers sized by slots and shaded segments, with their room."""
        for name, field in self.ROOM_ADDRESSES.items():
            tensor = getattr(self, name)
            self.struct[field] = 0 if tensor is None else address(tensor)
        self.struct["slotCapacity"] = self.slot_capacity
        self._point_at_surface()

    def _point_at_surface(self) -> None:
        """The shaders' struct pointed at the surface values, as floats or as halves (the current layout's), with
        the room they have in it."""
        at = 0 if self.surface is None else address(self.surface)
        self.struct.update(surface=at, surfaceHalves=at, surfaceCapacity=self.surface_capacity,
                           halfSurface=int(self.half_surface))

    def take_room(self, other: RayBatch) -> None:
        """Take over ``other``'s buffers sized by slots and shaded segments (``other`` is left without them): a
        batch made for more rays (a view after training's patches, say) keeps the room the smaller one made, since
        the device's allocator (slang-rhi's heap on CUDA) keeps the pages of buffers let go and would hold both."""
        for name in self.ROOM:
            setattr(self, name, getattr(other, name))
        self._point_at_room()
        for name in self.ROOM:
            setattr(other, name, 0 if name in self.ROOM_SIZES else None)

    def keep_gradients(self, rays: int) -> None:
        """Buffers for ∂L/∂(sample values) and for what the forward pass keeps for the backward, for the first
        ``rays`` rays: a rendering-only batch does without them, and a batch made for a rendered band (far more
        rays) holds them only for the rays trained on it."""

        slots = rays * self.max_samples  # (the strided layout of a training batch)
        self.reserve_slots(slots)
        self.reserve_touched(slots)
        if self.kept is None or self.kept.shape[0] < slots * KEPT_FLOATS:
            self._gradient_room = self.distance_grads = self.kept = None  # free the smaller ones first
            with device_memory(f"the gradient buffers of {rays:,} rays"):
                self._gradient_room = self._arrays_in_one_buffer([
                    ("distance_grads", slots * self.structures, "float"), ("kept", slots * KEPT_FLOATS, "float")])
            self.struct["distanceGrads"] = address(self.distance_grads)
        if self.surface_grads is None:
            self._make_surface_gradients()


def aligned_words(words: int) -> int:
    """``words`` rounded up to whole 128-byte lines: where the next array of a shared buffer starts."""
    return -(-words // 32) * 32


def address(tensor: Any) -> int:
    """The device address of a tensor of 4-byte words (a view into a shared buffer starts past the buffer's)."""
    return tensor.storage.device_address + 4 * tensor.offset


def grown(needed: int, capacity: int, most: int | None = None) -> int:
    """A buffer's new room for ``needed`` entries where it holds ``capacity``: a quarter more than it held at
    least (few regrowths while a renderer's views grow), but no more than ``most`` entries where that is given
    and holds ``needed`` (a memory budget's share)."""
    room = max(needed, capacity + capacity // 4)
    return room if most is None else max(needed, min(room, most))
