"""A fitted field's geometry with the pretrained appearance, as a scene of the differentiable renderer
(shaders/latent_render.slang), and what a study needs to get there: the pretrained weights, the encoder run
over the study into its latent grid, and the grid saved beside the run's model (``appearance.safetensors``).

The field's own appearance network is left as it was (untrained): the latent scene replaces it for every
picture of the run (evaluate, render)."""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..field.coop_vectors import CONVERT_THREADS
from ..field.field import FieldLayout, NeuralField, field_session_defines, field_source
from ..gpu.device import GpuContext
from ..grid import least_corner, marked_corners
from ..paths import shader_dir
from ..render.scene import WorkLists
from .latent import BRICK, GridLayout, LatentAppearance, LatentConfig, LatentConfigError, latent_module
from .pretrain import WEIGHTS_KEY, WeightsFileError, latent_inputs, read_weights

APPEARANCE_FILE = "appearance.safetensors"
APPEARANCE_FORMAT = "neuralraycast-latent-grid"
APPEARANCE_VERSION = 2  # 2: the grid stored brick by brick, one bit a brick saying which
#: A field that is not exactly 1-Lipschitz (as the renderer's occupancy allows for, field_render.py).
BAND_LIPSCHITZ = 1.5
#: Segments further than this many ε from every surface are shaded (the image model's band is BAND_WIDTHS ε,
#: image_formation.slang) but add nothing a picture shows: the grid holds no codes for them (they read zero).
VISIBLE_WIDTHS = 2.0

_MODULES: dict[tuple[int, str], Any] = {}


def latent_scene_source(layout: FieldLayout, config: LatentConfig, cooperative: bool = False,
                        coop_vectors: int | None = None) -> str:
    """The module source of the field's kernels (the geometry network on tensor cores where ``cooperative``, on
    cooperative vectors of that Kind where ``coop_vectors``) with the latent appearance and its scene."""
    lines = [f"#define {name} {value}" for name, value in config.defines().items()]
    lines.append(field_source(layout, ("sdf_fit",), cooperative=cooperative, coop_vectors=coop_vectors))
    lines += [(shader_dir() / f"{part}.slang").read_text() for part in ("latent_appearance", "latent_render")]
    return "\n".join(lines)


def latent_scene_module(gpu: GpuContext, field: NeuralField, config: LatentConfig, cooperative: bool = False,
                        coop_vectors: int | None = None):
    """:func:`latent_scene_source`'s kernels, compiled once per process, device and sizes (those on cooperative
    vectors in their own session, as the field's: field.py's field_session_defines)."""
    source = latent_scene_source(field.layout, config, cooperative, coop_vectors)
    name = "latent_scene_" + hashlib.sha256(source.encode()).hexdigest()[:16]
    key = (id(gpu.device), name)
    if key not in _MODULES:
        _MODULES[key] = gpu.load_module_from_source(name, source, field.layout.kernels.structures,
                                                    field_session_defines(coop_vectors) or None)
    return _MODULES[key]


