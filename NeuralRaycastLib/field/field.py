"""The neural field: configuration, parameter layout, initialisation, and its Slang kernels on a device.

All trainable numbers live in one flat fp32 buffer (the master weights), in this order: the hash tables
of every level, the geometry network, the appearance network. Each range is an Adam parameter group.
The Slang code is generic over the network sizes; this module compiles it with the sizes of a config
(one compile per distinct config and device, cached on disk by slangpy). The kernels hold a capacity of
structures (4 or 8) and appearance inputs (5) rather than a study's own counts, which they are given at run
time: studies with other counts share them (FieldLayout.kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from ..gpu.device import (
    COOPERATIVE_ENV,
    COOPVEC_ENV,
    GpuContext,
    coop_vector_networks,
    device_memory,
    kernel_floats,
    memory_budget,
    structure_slots,
    tensor_core_networks,
)
from ..paths import shader_dir
from .coop_vectors import CONVERT_THREADS, NETWORKS, CoopVectorNetwork, padded_inputs
from .coop_vectors import COOPVEC_FALLBACK as COOPVEC_FALLBACK  # (the Kind of the fallback, for callers)

GROUP_TABLE, GROUP_GEOMETRY, GROUP_APPEARANCE = 0, 1, 2
FIELD_PARTS = ("sdf_fit", "field_render")  # the kernel files of a field module, in order
GROUP_NAMES = ("hash_table", "geometry", "appearance")
MAX_HIDDEN = 64
MAX_STRUCTURES = 8
#: The appearance inputs the kernels hold: up to four MRI channels and P(x). A study with fewer gets zeros in
#: the others, so every study of one to four channels runs on the same kernels.
INPUT_CAPACITY = 5
FROZEN_GEOMETRY = 2  # FIELD_COOPERATIVE of the tensor-core kernels whose geometry weights are frozen
#: FIELD_COOPERATIVE of the networks on cooperative vectors is this plus coopvec_mlp.slang's Kind (0: their
#: per-thread fallback, 1 and 2: on the device, the weights' gradients summed in half or float).
COOPVEC_GEOMETRY = 3
#: What the session of a field module on cooperative vectors defines, and no other session: every cooperative-vector
#: construct of the shaders sits behind it, so the CUDA and per-thread modules are the same Slang as without them.
COOPVEC_DEFINES = {"FIELD_COOPVEC": "1"}
TABLE_INIT = 1e-4  # Instant-NGP: table entries start in U(-1e-4, 1e-4)
# How a hashed level finds a vertex's entry (EncodingConfig.hash), and the value of each in
# shaders/hash_encoding.slang (FIELD_HASHING). Which levels are dense is no define but a value the kernels are
# given (the grid's denseLevels), since it follows the study's box and voxels.
HASHES = ("x_added", "xor")
LEVEL_HASHED, LEVEL_HASHED_XOR = 0, 2


class FieldConfigError(ValueError):
    """A field configuration that cannot be built (sizes out of range, unknown keys)."""


@dataclass(frozen=True)
class EncodingConfig:
    """Multi-resolution hash grid. Cell sizes follow from the study's box, in millimetres."""

    levels: int = 16
    features: int = 2
    log2_table: int = 19
    coarsest_cells: int = 16  # cells across the longest side of the box at the coarsest level
    finest_cell_mm: float = 0.5
    # "x_added": x + (y·πy XOR z·πz), so that a vertex's neighbour along x has the next entry and the two
    # corners' gradients go out in one atomic (the fit's bound); "xor": Instant-NGP's x XOR y·πy XOR z·πz,
    # which model files of format 1 and 2 were trained with.
    hash: str = "x_added"

    def check(self) -> None:
        if not 1 <= self.levels <= 32 or self.features not in (1, 2, 4, 8):
            raise FieldConfigError(f"encoding: levels must be 1..32 and features 1, 2, 4 or 8 (got {self})")
        if self.hash not in HASHES:
            raise FieldConfigError(f"encoding: hash must be one of {', '.join(HASHES)} (got '{self.hash}')")
        if not 8 <= self.log2_table <= 24:
            raise FieldConfigError(f"encoding: log2_table must be 8..24 (got {self.log2_table})")
        if self.coarsest_cells < 1 or self.finest_cell_mm <= 0:
            raise FieldConfigError("encoding: coarsest_cells must be >= 1 and finest_cell_mm > 0")


@dataclass(frozen=True)
class NetworkConfig:
    """Widths of the geometry and appearance networks (hidden widths at most 64)."""

    hidden: int = 64
    hidden_layers: int = 2
    geometry_features: int = 15
    appearance_hidden: int = 64
    materials: int = 2  # per structure, besides the RGB albedo
    distance_scale_mm: float = 10.0  # the geometry network outputs distances in units of this

    def check(self) -> None:
        if not (1 <= self.hidden <= MAX_HIDDEN and 1 <= self.appearance_hidden <= MAX_HIDDEN):
            raise FieldConfigError(f"network: hidden widths must be 1..{MAX_HIDDEN}")
        if self.hidden_layers not in (1, 2):
            raise FieldConfigError("network: hidden_layers must be 1 or 2")
        if self.geometry_features < 1 or self.materials < 1 or self.distance_scale_mm <= 0:
            raise FieldConfigError("network: geometry_features and materials must be >= 1, distance_scale_mm > 0")

    @property
    def tile_sized(self) -> bool:
        """Whether both hidden widths are whole 16-wide tiles, as the tensor-core networks need."""
        return self.hidden % 16 == 0 and self.appearance_hidden % 16 == 0


