"""The latent appearance's networks and grid on a device (shaders/latent_appearance.slang).

The encoder and the decoder are study independent: their parameters, one flat fp32 buffer (the encoder's
then the decoder's, each mlp.slang's layout), are what pretraining fits and a weights file holds. A study
owns only its latent grid: the encoder's codes at the vertices of a grid over its box, stored in fp16 in bricks
of BRICK³ vertices (only the bricks a shaded point can reach, through an index grid of brick slots), which the
decoder reads back trilinearly with the view direction. Kernels are compiled once per set of sizes.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from ..gpu.device import GpuContext, kernel_floats
from ..paths import shader_dir

LATENT_PARTS = ("latent_appearance",)
MAX_GRID_VERTICES = 1 << 26  # a grid past this is a box or cell size gone wrong, not a study
BRICK = 2  # vertices along each axis of a brick of the latent grid (LATENT_BRICK in shaders/latent_appearance.slang)
BRICK_VERTICES = BRICK**3


class LatentConfigError(ValueError):
    """Latent appearance sizes that cannot be built."""


@dataclass(frozen=True)
class LatentConfig:
    """Sizes of the encoder and decoder. ``inputs``: MRI channels + 1 for P(x); ``structures`` and
    ``materials`` as the per-study appearance network's outputs."""

    inputs: int = 5
    latent: int = 8
    encoder_hidden: int = 32
    decoder_hidden: int = 32
    structures: int = 4
    materials: int = 2

    def check(self) -> None:
        if not 1 <= self.inputs <= 8:
            raise LatentConfigError(f"latent appearance: inputs must be 1..8 (got {self.inputs})")
        if self.latent < 2 or self.latent % 2 or self.latent > 32:
            raise LatentConfigError(f"latent appearance: the code length must be even and 2..32 (got {self.latent})")
        if not (1 <= self.encoder_hidden <= 64 and 1 <= self.decoder_hidden <= 64):
            raise LatentConfigError("latent appearance: hidden widths must be 1..64")
        if not 1 <= self.structures <= 8 or self.materials < 1:
            raise LatentConfigError("latent appearance: structures must be 1..8 and materials >= 1")

    @property
    def outputs(self) -> int:
        return self.structures * (3 + self.materials)

    def widths(self) -> tuple[list[int], list[int]]:
        """The encoder's and the decoder's layer widths (the decoder's input: the code, then the view direction)."""
        return ([self.inputs, self.encoder_hidden, self.latent],
                [self.latent + 3, self.decoder_hidden, self.outputs])

    @property
    def decoder_offset(self) -> int:
        return mlp_count(self.widths()[0])

    @property
    def count(self) -> int:
        encoder, decoder = self.widths()
        return mlp_count(encoder) + mlp_count(decoder)

    def initial_parameters(self, seed: int = 0) -> np.ndarray:
        """He-normal ReLU layers, Xavier-like output layers, zero biases."""
        rng = np.random.default_rng(seed)
        values, offset = np.zeros(self.count, np.float32), 0
        for widths in self.widths():
            for index, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
                scale = math.sqrt((1.0 if index == len(widths) - 2 else 2.0) / fan_in)
                values[offset:offset + fan_in * fan_out] = rng.normal(0.0, scale, fan_in * fan_out)
                offset += fan_in * fan_out + fan_out
        return values

    def defines(self) -> dict[str, int]:
        return {"LATENT_INPUTS": self.inputs, "LATENT_ENCODER_HIDDEN": self.encoder_hidden, "LATENT_Z": self.latent,
                "LATENT_DECODER_HIDDEN": self.decoder_hidden, "LATENT_STRUCTURES": self.structures,
                "LATENT_MATERIALS": self.materials}

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatentConfig:
        """Strict: a weights file of other sizes or keys must not half-load."""
        expected = {f.name for f in fields(cls)}
        if set(data) != expected:
            raise LatentConfigError(f"latent appearance keys {sorted(data)} differ from {sorted(expected)}")
        config = cls(**{name: int(data[name]) for name in expected})
        config.check()
        return config


def mlp_count(widths: list[int]) -> int:
    """Parameters of mlp.slang's Mlp with these layer widths (weights row-major [out][in], then biases)."""
    return sum(fan_in * fan_out + fan_out for fan_in, fan_out in zip(widths[:-1], widths[1:], strict=True))


