"""A fitted field's geometry with the pretrained appearance, as a scene of the differentiable renderer
(shaders/latent_render.slang), and what a study needs to get there: the pretrained weights, the encoder run
over the study into its latent grid, and the grid saved beside the run's model (``appearance.safetensors``).

The field's own appearance network is left as it was (untrained): the latent scene replaces it for every
picture of the run (evaluate, render)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..field.field import NeuralField, field_source
from ..gpu.device import GpuContext
from ..paths import shader_dir
from ..render.scene import WorkLists
from .latent import GridLayout, LatentAppearance, LatentConfig, LatentConfigError, pack_half
from .pretrain import WEIGHTS_KEY, WeightsFileError, latent_inputs, read_weights

APPEARANCE_FILE = "appearance.safetensors"
APPEARANCE_FORMAT = "neuralraycast-latent-grid"
APPEARANCE_VERSION = 1

_MODULES: dict[tuple[int, str], Any] = {}


def latent_scene_module(gpu: GpuContext, field: NeuralField, config: LatentConfig):
    """The field's kernels (per-thread networks) with the latent appearance and its scene, compiled once per
    process, device and sizes."""
    lines = [f"#define {name} {value}" for name, value in config.defines().items()]
    lines.append(field_source(field.layout, ("sdf_fit",)))
    lines += [(shader_dir() / f"{part}.slang").read_text() for part in ("latent_appearance", "latent_render")]
    source = "\n".join(lines)
    name = "latent_scene_" + hashlib.sha256(source.encode()).hexdigest()[:16]
    key = (id(gpu.device), name)
    if key not in _MODULES:
        _MODULES[key] = gpu.load_module_from_source(name, source, field.layout.kernels.structures)
    return _MODULES[key]


class LatentFieldScene:
    """The field's distances and normals, the latent grid's appearance."""

    cooperative = False

    def __init__(self, gpu: GpuContext, field: NeuralField, latent: LatentAppearance) -> None:
        if latent.config.structures < field.structures:
            raise LatentConfigError(f"the pretrained appearance holds {latent.config.structures} structures, the "
                                    f"study has {field.structures}")
        self.field, self.latent = field, latent
        self.module = latent_scene_module(gpu, field, latent.config)

    @property
    def structures(self) -> int:
        return self.field.structures

    def struct(self) -> dict[str, Any]:
        return {"field": self.field.shader_struct(False, geometry_network_gradients=False),
                "latent": self.latent.shader_struct()}

    def distances(self, grid: Any, buffers: dict) -> None:
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


@dataclass
class PretrainedAppearance:
    """Pretrained weights, read and checked, for ``fit --appearance pretrained``."""

    config: LatentConfig
    parameters: np.ndarray
    digest: str

    @classmethod
    def read(cls, path: str | Path) -> PretrainedAppearance:
        config, parameters, metadata = read_weights(path)
        return cls(config, parameters, str(metadata["sha256"]))

    def encode_study(self, gpu: GpuContext, prepared, field: NeuralField) -> LatentAppearance:
        """The encoder over the study into a latent grid over the field's box: a renderable appearance, with no
        training."""
        if len(prepared.structures) > self.config.structures:
            raise LatentConfigError(f"the pretrained appearance holds {self.config.structures} structures, the "
                                    f"study has {len(prepared.structures)}")
        latent = LatentAppearance(gpu, self.config, study_grid(field), self.parameters)
        latent.encode(latent_inputs(prepared), np.linalg.inv(prepared.affine))
        latent.source_digest = self.digest
        return latent


def appearance_bytes(latent: LatentAppearance, digest: str) -> bytes:
    """A study's latent appearance: the networks' parameters and the fp16 grid, with its sizes and layout."""
    from safetensors.numpy import save

    parameters = np.ascontiguousarray(latent.parameters(), np.float32)
    codes = np.ascontiguousarray(latent.grid_codes().astype(np.float16))
    metadata = {"format": APPEARANCE_FORMAT, "version": APPEARANCE_VERSION, "latent": latent.config.as_dict(),
                "grid": {"origin": list(latent.grid.origin), "dims": list(latent.grid.dims),
                         "cell_mm": latent.grid.cell_mm},
                "pretrained_sha256": digest,
                "sha256": hashlib.sha256(parameters.tobytes() + codes.tobytes()).hexdigest()}
    return save({"parameters": parameters, "grid": codes}, metadata={WEIGHTS_KEY: json.dumps(metadata)})


def load_appearance(gpu: GpuContext, path: str | Path, field: NeuralField) -> LatentAppearance:
    """A run's latent appearance on the device, checked against its digest and the field's box."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = json.loads((handle.metadata() or {})[WEIGHTS_KEY])
            parameters = np.asarray(handle.get_tensor("parameters"), np.float32)
            codes = np.asarray(handle.get_tensor("grid"), np.float16)
        config = LatentConfig.from_dict(metadata["latent"])
        grid = GridLayout(tuple(map(float, metadata["grid"]["origin"])), tuple(map(int, metadata["grid"]["dims"])),
                          float(metadata["grid"]["cell_mm"]))  # type: ignore[arg-type]
    except Exception as error:  # damaged headers, short files and missing keys raise several types
        raise WeightsFileError(f"{path}: not a latent appearance file ({error})") from error
    if metadata.get("format") != APPEARANCE_FORMAT or metadata.get("version") != APPEARANCE_VERSION:
        raise WeightsFileError(f"{path}: not a file of version {APPEARANCE_VERSION} of {APPEARANCE_FORMAT}")
    if hashlib.sha256(parameters.tobytes() + codes.tobytes()).hexdigest() != metadata.get("sha256"):
        raise WeightsFileError(f"{path}: the stored values do not match their digest (altered or damaged)")
    if grid != study_grid(field) or codes.shape != (grid.vertices, config.latent):
        raise WeightsFileError(f"{path}: the latent grid is not over this run's field; fit the run again")
    latent = LatentAppearance(gpu, config, grid, parameters)
    latent.codes.copy_from_numpy(pack_half(codes))
    latent.source_digest = str(metadata.get("pretrained_sha256", ""))
    return latent