@dataclass(frozen=True)
class FieldConfig:
    encoding: EncodingConfig = field(default_factory=EncodingConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FieldConfig:
        """Strict: unknown or missing keys are errors (a model file from another version must not half-load)."""
        try:
            parts = {}
            for name, kind in (("encoding", EncodingConfig), ("network", NetworkConfig)):
                values = dict(data[name])
                expected = {f.name for f in fields(kind)}
                if set(values) != expected:
                    raise FieldConfigError(f"{name}: keys {sorted(values)} differ from {sorted(expected)}")
                parts[name] = kind(**values)
            if set(data) != {"encoding", "network"}:
                raise FieldConfigError(f"unexpected configuration keys {sorted(set(data) - {'encoding', 'network'})}")
        except (KeyError, TypeError) as error:
            raise FieldConfigError(f"malformed field configuration: {error}") from error
        config = cls(**parts)
        config.check()
        return config

    def check(self) -> None:
        self.encoding.check()
        self.network.check()


def field_config_for(voxel_mm: float, small: bool = False) -> FieldConfig:
    """The field to fit to a study with voxels of ``voxel_mm``: the full one (finest cells one voxel), or
    with ``small`` one for software devices, where the full one takes minutes to compile and hours to fit."""
    if small:
        return FieldConfig(
            EncodingConfig(levels=8, log2_table=16, coarsest_cells=8, finest_cell_mm=max(voxel_mm, 2.0)),
            NetworkConfig(hidden=32, hidden_layers=1, geometry_features=3, appearance_hidden=16),
        )
    return FieldConfig(encoding=EncodingConfig(finest_cell_mm=voxel_mm))


def mlp_parameter_count(inputs: int, hidden: int, outputs: int, hidden_layers: int) -> int:
    """Matches ``Mlp<I, H, O, HL>.ParameterCount`` in shaders/mlp.slang."""
    return (inputs * hidden + hidden) + (hidden_layers - 1) * (hidden * hidden + hidden) + (hidden * outputs + outputs)


def kernel_capacity(structures: int, appearance_inputs: int) -> tuple[int, int]:
    """The structures and appearance inputs the kernels of a field with these counts are compiled for: the
    structure slots that hold them (4 or 8) and :data:`INPUT_CAPACITY` inputs (more where a study has more
    channels), so studies with other counts share compiled kernels."""
    return structure_slots(structures), max(appearance_inputs, INPUT_CAPACITY)


def mlp_positions(widths: list[int], padded: list[int], units: list[np.ndarray]) -> np.ndarray:
    """Where each parameter of an MLP of layer ``widths`` lies in the same MLP with ``padded`` widths, unit i of
    layer boundary b being unit ``units[b][i]`` there (mlp.slang's layout: each layer's weights row-major
    [out][in], then its biases)."""
    positions, offset = [], 0
    for layer in range(len(widths) - 1):
        inputs, outputs = padded[layer], padded[layer + 1]
        positions.append(offset + (units[layer + 1][:, None] * inputs + units[layer][None, :]).ravel())
        positions.append(offset + inputs * outputs + units[layer + 1])
        offset += inputs * outputs + outputs
    return np.concatenate(positions)


def network_offsets(config: FieldConfig, geometry_offset: int, structures: int, inputs: int) -> tuple[int, int]:
    """(appearance network's offset, parameter count) of a field with these counts whose networks start at
    ``geometry_offset``."""
    net = config.network
    appearance_offset = geometry_offset + mlp_parameter_count(
        config.encoding.levels * config.encoding.features, net.hidden, structures + net.geometry_features,
        net.hidden_layers)
    count = appearance_offset + mlp_parameter_count(
        net.geometry_features + inputs, net.appearance_hidden, structures * (3 + net.materials), 1)
    return appearance_offset, count


@dataclass(frozen=True)
class LevelLayout:
    dims: tuple[int, int, int]
    cell_mm: float
    offset: int
    size: int
    dense: bool


@dataclass(frozen=True)
class FieldLayout:
    """Where every parameter lives, for one config, box, number of structures and of local inputs.

    The kernels hold ``capacity`` structures and inputs, at least the study's: on the device the networks
    have that many outputs and inputs (:attr:`kernels`), the unused ones' weights zero and kept there (their
    outputs are never read, their inputs are zeros: no gradient reaches them), so a study with other counts
    runs on the same compiled kernels. Model files and :meth:`NeuralField.parameters` hold the study's own
    layout (this one), which :meth:`pad` and :meth:`unpad` convert."""

    config: FieldConfig
    structures: int
    appearance_inputs: int  # MRI channels + 1 for P(x)
    origin: tuple[float, float, float]
    extent: tuple[float, float, float]
    levels: tuple[LevelLayout, ...]
    geometry_offset: int
    appearance_offset: int
    count: int
    capacity: tuple[int, int] = (0, 0)  # (structures, appearance inputs) of the kernels

    @classmethod
    def build(cls, config: FieldConfig, bounds: np.ndarray, structures: int, channels: int,
              capacity: tuple[int, int] | None = None) -> FieldLayout:
        """``capacity``: the structures and inputs the kernels hold (default :func:`kernel_capacity`)."""
        config.check()
        if not 1 <= structures <= MAX_STRUCTURES:
            raise FieldConfigError(f"the field holds 1..{MAX_STRUCTURES} structures (got {structures})")
        capacity = kernel_capacity(structures, channels + 1) if capacity is None else tuple(capacity)
        if not (structures <= capacity[0] <= MAX_STRUCTURES and channels + 1 <= capacity[1]):
            raise FieldConfigError(f"kernels for {capacity[0]} structures and {capacity[1]} inputs cannot hold "
                                   f"{structures} structures and {channels + 1} inputs")
        bounds = np.asarray(bounds, dtype=np.float64)
        extent = bounds[1] - bounds[0]
        if not np.all(extent > 0):
            raise FieldConfigError(f"empty bounding box {bounds.tolist()}")
        enc = config.encoding
        coarsest = float(extent.max()) / enc.coarsest_cells
        finest = min(enc.finest_cell_mm, coarsest)
        growth = (finest / coarsest) ** (1.0 / (enc.levels - 1)) if enc.levels > 1 else 1.0
        table = 1 << enc.log2_table
        levels, offset = [], 0
        for level in range(enc.levels):
            cell = coarsest * growth**level
            dims = tuple(int(math.ceil(e / cell)) + 2 for e in extent)
            vertices = dims[0] * dims[1] * dims[2]
            dense = vertices <= table
            size = vertices if dense else table
            levels.append(LevelLayout(dims, cell, offset, size, dense))  # type: ignore[arg-type]
            offset += size * enc.features
        appearance_offset, count = network_offsets(config, offset, structures, channels + 1)
        return cls(
            config, structures, channels + 1, tuple(map(float, bounds[0])), tuple(map(float, extent)),
            tuple(levels), offset, appearance_offset, count, (int(capacity[0]), int(capacity[1])),
        )

    def with_structure_capacity(self, structures: int) -> FieldLayout:
        """This layout on kernels that hold ``structures`` structures (a warm-up compiles those of a capacity
        its study does not need)."""
        if not self.structures <= structures <= MAX_STRUCTURES:
            raise FieldConfigError(f"kernels for {structures} structures cannot hold {self.structures}")
        return dataclasses.replace(self, capacity=(int(structures), self.capacity[1]))

    @functools.cached_property
    def kernels(self) -> FieldLayout:
        """The layout on the device: the networks at the kernels' capacity (this layout where it is the same)."""
        structures, inputs = self.capacity
        if (structures, inputs) == (self.structures, self.appearance_inputs):
            return self
        appearance_offset, count = network_offsets(self.config, self.geometry_offset, structures, inputs)
        return dataclasses.replace(self, structures=structures, appearance_inputs=inputs,
                                   appearance_offset=appearance_offset, count=count)

    @functools.cached_property
    def kernel_positions(self) -> np.ndarray:
        """Where each parameter of this layout lies in :attr:`kernels`: the table and hidden layers in place,
        the geometry network's features after the capacity's distances, the appearance network's inputs and
        outputs of the unused places after the study's."""
        kernels, net = self.kernels, self.config.network
        if kernels is self:
            return np.arange(self.count)
        k, g = self.structures, net.geometry_features
        hidden = [np.arange(net.hidden)] * net.hidden_layers
        geometry = mlp_positions(
            [self.config.encoding.levels * self.config.encoding.features] + [net.hidden] * net.hidden_layers + [k + g],
            [self.config.encoding.levels * self.config.encoding.features] + [net.hidden] * net.hidden_layers
            + [kernels.structures + g],
            [np.arange(self.config.encoding.levels * self.config.encoding.features), *hidden,
             np.concatenate([np.arange(k), kernels.structures + np.arange(g)])])
        outputs = k * (3 + net.materials)
        appearance = mlp_positions(
            [g + self.appearance_inputs, net.appearance_hidden, outputs],
            [g + kernels.appearance_inputs, net.appearance_hidden, kernels.structures * (3 + net.materials)],
            [np.arange(g + self.appearance_inputs), np.arange(net.appearance_hidden), np.arange(outputs)])
        return np.concatenate([np.arange(self.geometry_offset), self.geometry_offset + geometry,
                               kernels.appearance_offset + appearance])

    def pad(self, values: np.ndarray) -> np.ndarray:
        """This layout's parameters (or gradients) laid out as :attr:`kernels`, zeros in the unused places."""
        values = np.asarray(values, np.float32)
        if self.kernels is self:
            return values
        padded = np.zeros(self.kernels.count, np.float32)
        padded[self.kernel_positions] = values
        return padded

    def unpad(self, values: np.ndarray) -> np.ndarray:
        """:attr:`kernels`' parameters (or gradients) back in this layout."""
        values = np.asarray(values, np.float32)
        return values if self.kernels is self else values[self.kernel_positions]

    @classmethod
    def for_study(cls, prepared, small: bool = False, voxel_mm: float | None = None) -> FieldLayout:
        """The layout of the field for a prepared study (``field_config_for`` its finest voxel, or
        ``voxel_mm``; ``small`` on software devices), over its bounds, structures and channels."""
        voxel_mm = float(prepared.spacing.min()) if voxel_mm is None else voxel_mm
        return cls.build(field_config_for(voxel_mm, small), prepared.bounds, len(prepared.structures),
                         len(prepared.channel_names))

    @property
    def finest_cell_mm(self) -> float:
        return self.levels[-1].cell_mm

    @property
    def shifted_gradients(self) -> int:
        """Where the hash table's second gradient copy starts in the field's gradient buffer: after the
        parameters' gradients, at 2 more than a multiple of 4, so that the pairs of entries that straddle two
        16-byte blocks of the first copy are whole blocks there (shaders/hash_encoding.slang's scatterPair)."""
        return self.count + (2 - self.count) % 4

    @property
    def gradient_count(self) -> int:
        """Length of the field's gradient buffer: the parameters', the table's second copy, and the four zeros
        that Adam's vector reads of that copy may reach past its end."""
        return self.shifted_gradients + self.geometry_offset + 4

    @property
    def dense_levels(self) -> int:
        """How many levels, the coarsest, are indexed densely (the others are hashed): the kernels' grid is told
        at run time (``denseLevels``), so it is no part of :meth:`defines`."""
        dense = [level.dense for level in self.levels]
        count = dense.index(False) if False in dense else len(dense)
        if any(dense[count:]):  # levels grow finer, so a dense level never follows a hashed one
            raise FieldConfigError(f"dense levels must come first: {dense}")
        return count

    def defines(self) -> dict[str, int]:
        enc, net = self.config.encoding, self.config.network
        return {
            "FIELD_LEVELS": enc.levels,
            "FIELD_FEATURES": enc.features,
            "FIELD_HIDDEN": net.hidden,
            "FIELD_HIDDEN_LAYERS": net.hidden_layers,
            "FIELD_STRUCTURES": self.structures,
            "FIELD_GEOMETRY_FEATURES": net.geometry_features,
            "FIELD_APPEARANCE_INPUTS": self.appearance_inputs,
            "FIELD_APPEARANCE_HIDDEN": net.appearance_hidden,
            "FIELD_MATERIALS": net.materials,
            "FIELD_HASHING": LEVEL_HASHED_XOR if enc.hash == "xor" else LEVEL_HASHED,
            "FIELD_ENCODED": enc.levels * enc.features,
            "FIELD_GEOMETRY_OUTPUTS": self.structures + net.geometry_features,
            "FIELD_APPEARANCE_NET_INPUTS": net.geometry_features + self.appearance_inputs,
            "FIELD_APPEARANCE_NET_OUTPUTS": self.structures * (3 + net.materials),
        }

    def groups(self) -> np.ndarray:
        """The Adam group of every parameter."""
        groups = np.full(self.count, GROUP_APPEARANCE, dtype=np.int32)
        groups[: self.geometry_offset] = GROUP_TABLE
        groups[self.geometry_offset : self.appearance_offset] = GROUP_GEOMETRY
        return groups

    def segments(self) -> dict[str, tuple[int, int]]:
        """Parameter ranges by group name (what the model file stores as separate tensors)."""
        return {
            GROUP_NAMES[GROUP_TABLE]: (0, self.geometry_offset),
            GROUP_NAMES[GROUP_GEOMETRY]: (self.geometry_offset, self.appearance_offset),
            GROUP_NAMES[GROUP_APPEARANCE]: (self.appearance_offset, self.count),
        }

    def initial_parameters(self, seed: int = 0) -> np.ndarray:
        """Table entries tiny and uniform; He-normal weights for ReLU layers, small output layers, zero biases."""
        rng = np.random.default_rng(seed)
        enc, net = self.config.encoding, self.config.network
        values = np.zeros(self.count, dtype=np.float32)
        values[: self.geometry_offset] = rng.uniform(-TABLE_INIT, TABLE_INIT, self.geometry_offset)
        geometry = [enc.levels * enc.features] + [net.hidden] * net.hidden_layers + [
            self.structures + net.geometry_features
        ]
        appearance = [net.geometry_features + self.appearance_inputs, net.appearance_hidden,
                      self.structures * (3 + net.materials)]
        for offset, widths in ((self.geometry_offset, geometry), (self.appearance_offset, appearance)):
            for index, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
                last = index == len(widths) - 2
                scale = math.sqrt((1.0 if last else 2.0) / fan_in)
                values[offset : offset + fan_in * fan_out] = rng.normal(0.0, scale, fan_in * fan_out)
                offset += fan_in * fan_out + fan_out  # biases stay 0
        return values

    def active_levels(self, cell_mm: float | None) -> int:
        """How many levels are at least ``cell_mm`` coarse (all of them for None)."""
        if cell_mm is None:
            return len(self.levels)
        return max(1, sum(1 for level in self.levels if level.cell_mm >= cell_mm * (1 - 1e-6)))


_MODULES: dict[tuple[int, str], Any] = {}


def field_source(layout: FieldLayout, parts: tuple[str, ...] = FIELD_PARTS, cooperative: bool = False,
                 frozen_geometry: bool = False, coop_vectors: int | None = None) -> str:
    """The Slang source of a field module: the sizes of the layout's kernels (its capacity, not the study's
    counts) as #defines, then the kernel files. ``cooperative`` puts the geometry network on tensor cores (for
    kernels where whole waves evaluate it together); ``frozen_geometry`` as well, its backward passes giving
    input gradients alone (the renderer's); ``coop_vectors`` (coopvec_mlp.slang's Kind) on cooperative vectors,
    compiled in a session with :data:`COOPVEC_DEFINES` (:func:`field_session_defines`)."""
    lines = [f"#define {name} {value}" for name, value in layout.kernels.defines().items()]
    value = FROZEN_GEOMETRY if frozen_geometry else int(cooperative)
    if coop_vectors is not None:
        value = COOPVEC_GEOMETRY + coop_vectors
    lines.append(f"#define FIELD_COOPERATIVE {value}")
    for part in parts:
        lines.append((shader_dir() / f"{part}.slang").read_text())
    return "\n".join(lines)


def field_session_defines(coop_vectors: int | None) -> dict[str, str]:
    """The defines a field module's session needs besides the device's: FIELD_COOPVEC for the cooperative
    vectors' variant alone."""
    return dict(COOPVEC_DEFINES) if coop_vectors is not None else {}


def load_field_module(gpu: GpuContext, layout: FieldLayout, parts: tuple[str, ...] = FIELD_PARTS,
                      cooperative: bool = False, frozen_geometry: bool = False, coop_vectors: int | None = None):
    """Compile (once per process, config and device) the field kernels for this layout's kernel sizes: layouts
    that differ only in their structures and inputs within one capacity share them."""
    source = field_source(layout, parts, cooperative, frozen_geometry, coop_vectors)
    name = "field_" + hashlib.sha256(source.encode()).hexdigest()[:16]
    key = (id(gpu.device), name)
    if key not in _MODULES:
        _MODULES[key] = gpu.load_module_from_source(name, source, layout.kernels.structures,
                                                    field_session_defines(coop_vectors) or None)
    return _MODULES[key]


#: What a point's share of the SDF fit's mean loss is scaled to before the cooperative vectors take its gradient
#: into half: well inside half's normal range (from 6.1e-05), with a batch's sums far below its largest (65504).
COOP_GRADIENT_TARGET = 2.0 ** -10


def coop_gradient_scale(point_weight: float) -> float:
    """The power of two that brings ``point_weight`` (a point's weight in the loss) to about
    COOP_GRADIENT_TARGET: exact to apply and to take back out."""
    return 2.0 ** round(math.log2(COOP_GRADIENT_TARGET / point_weight)) if point_weight > 0 else 1.0


def coop_vector_sized(layout: FieldLayout) -> bool:
    """Whether the geometry network's inputs and both hidden widths are multiples of 8: the cooperative vectors
    read a layer's weights a row at a time, and a row must span a multiple of 16 bytes. (The appearance network's
    inputs are padded to one; the geometry network's come from the hash grid, whose sizes the config chooses.)"""
    net = layout.config.network
    encoded = layout.kernels.defines()["FIELD_ENCODED"]
    return padded_inputs(encoded) == encoded and net.hidden % 8 == 0 and net.appearance_hidden % 8 == 0


class NeuralField:
    """A field on the device: its parameters, gradient buffer and kernels. The device holds them in the
    kernels' layout (``layout.kernels``); :meth:`parameters`, :meth:`set_parameters` and :meth:`gradients` speak
    the study's (``layout``)."""

    def __init__(
        self,
        gpu: GpuContext,
        layout: FieldLayout,
        parameters: np.ndarray | None = None,
        seed: int = 0,
        parts: tuple[str, ...] = FIELD_PARTS,
        cooperative: bool | None = None,
        coop_vectors: int | str | None = "auto",
    ) -> None:
        import slangpy as spy

        self.gpu, self.layout = gpu, layout
        capability = gpu.report.compute_capability
        tile_sized = layout.config.network.tile_sized
        if cooperative is None:
            cooperative = tile_sized and tensor_core_networks(gpu.backend, capability,
                                                              os.environ.get(COOPERATIVE_ENV, "1"))[0]
        elif cooperative and not (here := tensor_core_networks(gpu.backend, capability, "1"))[0]:
            raise FieldConfigError(f"the tensor-core networks cannot run on this device ({here[1]})")
        elif cooperative and not tile_sized:
            raise FieldConfigError("the tensor-core networks need hidden widths that are multiples of 16 "
                                   f"(got {layout.config.network.hidden} and "
                                   f"{layout.config.network.appearance_hidden})")
        self.cooperative = cooperative
        # The geometry network on cooperative vectors, in the SDF fit and the renderer's kernels alike
        # (coopvec_mlp.slang's Kind; None: not; "auto": where the device has them).
        if coop_vectors == "auto":
            coop_vectors = None if cooperative or not coop_vector_sized(layout) else coop_vector_networks(
                gpu.backend, gpu.report.cooperative_vector, os.environ.get(COOPVEC_ENV, "1"))[0]
        self.coop_vectors: int | None = coop_vectors
        self._coop_vector_module = None
        # The networks on cooperative vectors (coop_network); each one's gradient scale is set by the pass that
        # trains it from its loss's scale (coop_gradient_scale): the SDF fit's, the renderer's backward.
        self._coop_networks: dict[str, CoopVectorNetwork] = {}
        self.parts = parts
        self.module = load_field_module(gpu, layout, parts)
        self.kernels = layout.kernels
        values = layout.initial_parameters(seed) if parameters is None else np.asarray(parameters, np.float32)
        if values.shape != (layout.count,):
            raise FieldConfigError(f"expected {layout.count} parameters, got {values.shape}")
        self.values = spy.Tensor.from_numpy(gpu.device, np.ascontiguousarray(layout.pad(values)))
        self.grads = spy.Tensor.zeros(gpu.device, shape=(self.kernels.gradient_count,), dtype=float)
        self.active_levels = len(layout.levels)
        self._tiled: dict[str, Any] | None = None  # addresses of the tiled copies (tiled_networks)
        self._tiled_buffers: list[Any] = []
        # Counts the changes of `values` (set_parameters, Adam steps: weights_changed); the tiled copies hold
        # the weights as of change _tiled_version (None: not uploaded yet).
        self.weights_version = 0
        self._tiled_version: int | None = None
        self._cooperative_module = None
        self._frozen_module = None

    @property
    def fit_module(self):
        """The module with the fit and render kernels: tensor-core geometry network where ``cooperative``."""
        if not self.cooperative:
            return self.module
        if self._cooperative_module is None:
            self._cooperative_module = load_field_module(self.gpu, self.layout, FIELD_PARTS, cooperative=True)
        return self._cooperative_module

    @property
    def geometry_network(self) -> str:
        """Where the geometry network of the fit and the renderer runs, in words (the benches' notes)."""
        if self.cooperative:
            return "on tensor cores"
        return "per thread" if self.coop_vectors is None else "on cooperative vectors"

    @property
    def sdf_fit_module(self):
        """The module the SDF fit runs, and the renderer where the field has ``coop_vectors``: ``fit_module``, or
        the geometry network on cooperative vectors."""
        if self.coop_vectors is None:
            return self.fit_module
        if self._coop_vector_module is None:
            self._coop_vector_module = load_field_module(self.gpu, self.layout, self.parts,
                                                         coop_vectors=self.coop_vectors)
        return self._coop_vector_module

    def coop_network(self, name: str) -> CoopVectorNetwork:
        """The ``name`` network ("geometry" or "appearance") on cooperative vectors: its buffers, made on first use."""
        if name not in self._coop_networks:
            defines, net = self.kernels.defines(), self.layout.config.network
            if name == "geometry":
                widths = ([defines["FIELD_ENCODED"]] + [net.hidden] * net.hidden_layers
                          + [defines["FIELD_GEOMETRY_OUTPUTS"]])
                offset = self.kernels.geometry_offset
            else:
                widths = [defines["FIELD_APPEARANCE_NET_INPUTS"], net.appearance_hidden,
                          defines["FIELD_APPEARANCE_NET_OUTPUTS"]]
                offset = self.kernels.appearance_offset
            self._coop_networks[name] = CoopVectorNetwork(self.gpu, self.sdf_fit_module, name, self.coop_vectors,
                                                          widths, offset)
        return self._coop_networks[name]

    def upload_coop_vector_weights(self, unless_current: bool = False, names: tuple[str, ...] = NETWORKS) -> None:
        """The networks' half copies from the current weights; ``unless_current``: nothing where a copy holds them
        already (the renderer's forward passes, which only read them: a finished field's frames convert nothing)."""
        for name in names:
            self.coop_network(name).upload(self.values.storage.device_address, self.weights_version, unless_current)

    def upload_coop_vector_network(self, name: str = "geometry", unless_current: bool = False) -> None:
        """Before a pass that trains the ``name`` network on cooperative vectors: its half copy from the current
        weights (``unless_current``: where it does not hold them already; the renderer's backward follows its
        forward, which made it) and its weights' gradient sums zeroed."""
        self.upload_coop_vector_weights(unless_current, names=(name,))
        self.coop_network(name).clear_sums()

    def add_coop_vector_gradients(self, name: str = "geometry") -> None:
        """After that pass: the ``name`` network's weights' gradient sums added to the field's gradients."""
        self.coop_network(name).add_gradients(self.grads.storage.device_address)

    @property
    def frozen_module(self):
        """The renderer's backward kernels for ``cooperative`` fields: both networks on tensor cores, the
        geometry network's weights frozen (its backward pass gives the input gradient alone)."""
        if self._frozen_module is None:
            self._frozen_module = load_field_module(self.gpu, self.layout, FIELD_PARTS, frozen_geometry=True)
        return self._frozen_module

    def tiled_networks(self) -> dict[str, Any]:
        """Device addresses of the ``TiledNetworks`` struct's buffers (shaders/sdf_fit.slang: both networks in
        the tensor cores' layout, values and gradients), made on first use, and of a row-major scratch buffer
        for the gradients' way back."""
        if self._tiled is None:
            import slangpy as spy

            def zeros(count: int):
                return spy.Tensor.zeros(self.gpu.device, shape=(int(count),), dtype=float)

            self._tiled_buffers = [zeros(self.fit_module.geometryTiledCount()),
                                   zeros(self.fit_module.geometryGradientLength()),  # copies: sdf_fit.slang
                                   zeros(self.fit_module.appearanceTiledCount()),
                                   zeros(self.fit_module.appearanceTiledCount()),
                                   zeros(self.kernels.count - self.kernels.geometry_offset)]
            address = [buffer.storage.device_address for buffer in self._tiled_buffers]
            self._tiled = {"geometry": {"values": address[0], "grads": address[1]},
                           "appearance": {"values": address[2], "grads": address[3]}, "scratch": address[4]}
        return self._tiled

    def upload_tiled_networks(self, unless_current: bool = False) -> None:
        """Copy both networks' current weights into the tiled layout and zero those copies' gradients (before
        each pass of the kernels on tensor cores that trains them). ``unless_current``: for passes that only
        read the weights, nothing where the copies already hold them (frames of a finished field, where the copy
        would be a measurable part of every frame)."""
        import slangpy as spy

        if unless_current and self._tiled_version == self.weights_version:
            return
        tiled = self.tiled_networks()
        self.fit_module.networksToTiled(
            spy.grid((CONVERT_THREADS,)), CONVERT_THREADS, self.values.storage.device_address,
            self.kernels.geometry_offset, self.kernels.appearance_offset,
            {"geometry": tiled["geometry"], "appearance": tiled["appearance"]})
        self._tiled_version = self.weights_version

    def weights_changed(self) -> None:
        """Note that ``values`` changed on the device (every writer calls this: set_parameters, Adam)."""
        self.weights_version += 1

    def add_tiled_gradients(self) -> None:
        """Add the tiled copies' gradients to the field's (after a pass of the kernels on tensor cores that
        trains the networks)."""
        import slangpy as spy

        tiled, grid = self.tiled_networks(), spy.grid((CONVERT_THREADS,))
        networks = {"geometry": tiled["geometry"], "appearance": tiled["appearance"]}
        self.fit_module.networkGradientsFromTiled(grid, CONVERT_THREADS, networks, tiled["scratch"],
                                                  self.grads.storage.device_address, self.kernels.geometry_offset,
                                                  self.kernels.appearance_offset, self.kernels.count)

    @property
    def structures(self) -> int:
        return self.layout.structures

    def parameters(self) -> np.ndarray:
        """The study's parameters (``layout``: the unused places of the kernels' layout left out)."""
        return self.layout.unpad(np.asarray(self.values.to_numpy(), dtype=np.float32).reshape(-1))

    def kernel_parameters(self) -> np.ndarray:
        """The parameters as the device holds them (``kernels``' layout, the unused places included)."""
        return np.asarray(self.values.to_numpy(), dtype=np.float32).reshape(-1)

    def kernel_gradients(self) -> np.ndarray:
        """The gradients in the kernels' layout (the hash table's two copies added, as Adam adds them)."""
        raw = np.asarray(self.grads.to_numpy(), dtype=np.float32).reshape(-1)
        gradients = raw[: self.kernels.count].copy()
        table, shifted = self.kernels.geometry_offset, self.kernels.shifted_gradients
        gradients[:table] += raw[shifted : shifted + table]
        return gradients

    def gradients(self) -> np.ndarray:
        """The parameters' gradients in the study's layout (the hash table's two copies added)."""
        return self.layout.unpad(self.kernel_gradients())

    def set_parameters(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float32)
        if values.shape != (self.layout.count,):
            raise FieldConfigError(f"expected {self.layout.count} parameters, got {values.shape}")
        self.values.copy_from_numpy(np.ascontiguousarray(self.layout.pad(values)))
        self.weights_changed()

    def zero_gradients(self) -> None:
        """Cleared on the device: no buffer of zeros made on the host and uploaded (hundreds of MB for a full field)."""
        self.grads.clear()

    def shader_struct(self, cooperative: bool = False, geometry_network_gradients: bool = True,
                      coop_vectors: bool = False) -> dict[str, Any]:
        """The ``Field`` struct (NeuralField<...> in shaders/neural_field.slang); ``cooperative`` for the
        kernels of ``fit_module`` and ``frozen_module`` where the geometry network runs on tensor cores,
        ``coop_vectors`` for those of ``sdf_fit_module`` where it runs on cooperative vectors.
        Without ``geometry_network_gradients`` the per-thread geometry network's backward pass (and that on
        cooperative vectors) returns input gradients only (its weights are left out; on tensor cores that is
        ``frozen_module``'s)."""
        import slangpy as spy

        levels = [
            {
                "dims": spy.int3(*level.dims),
                "cellInv": 1.0 / level.cell_mm,
                "offset": level.offset,
                "size": level.size,
            }
            for level in self.layout.levels
        ]
        params = {"values": self.values.storage.device_address, "grads": self.grads.storage.device_address}
        tiled = {"geometry": {"values": 0, "grads": 0}, "appearance": {"values": 0, "grads": 0}}
        if cooperative:
            tiled = self.tiled_networks()
        struct = {
            "params": params,
            "grid": {"levels": levels, "origin": spy.float3(*self.layout.origin), "activeLevels": self.active_levels,
                     "denseLevels": self.layout.dense_levels, "shiftedGrads": self.kernels.shifted_gradients},
            "geometryOffset": self.kernels.geometry_offset,
            "tiledGeometry": tiled["geometry"],
            "tiledAppearance": tiled["appearance"],
            "geometryNetworkGradients": int(geometry_network_gradients),
            "structures": self.structures,
            "appearanceOffset": self.kernels.appearance_offset,
            "distanceScale": self.layout.config.network.distance_scale_mm,
        }
        if coop_vectors:  # the members exist only in the modules of the cooperative vectors' session
            grads = self.grads.storage.device_address
            struct["coopGeometry"] = self.coop_network("geometry").struct(grads)
            struct["coopAppearance"] = self.coop_network("appearance").struct(grads)
        return kernel_floats(struct)

    def default_step_mm(self) -> float:
        """The step of :meth:`distance_gradients`' tetrahedral differences: half the finest active cell."""
        return 0.5 * self.layout.levels[self.active_levels - 1].cell_mm

    def distances(self, points: np.ndarray) -> np.ndarray:
        """Signed distances (N, K) in mm at RAS points (N, 3).

        The field is trained only inside its box (the study's bounds, which hold every structure); outside
        it the network's values mean nothing, so a point there gets the distance at the nearest point of
        the box plus its distance to the box (every structure is outside, as it should be).
        """
        # In float32, as the kernel reads them, and without np.clip and np.linalg.norm, which are markedly
        # slower on a fine grid's millions of points (BENCHMARKS.md).
        points = np.asarray(points, dtype=np.float32).reshape(-1, 3)
        low = np.asarray(self.layout.origin, np.float64)
        high = (low + np.asarray(self.layout.extent, np.float64)).astype(np.float32)
        clamped = np.minimum(np.maximum(points, low.astype(np.float32)), high)
        outside = points - clamped
        beyond = np.sqrt(np.einsum("ij,ij->i", outside, outside))
        distances = self._query("distancesAt", clamped, self.structures)
        return distances.reshape(-1, self.structures) + beyond[:, None]

    def nearest_on_grid(self, origin: np.ndarray, cell_mm: float, corners: tuple[int, int, int]) -> np.ndarray:
        """min_k |s_k| (float32, shape (z, y, x)) at the corners ``origin + cell_mm · (x, y, z)`` of a grid of
        ``corners`` (x, y, z) points: what the renderer's occupancy needs of the field (field_render.py),
        the points made on the device and one value a point read back, in chunks as :meth:`_query`'s.
        Outside the field's box, as :meth:`distances`."""
        import slangpy as spy

        count = int(np.prod(corners))
        chunk = self._query_chunk(1)
        out = np.empty(count, np.float32)
        for first in range(0, count, chunk):
            size = min(chunk, count - first)
            with device_memory(f"the field's values at {size:,} grid points"):
                result = spy.Tensor.zeros(self.gpu.device, shape=(size,), dtype=float)
            self._nearest_on_grid(origin, cell_mm, corners, first, size, result.storage.device_address)
            out[first:first + size] = np.asarray(result.to_numpy())
        return out.reshape(corners[2], corners[1], corners[0])

    def nearest_on_grid_on_device(self, origin: np.ndarray, cell_mm: float, corners: tuple[int, int, int]):
        """:meth:`nearest_on_grid`'s values left on the device, one float a corner (x fastest): a tensor, for kernels
        that read them there."""
        import slangpy as spy

        count = int(np.prod(corners))
        with device_memory(f"the field's values at {count:,} grid points"):
            result = spy.Tensor.empty(self.gpu.device, shape=(count,), dtype=float)
        chunk = self._query_chunk(1)
        for first in range(0, count, chunk):
            self._nearest_on_grid(origin, cell_mm, corners, first, min(chunk, count - first),
                                  result.storage.device_address + 4 * first)
        return result

    def _nearest_on_grid(self, origin: np.ndarray, cell_mm: float, corners: tuple[int, int, int], first: int,
                         size: int, address: int) -> None:
        """One launch of ``nearestOnGrid``: corners ``first`` .. ``first + size - 1`` into the floats at ``address``."""
        import slangpy as spy

        low = np.asarray(self.layout.origin, np.float64)
        high = low + np.asarray(self.layout.extent, np.float64)
        self.module.nearestOnGrid(spy.grid((size,)), size, first, self.shader_struct(),
                                  spy.float3(*(float(v) for v in origin)), kernel_floats(cell_mm), spy.int3(*corners),
                                  spy.float3(*low), spy.float3(*high), address)

    def distance_gradients(self, points: np.ndarray, step_mm: float | None = None) -> np.ndarray:
        """∇s_k (N, K, 3) by tetrahedral differences (the same ones the Eikonal term uses)."""
        step = float(step_mm or self.default_step_mm())
        return self._query("gradientsAt", points, 3 * self.structures, step).reshape(-1, self.structures, 3)

    def _query_chunk(self, floats_per_point: int) -> int:
        """Points per launch of a query whose buffers take ``floats_per_point`` floats a point: as many as the GPU
        memory budget's share for a band of rays holds (gpu/memory_budget.py)."""
        return max(1024, memory_budget(self.gpu).share("band") // (4 * floats_per_point))

    def _query(self, kernel: str, points: np.ndarray, per_point: int, *settings: float) -> np.ndarray:
        """``per_point`` values a point from one of the module's query kernels (a thread a point, every
        structure from the same network evaluations), in chunks whose points and values fit the GPU memory
        budget's share for a band of rays (gpu/memory_budget.py)."""
        import slangpy as spy

        points = np.ascontiguousarray(points, dtype=np.float32).reshape(-1, 3)
        if len(points) == 0:
            return np.zeros((0, per_point), np.float32)
        device = self.gpu.device
        chunk = self._query_chunk(3 + per_point)
        values = []
        for first in range(0, len(points), chunk):
            part = points[first:first + chunk]
            with device_memory(f"the field's values at {len(part):,} points"):
                uploaded = spy.Tensor.from_numpy(device, part.reshape(-1))
                result = spy.Tensor.zeros(device, shape=(len(part) * per_point,), dtype=float)
            getattr(self.module, kernel)(spy.grid((len(part),)), len(part), self.shader_struct(),
                                         uploaded.storage.device_address, *settings, result.storage.device_address)
            values.append(np.asarray(result.to_numpy()).reshape(-1, per_point))
        return values[0] if len(values) == 1 else np.concatenate(values)

    def normals(self, points: np.ndarray, step_mm: float | None = None) -> np.ndarray:
        """Outward unit normals (N, K, 3)."""
        gradient = self.distance_gradients(points, step_mm)
        length = np.linalg.norm(gradient, axis=-1, keepdims=True)
        return np.where(length > 1e-12, gradient / np.maximum(length, 1e-12), np.array([0.0, 0.0, 1.0]))