class LatentFieldScene:
    """The field's distances and normals (on tensor cores or cooperative vectors where the field's networks are),
    the latent grid's appearance."""

    def __init__(self, gpu: GpuContext, field: NeuralField, latent: LatentAppearance) -> None:
        if latent.config.structures < field.structures:
            raise LatentConfigError(f"the pretrained appearance holds {latent.config.structures} structures, the "
                                    f"study has {field.structures}")
        self.field, self.latent, self.cooperative = field, latent, bool(field.cooperative)
        self.coop_vectors = field.coop_vectors
        self.module = latent_scene_module(gpu, field, latent.config, self.cooperative, self.coop_vectors)
        self._tiled_decoder: Any = None  # the decoder in the tensor cores' layout, made on first use
        self._tiled_version: int | None = None  # the latent weights' version it holds

    @property
    def structures(self) -> int:
        return self.field.structures

    @property
    def decodes_on_tensor_cores(self) -> bool:
        """Whether the forward passes run the decoder on tensor cores: the geometry network is on them, and the
        decoder's hidden layer is whole tiles (shaders/latent_render.slang's LATENT_DECODER_MMA)."""
        return self.cooperative and self.latent.config.decoder_hidden % 16 == 0

    def tiled_decoder(self) -> int:
        """The device address of the decoder's tiled copy, brought up to date with its weights first (0 where the
        decoder runs per thread): converted once for a finished model's frames, once a step while fine-tuning."""
        if not self.decodes_on_tensor_cores:
            return 0
        import slangpy as spy

        if self._tiled_decoder is None:
            count = int(self.module.latentDecoderTiledCount())
            self._tiled_decoder = spy.Tensor.zeros(self.latent.gpu.device, shape=(count,), dtype=float)
        if self._tiled_version != self.latent.weights_version:
            self.module.latentDecoderToTiled(spy.grid((CONVERT_THREADS,)), CONVERT_THREADS,
                                             self.latent.values.storage.device_address,
                                             self.latent.config.decoder_offset,
                                             self._tiled_decoder.storage.device_address)
            self._tiled_version = self.latent.weights_version
        return self._tiled_decoder.storage.device_address

    def struct(self) -> dict[str, Any]:
        return {"field": self.field.shader_struct(self.cooperative, geometry_network_gradients=False,
                                                  coop_vectors=self.coop_vectors is not None),
                "latent": self.latent.shader_struct(),
                "tiledDecoder": {"values": self.tiled_decoder(), "grads": 0}}

    def distances(self, grid: Any, buffers: dict) -> None:
        # the tiled or half copy of the geometry network, made once for a finished field
        if self.cooperative:
            self.field.upload_tiled_networks(unless_current=True)
        elif self.coop_vectors is not None:
            self.field.upload_coop_vector_weights(unless_current=True, names=("geometry",))
        self.module.latentFieldDistances(grid, self.struct(), buffers)

    def surface(self, grid: Any, buffers: dict) -> None:
        self.module.latentFieldSurface(grid, self.struct(), buffers)

    def backward_appearance(self, lists: WorkLists, buffers: dict, timings: dict[str, float] | None = None) -> None:
        """The shaded segments' albedo and specular gradients into the decoder and the latent grid."""
        if lists.shaded:
            self.module.latentAppearanceBackward(WorkLists.launch(lists.shaded), self.struct(), buffers)

    def backward(self, lists: WorkLists, buffers: dict, timings: dict[str, float] | None = None) -> None:
        """The geometry is the field's, trained by its own fit: only the appearance takes gradients here."""
        self.backward_appearance(lists, buffers, timings)


def latent_renderer(gpu: GpuContext, prepared, field: NeuralField, latent: LatentAppearance, max_samples: int,
                    occupancy_cell_mm: float, shade_weight: float):
    """The differentiable renderer of the field with the latent appearance, in the study's default style,
    samples placed where the learned distances put a surface (as the field's own renderer)."""
    from ..field.field_render import field_occupancy
    from ..render.neural_render import DiffRenderer
    from ..render.reference_render import march_settings
    from ..render.style import RenderStyle

    style = RenderStyle.default(prepared.structures, prepared.channel_names)
    settings = march_settings(prepared, style)
    box = np.array([list(settings["boxMin"]), list(settings["boxMax"])], np.float64)
    occupancy = field_occupancy(field, box, occupancy_cell_mm, float(settings["epsilon"]))
    return DiffRenderer(gpu, LatentFieldScene(gpu, field, latent),
                        style.shader_look(prepared.structures, prepared.channel_names), style.shader_lighting(),
                        settings, occupancy, max_samples=max_samples, shade_weight=shade_weight)


def study_grid(field: NeuralField) -> GridLayout:
    """The latent grid of a study: over the field's box, at its finest cell (the resolution its SDF has)."""
    origin = np.asarray(field.layout.origin, np.float64)
    return GridLayout.over(np.stack([origin, origin + np.asarray(field.layout.extent)]), field.layout.finest_cell_mm)