@dataclass(frozen=True)
class GridLayout:
    """Vertices over a box at one cell size, x fastest; vertex (0, 0, 0) at the box's low corner."""

    origin: tuple[float, float, float]
    dims: tuple[int, int, int]
    cell_mm: float

    @classmethod
    def over(cls, bounds: np.ndarray, cell_mm: float) -> GridLayout:
        bounds = np.asarray(bounds, np.float64)
        extent = bounds[1] - bounds[0]
        if not (cell_mm > 0 and np.all(extent > 0)):
            raise LatentConfigError(f"a latent grid needs a positive cell and box (got {cell_mm} mm, "
                                    f"{bounds.tolist()})")
        dims = tuple(max(2, int(math.ceil(e / cell_mm - 1e-6)) + 1) for e in extent)
        if int(np.prod(dims)) > MAX_GRID_VERTICES:
            raise LatentConfigError(f"a latent grid of {dims} vertices at {cell_mm} mm is too large")
        return cls(tuple(map(float, bounds[0])), dims, float(cell_mm))  # type: ignore[arg-type]

    @property
    def vertices(self) -> int:
        return int(np.prod(self.dims))

    @property
    def bricks(self) -> tuple[int, int, int]:
        """Bricks along x, y, z (the last ones partly past the grid)."""
        return tuple(-(-n // BRICK) for n in self.dims)  # type: ignore[return-value]

    def all_slots(self) -> np.ndarray:
        """Brick slots (z, y, x) with every brick stored."""
        x, y, z = self.bricks
        return np.arange(x * y * z, dtype=np.int32).reshape(z, y, x)

    def stored_indices(self, slots: np.ndarray) -> np.ndarray:
        """Where each vertex (the grid's order) is stored under brick ``slots``, -1 where its brick holds none (as
        LatentGrid.vertexIndex)."""
        z, y, x = np.meshgrid(*(np.arange(n) for n in self.dims[::-1]), indexing="ij")
        slot = np.asarray(slots, np.int64)[z // BRICK, y // BRICK, x // BRICK].ravel()
        local = (((z % BRICK) * BRICK + y % BRICK) * BRICK + x % BRICK).ravel()
        return np.where(slot >= 0, slot * BRICK_VERTICES + local, -1)

    def positions(self) -> np.ndarray:
        """RAS mm of every vertex (vertices, 3), in the grid's order."""
        axes = [self.origin[a] + self.cell_mm * np.arange(self.dims[a]) for a in range(3)]
        z, y, x = np.meshgrid(axes[2], axes[1], axes[0], indexing="ij")
        return np.stack([x.ravel(), y.ravel(), z.ravel()], axis=1)


_MODULES: dict[tuple[int, str], Any] = {}


def latent_source(config: LatentConfig, parts: tuple[str, ...] = LATENT_PARTS) -> str:
    """The latent appearance's module source: its sizes as defines, then the shader files ``parts``."""
    config.check()
    lines = [f"#define {name} {value}" for name, value in config.defines().items()]
    lines += [(shader_dir() / f"{part}.slang").read_text() for part in parts]
    return "\n".join(lines)


def latent_module(gpu: GpuContext, config: LatentConfig, parts: tuple[str, ...] = LATENT_PARTS):
    """Compile (once per process, device and sizes) the latent appearance's kernels."""
    source = latent_source(config, parts)
    name = "latent_" + hashlib.sha256(source.encode()).hexdigest()[:16]
    key = (id(gpu.device), name)
    if key not in _MODULES:
        _MODULES[key] = gpu.load_module_from_source(name, source)
    return _MODULES[key]


def check_slots(grid: GridLayout, slots: np.ndarray) -> np.ndarray:
    """Brick slots (z, y, x) as the grid's kernels read them: each stored brick's slot once, 0..n-1 in order."""
    slots = np.asarray(slots)
    if slots.shape != grid.bricks[::-1]:
        raise LatentConfigError(f"brick slots of shape {slots.shape}, the grid has {grid.bricks[::-1]} bricks")
    stored = slots[slots >= 0]
    if slots.min(initial=0) < -1 or not np.array_equal(stored, np.arange(stored.size)):
        raise LatentConfigError("brick slots must number the stored bricks 0, 1, ... in order, -1 for the others")
    return np.ascontiguousarray(slots, np.int32)


def pack_half(codes: np.ndarray) -> np.ndarray:
    """(vertices, Z) codes as the grid stores them: fp16, pairs in uint32s (the even code in the low half)."""
    halves = np.ascontiguousarray(np.asarray(codes, np.float32).astype(np.float16))
    return halves.view(np.uint32).reshape(-1)


def unpack_half(words: np.ndarray, latent: int) -> np.ndarray:
    """The grid's uint32 words back as (vertices, Z) float32 codes."""
    return np.ascontiguousarray(words, np.uint32).view(np.float16).astype(np.float32).reshape(-1, latent)


class LatentAppearance:
    """The networks' parameters and gradients and one study's latent grid (codes and gradients) on a device."""

    def __init__(self, gpu: GpuContext, config: LatentConfig, grid: GridLayout, parameters: np.ndarray | None = None,
                 seed: int = 0, parts: tuple[str, ...] = LATENT_PARTS, slots: np.ndarray | None = None) -> None:
        """``slots``: which bricks hold codes (:func:`check_slots`); None: all of them."""
        import slangpy as spy

        self.gpu, self.config, self.grid = gpu, config, grid
        self.module = latent_module(gpu, config, parts)
        values = config.initial_parameters(seed) if parameters is None else np.asarray(parameters, np.float32)
        if values.shape != (config.count,):
            raise LatentConfigError(f"expected {config.count} latent appearance parameters, got {values.shape}")
        self.values = spy.Tensor.from_numpy(gpu.device, np.ascontiguousarray(values))
        self.grads = spy.Tensor.zeros(gpu.device, shape=(config.count,), dtype=float)
        self.slots = check_slots(grid, grid.all_slots() if slots is None else slots)
        self.slot_tensor = spy.Tensor.from_numpy(gpu.device, self.slots.reshape(-1))
        self.stored = int((self.slots >= 0).sum()) * BRICK_VERTICES  # vertices the grid stores codes for
        size = max(1, self.stored) * config.latent
        self.codes = spy.Tensor.from_numpy(gpu.device, np.zeros(size // 2, np.uint32))
        self.code_grads = spy.Tensor.zeros(gpu.device, shape=(size,), dtype=float)
        self._indices: np.ndarray | None = None
        # Counts the changes of `values` (set_parameters, the fine-tune's steps: weights_changed), so that copies of
        # the decoder made for the tensor cores know when they are stale.
        self.weights_version = 0
        self.source_digest = ""  # SHA-256 of the pretrained weights the networks came from ("" if none)

    def shader_struct(self, grid_gradients: bool = True) -> dict[str, Any]:
        """The ``LatentAppearance`` struct; without ``grid_gradients`` the grid is frozen for the pass."""
        import slangpy as spy

        return kernel_floats({
            "params": {"values": self.values.storage.device_address, "grads": self.grads.storage.device_address},
            "grid": {"values": self.codes.storage.device_address,
                     "grads": self.code_grads.storage.device_address if grid_gradients else 0,
                     "slots": self.slot_tensor.storage.device_address, "dims": spy.int3(*self.grid.dims),
                     "bricks": spy.int3(*self.grid.bricks), "origin": spy.float3(*self.grid.origin),
                     "cellInv": 1.0 / self.grid.cell_mm},
            "encoderOffset": 0,
            "decoderOffset": self.config.decoder_offset,
        })

    def parameters(self) -> np.ndarray:
        return np.asarray(self.values.to_numpy(), np.float32).reshape(-1)

    def set_parameters(self, values: np.ndarray) -> None:
        values = np.asarray(values, np.float32)
        if values.shape != (self.config.count,):
            raise LatentConfigError(f"expected {self.config.count} latent appearance parameters, got {values.shape}")
        self.values.copy_from_numpy(np.ascontiguousarray(values))
        self.weights_changed()

    def weights_changed(self) -> None:
        """Note that ``values`` changed on the device (every writer calls this)."""
        self.weights_version += 1

    def gradients(self) -> np.ndarray:
        return np.asarray(self.grads.to_numpy(), np.float32).reshape(-1)

    def stored_indices(self) -> np.ndarray:
        """Where each of the grid's vertices is stored, -1 where its brick holds no codes."""
        if self._indices is None:
            self._indices = self.grid.stored_indices(self.slots)
        return self._indices

    def _dense(self, stored: np.ndarray) -> np.ndarray:
        """Stored rows (stored vertices, Z) as the whole grid's (vertices, Z), zero where nothing is stored."""
        indices = self.stored_indices()
        dense = np.zeros((self.grid.vertices, self.config.latent), np.float32)
        dense[indices >= 0] = stored[indices[indices >= 0]]
        return dense

    def _stored(self, dense: np.ndarray, what: str) -> np.ndarray:
        """The whole grid's rows (vertices, Z) as stored rows (stored vertices, Z)."""
        dense = np.asarray(dense, np.float32)
        if dense.shape != (self.grid.vertices, self.config.latent):
            raise LatentConfigError(f"expected {what} {(self.grid.vertices, self.config.latent)}, got {dense.shape}")
        indices = self.stored_indices()
        stored = np.zeros((max(1, self.stored), self.config.latent), np.float32)
        stored[indices[indices >= 0]] = dense[indices >= 0]
        return stored

    def grid_gradients(self) -> np.ndarray:
        """The codes' gradients at every vertex of the grid (vertices, Z); zero where nothing is stored."""
        stored = np.asarray(self.code_grads.to_numpy(), np.float32).reshape(-1, self.config.latent)
        return self._dense(stored)

    def set_grid_gradients(self, gradients: np.ndarray) -> None:
        self.code_grads.copy_from_numpy(self._stored(gradients, "gradients").reshape(-1))

    def zero_gradients(self) -> None:
        self.grads.copy_from_numpy(np.zeros(self.config.count, np.float32))
        self.code_grads.copy_from_numpy(np.zeros(max(1, self.stored) * self.config.latent, np.float32))

    def stored_codes(self, read=None) -> np.ndarray:
        """The stored codes (stored vertices, Z) in fp16, as the device holds them (brick by brick); ``read``: how
        a tensor's 32-bit words come back (a :class:`~NeuralRaycastLib.gpu.device.ReadBack`'s read; default the
        tensor's own)."""
        raw = self.codes.to_numpy() if read is None else read(self.codes)
        words = np.ascontiguousarray(raw).view(np.uint32).reshape(-1)
        return words.view(np.float16).reshape(-1, self.config.latent)[:self.stored]

    def set_stored_codes(self, codes: np.ndarray) -> None:
        codes = np.asarray(codes)
        if codes.shape != (self.stored, self.config.latent):
            raise LatentConfigError(f"expected stored codes {(self.stored, self.config.latent)}, got {codes.shape}")
        if self.stored:
            self.codes.copy_from_numpy(np.ascontiguousarray(codes, np.float16).view(np.uint32).reshape(-1))

    def grid_codes(self) -> np.ndarray:
        """The codes at every vertex of the grid (vertices, Z), as the fp16 storage holds them; zero where nothing
        is stored."""
        return self._dense(unpack_half(np.asarray(self.codes.to_numpy()), self.config.latent))

    def set_grid_codes(self, codes: np.ndarray) -> None:
        self.codes.copy_from_numpy(pack_half(self._stored(codes, "codes")))

    def encode(self, inputs: np.ndarray | list[np.ndarray], ras_to_ijk: np.ndarray) -> None:
        """Fill the grid: the encoder over a study's local inputs (V, I, J, K volumes: normalised channels, then
        P(x); or the volumes that make them up, in order), sampled trilinearly at every vertex whose brick is
        stored."""
        from ..render.volume import interleaved_volumes

        parts = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
        given = sum(1 if np.ndim(part) == 3 else len(part) for part in parts)
        if given != self.config.inputs:
            raise LatentConfigError(f"the encoder takes {self.config.inputs} local inputs, the study gives {given}")
        _tensor, volumes = interleaved_volumes(self.gpu, parts, ras_to_ijk)
        self.encode_uploaded(volumes)
        self.gpu.device.wait()

    def encode_uploaded(self, volumes: dict[str, Any]) -> None:
        """:meth:`encode` from local inputs already on the device (an ``InterleavedVolumes`` struct holding them
        in the encoder's order), so a study's volumes are not interleaved and uploaded a second time."""
        import slangpy as spy

        count = self.grid.vertices
        self.module.latentEncodeGrid(spy.grid((count,)), count, self.shader_struct(), volumes)

    def shade(self, points: np.ndarray, directions: np.ndarray) -> np.ndarray:
        """(N, K, 3 + M): per structure the albedo and the materials at RAS points seen along directions."""
        import slangpy as spy

        points = np.ascontiguousarray(points, np.float32).reshape(-1, 3)
        directions = np.ascontiguousarray(directions, np.float32).reshape(-1, 3)
        count = len(points)
        device = self.gpu.device
        result = spy.Tensor.zeros(device, shape=(count * self.config.outputs,), dtype=float)
        uploaded = [spy.Tensor.from_numpy(device, values.reshape(-1)) for values in (points, directions)]
        addresses = [tensor.storage.device_address for tensor in (*uploaded, result)]
        self.module.latentShadeAt(spy.grid((count,)), count, self.shader_struct(), *addresses)
        return np.asarray(result.to_numpy()).reshape(count, self.config.structures, 3 + self.config.materials)