def brick_slots(nearest: np.ndarray, reach_mm: float) -> np.ndarray:
    """Brick slots (z, y, x) of the bricks holding a corner of a cell where min_k |s_k| at some corner
    (``nearest``, (z, y, x) over the grid's vertices) is within ``reach_mm``: numbered in order, -1 for the
    others."""
    nearest = np.asarray(nearest, np.float32)
    vertices = marked_corners(least_corner(nearest) <= reach_mm)
    bricks = [-(-n // BRICK) for n in nearest.shape]
    padded = np.zeros([n * BRICK for n in bricks], bool)
    padded[:nearest.shape[0], :nearest.shape[1], :nearest.shape[2]] = vertices
    needed = padded.reshape(bricks[0], BRICK, bricks[1], BRICK, bricks[2], BRICK).any(axis=(1, 3, 5))
    slots = np.full(needed.shape, -1, np.int32)
    slots[needed] = np.arange(int(needed.sum()), dtype=np.int32)
    return slots


def band_reach(grid: GridLayout, epsilon_mm: float) -> float:
    """How far from a surface a cell's nearest corner may lie and the cell still be stored: where a segment adds
    to a picture, its middle lies within VISIBLE_WIDTHS ε of a surface, give or take half a segment (about ε),
    and no point of a cell is further than half its diagonal from every corner; the field's distances may
    stretch those by BAND_LIPSCHITZ."""
    return VISIBLE_WIDTHS * epsilon_mm + BAND_LIPSCHITZ * (0.5 * math.sqrt(3.0) * grid.cell_mm + epsilon_mm)


def study_slots(field: NeuralField, grid: GridLayout, epsilon_mm: float, config: LatentConfig | None = None
                ) -> np.ndarray:
    """The bricks of a study's latent grid that shaded points can reach: those near the field's surfaces. With a
    ``config`` they are found on the device (:func:`device_brick_slots`: a flag a brick comes back rather than a
    distance a vertex); without, on the host (:func:`brick_slots`)."""
    origin, reach = np.asarray(grid.origin, np.float64), band_reach(grid, epsilon_mm)
    if config is None:
        return brick_slots(field.nearest_on_grid(origin, grid.cell_mm, grid.dims), reach)
    nearest = field.nearest_on_grid_on_device(origin, grid.cell_mm, grid.dims)
    return device_brick_slots(latent_module(field.gpu, config), nearest, grid, reach)


def device_brick_slots(module, nearest, grid: GridLayout, reach_mm: float) -> np.ndarray:
    """:func:`brick_slots` of min_k |s_k| at the grid's vertices held on the device (``nearest``, a tensor of one
    float a vertex, x fastest), decided there (shaders/latent_appearance.slang's latentBricksNear, a brick a
    thread): slots numbered in order, -1 for the bricks no shaded point reaches."""
    import slangpy as spy

    count = int(np.prod(grid.bricks))
    near = spy.Tensor.empty(nearest.device, shape=(count,), dtype="int")
    module.latentBricksNear(spy.grid((count,)), spy.int3(*grid.dims), spy.int3(*grid.bricks),
                            nearest.storage.device_address, float(reach_mm), near.storage.device_address)
    needed = np.asarray(near.to_numpy()).reshape(grid.bricks[::-1]) != 0
    slots = np.full(needed.shape, -1, np.int32)
    slots[needed] = np.arange(int(needed.sum()), dtype=np.int32)
    return slots


def study_epsilon(prepared) -> float:
    """The image model's ε of the study's default style (the band the renderer shades)."""
    from ..render.reference_render import march_settings
    from ..render.style import RenderStyle

    return float(march_settings(prepared, RenderStyle.default(prepared.structures, prepared.channel_names))["epsilon"])


def uploaded_inputs(scene, prepared) -> dict[str, Any] | None:
    """The local inputs a field scene holds on the device (the study's channels, then P(x)) where they are the
    encoder's (:func:`latent_inputs`: every channel slot filled, so P(x) comes in its slot); None otherwise."""
    from ..field.field_render import FieldScene
    from .pretrain import CHANNEL_SLOTS

    if isinstance(scene, FieldScene) and len(prepared.channels) == CHANNEL_SLOTS:
        return scene.inputs
    return None


@dataclass
class PretrainedAppearance:
    """Pretrained weights, read and checked, for ``fit --appearance pretrained``."""

    config: LatentConfig
    parameters: np.ndarray
    digest: str
    fine_tune_steps: int = 0  # image steps on the grid and the decoder after the encoder (0: no step limit)
    fine_tune_seconds: float = 0.0  # or as many steps as this wall clock holds, whichever ends first (0: no limit)

    @classmethod
    def read(cls, path: str | Path, fine_tune_steps: int = 0, fine_tune_seconds: float = 0.0) -> PretrainedAppearance:
        if fine_tune_steps < 0:
            raise ValueError(f"fine-tune steps must be 0 or more (got {fine_tune_steps})")
        if not (fine_tune_seconds >= 0 and math.isfinite(fine_tune_seconds)):
            raise ValueError(f"fine-tune seconds must be 0 or more (got {fine_tune_seconds})")
        config, parameters, metadata = read_weights(path)
        return cls(config, parameters, str(metadata["sha256"]), int(fine_tune_steps), float(fine_tune_seconds))

    @property
    def fine_tunes(self) -> bool:
        return bool(self.fine_tune_steps or self.fine_tune_seconds)

    def load_kernels(self, gpu: GpuContext, field: NeuralField) -> None:
        """Load the modules of the kernels the encoder and the field's pictures with this appearance run (once per
        process: a run loads them while its study's boundary maps are still being computed). A field of more
        structures than the weights hold loads none: it is refused where it is encoded."""
        if field.structures <= self.config.structures:
            latent_module(gpu, self.config)
            latent_scene_module(gpu, field, self.config, bool(field.cooperative), field.coop_vectors)

    def encode_study(self, gpu: GpuContext, prepared, field: NeuralField, scene=None) -> LatentAppearance:
        """The encoder over the study into a latent grid over the field's box: a renderable appearance, with no
        training. ``scene``: the trainer's (a FieldScene's local inputs, already on the device, are the encoder's
        when the study fills every channel slot)."""
        return self.encode_bricks(gpu, prepared, self.latent_bricks(prepared, field), scene)

    def latent_bricks(self, prepared, field: NeuralField) -> tuple[GridLayout, np.ndarray]:
        """The study's latent grid and the bricks of it that are stored (:func:`study_slots`)."""
        if len(prepared.structures) > self.config.structures:
            raise LatentConfigError(f"the pretrained appearance holds {self.config.structures} structures, the "
                                    f"study has {len(prepared.structures)}")
        grid = study_grid(field)
        return grid, study_slots(field, grid, study_epsilon(prepared), self.config)

    def encode_bricks(self, gpu: GpuContext, prepared, bricks: tuple[GridLayout, np.ndarray],
                      scene=None) -> LatentAppearance:
        """:meth:`encode_study` into the grid and bricks of :meth:`latent_bricks`."""
        grid, slots = bricks
        latent = LatentAppearance(gpu, self.config, grid, self.parameters, slots=slots)
        uploaded = uploaded_inputs(scene, prepared)
        if uploaded is not None:
            latent.encode_uploaded(uploaded)
        else:
            latent.encode(latent_inputs(prepared), np.linalg.inv(prepared.affine))
        latent.source_digest = self.digest
        return latent


def slots_of(stored: np.ndarray, grid: GridLayout) -> np.ndarray:
    """Brick slots from a bit a brick (stored or not), slots numbered in order."""
    count = int(np.prod(grid.bricks))
    bits = np.unpackbits(np.asarray(stored, np.uint8))
    if bits.size != -(-count // 8) * 8 or bits[count:].any():
        raise LatentConfigError(f"{bits.size} brick bits for a grid of {count} bricks")
    needed = bits[:count].astype(bool)
    slots = np.full(count, -1, np.int32)
    slots[needed] = np.arange(int(needed.sum()), dtype=np.int32)
    return slots.reshape(grid.bricks[::-1])


def values_digest(parameters: np.ndarray, stored: np.ndarray, codes: np.ndarray) -> str:
    """SHA-256 of a latent appearance's stored values, fed piece by piece (no joined copy of the grid)."""
    digest = hashlib.sha256()
    for values in (parameters, stored, codes):
        digest.update(memoryview(np.ascontiguousarray(values)).cast("B"))
    return digest.hexdigest()


def appearance_bytes(latent: LatentAppearance, digest: str) -> bytes:
    """A study's latent appearance: the networks' parameters, which bricks are stored (a bit a brick, z, y, x
    order: their slots follow) and the stored fp16 codes (read back as the device holds them, no conversion),
    with the grid's sizes and layout."""
    return appearance_encoder(latent, digest)()


def appearance_encoder(latent: LatentAppearance, digest: str, read=None) -> Callable[[], bytes]:
    """:func:`appearance_bytes` in two halves: the device's values are read here (``read``: a tensor's float32
    words, default its own read), and the returned function, which touches no device and may run on another
    thread, hashes and lays out the file's bytes."""
    parameters = np.ascontiguousarray(latent.parameters() if read is None else read(latent.values), np.float32)
    stored = np.packbits(latent.slots.reshape(-1) >= 0)
    codes = latent.stored_codes(read)
    config, grid = latent.config.as_dict(), latent.grid

    def encode() -> bytes:
        from safetensors.numpy import save

        metadata = {"format": APPEARANCE_FORMAT, "version": APPEARANCE_VERSION, "latent": config,
                    "grid": {"origin": list(grid.origin), "dims": list(grid.dims), "cell_mm": grid.cell_mm,
                             "brick": BRICK},
                    "pretrained_sha256": digest, "sha256": values_digest(parameters, stored, codes)}
        return save({"parameters": parameters, "bricks": stored, "grid": codes},
                    metadata={WEIGHTS_KEY: json.dumps(metadata)})

    return encode


def load_appearance(gpu: GpuContext, path: str | Path, field: NeuralField) -> LatentAppearance:
    """A run's latent appearance on the device, checked against its digest and the field's box."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = json.loads((handle.metadata() or {})[WEIGHTS_KEY])
            if metadata.get("format") != APPEARANCE_FORMAT or metadata.get("version") != APPEARANCE_VERSION:
                raise WeightsFileError(f"{path}: not a file of version {APPEARANCE_VERSION} of {APPEARANCE_FORMAT}; "
                                       "fit the run again")
            parameters = np.asarray(handle.get_tensor("parameters"), np.float32)
            stored = np.asarray(handle.get_tensor("bricks"), np.uint8)
            codes = np.asarray(handle.get_tensor("grid"), np.float16)
        config = LatentConfig.from_dict(metadata["latent"])
        grid = GridLayout(tuple(map(float, metadata["grid"]["origin"])), tuple(map(int, metadata["grid"]["dims"])),
                          float(metadata["grid"]["cell_mm"]))  # type: ignore[arg-type]
    except WeightsFileError:
        raise
    except Exception as error:  # damaged headers, short files and missing keys raise several types
        raise WeightsFileError(f"{path}: not a latent appearance file ({error})") from error
    if values_digest(parameters, stored, codes) != metadata.get("sha256"):
        raise WeightsFileError(f"{path}: the stored values do not match their digest (altered or damaged)")
    if grid != study_grid(field) or metadata["grid"].get("brick") != BRICK:
        raise WeightsFileError(f"{path}: the latent grid is not over this run's field; fit the run again")
    try:
        latent = LatentAppearance(gpu, config, grid, parameters, slots=slots_of(stored, grid))
        latent.set_stored_codes(codes)
    except LatentConfigError as error:
        raise WeightsFileError(f"{path}: the latent grid's bricks do not match its codes ({error})") from error
    latent.source_digest = str(metadata.get("pretrained_sha256", ""))
    return latent


class FineTune:
    """Adam on a study's latent grid (from an fp32 copy of its codes; the grid keeps fp16) and on the decoder, both
    on the device: a step reads nothing back. The encoder is left as pretrained."""

    def __init__(self, latent: LatentAppearance, rate_grid: float = 2e-3, rate_decoder: float = 2e-4) -> None:
        import slangpy as spy

        self.latent, self.rate_grid, self.rate_decoder = latent, rate_grid, rate_decoder
        device, size = latent.gpu.device, max(1, latent.stored) * latent.config.latent
        words = np.ascontiguousarray(latent.codes.to_numpy(), np.uint32)
        self.master = spy.Tensor.from_numpy(device, words.view(np.float16).astype(np.float32))
        self.m = spy.Tensor.zeros(device, shape=(size,), dtype=float)
        self.v = spy.Tensor.zeros(device, shape=(size,), dtype=float)
        decoder = latent.config.count - latent.config.decoder_offset
        self.dm = spy.Tensor.zeros(device, shape=(decoder,), dtype=float)
        self.dv = spy.Tensor.zeros(device, shape=(decoder,), dtype=float)
        self.steps = 0

    def step(self, beta1: float = 0.9, beta2: float = 0.99, epsilon: float = 1e-8) -> None:
        """One Adam update from the gradients the last backward pass left; they are zeroed."""
        import slangpy as spy

        self.steps += 1
        c1, c2 = 1.0 / (1.0 - beta1**self.steps), 1.0 / (1.0 - beta2**self.steps)
        latent = self.latent
        words = latent.stored * latent.config.latent // 2
        if words:  # a grid may store nothing: no surface of the study near any of its bricks
            latent.module.latentGridAdam(spy.grid((words,)), words, latent.shader_struct()["grid"],
                                         self.master.storage.device_address, self.m.storage.device_address,
                                         self.v.storage.device_address, self.rate_grid, beta1, beta2, c1, c2,
                                         epsilon)
        count = latent.config.count
        latent.module.latentParameterAdam(spy.grid((count,)), count, latent.config.decoder_offset,
                                          latent.values.storage.device_address, latent.grads.storage.device_address,
                                          self.dm.storage.device_address, self.dv.storage.device_address,
                                          self.rate_decoder, beta1, beta2, c1, c2, epsilon)
        latent.weights_changed()


def fine_tune(trainer, latent: LatentAppearance, steps: int, progress=None, seconds: float = 0.0) -> list[float]:
    """Image steps of the trainer's schedule on the latent grid and the decoder, the geometry frozen: ``steps`` of
    them, or as many as ``seconds`` of wall clock hold (a step ends with its loss read back, so the clock holds
    its device work), whichever ends first (0: no limit of that kind). The trainer renders through the latent
    scene meanwhile. Returns each step's loss."""
    if not (steps or seconds):
        return []
    start = time.perf_counter()
    c = trainer.config
    trainer.renderer = latent_renderer(trainer.gpu, trainer.prepared, trainer.field, latent, c.max_samples,
                                       c.occupancy_cell_mm, c.shade_weight)
    optimiser, losses, step = FineTune(latent), [], 0
    while True:
        done = max(step / steps if steps else 0.0, (time.perf_counter() - start) / seconds if seconds else 0.0)
        if done >= 1.0:
            return losses
        terms = trainer.image_step(geometry=False)
        step += 1
        if not np.isfinite(terms["loss"]):
            latent.zero_gradients()
            continue
        optimiser.step()
        losses.append(float(terms["loss"]))
        if progress is not None and step % 10 == 1:
            progress(f"fine-tune: step {step} loss {losses[-1]:.4f}", min(done, 1.0))
