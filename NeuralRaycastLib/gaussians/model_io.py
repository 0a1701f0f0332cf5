"""Gaussian model files: the Gaussians (safetensors, a tensor per kind) with JSON metadata in the same file.

As the field's files (field/model_io.py): a format name and version, the study's geometry, the scene's
settings (grid, density scale, segment length) and a SHA-256 of the tensor bytes, all checked before
anything is used; a file that is truncated, tampered with, from an unknown version or for another study is
refused with a ModelFileError naming it, never half-loaded.

Version 2 added the Gaussians' structure weights (a tensor ``structures`` of one logit per Gaussian and
structure of the study's geometry): the geometry of ``evaluate`` and ``mesh``. Version 3: a Gaussian's density
along a ray follows its orientation (shaders/gaussians.slang's angle factor), so the same parameters render
otherwise; files of earlier versions are refused in one line that says to fit the study again. Version 4: a
Gaussian's colour has two more coefficients per channel (the facing and the side of the ray against its plane);
a version-3 file is read with those at zero, which renders it as before. Version 5: the share of a Gaussian's
thickness with which its structure weights read it (``geometry_thickness``); earlier files are read with 1, the
whole thickness they were trained with. Version 6: each Gaussian's texture record (``textures``: how the study's
channels texture its colour, gaussians/texture.py); earlier files are read with none, as they were trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..field.model_io import METADATA_KEY, ModelFileError, StudyGeometry, _digest, read_checked
from ..files import write_bytes
from .scene import COLOUR_TERMS, GaussianSet, GridShape, MarchSettings
from .texture import TEXTURE_FLOATS

FORMAT = "neuralraycast-gaussians"
FORMAT_VERSION = 6
#: The first version read (the earlier ones render otherwise than they were trained).
OLDEST_READ = 3
#: Versions recognised: the current one is read, the earlier ones refused with what to do.
KNOWN_VERSIONS = (1, 2, 3, 4, 5, 6)
#: The tensors and the shape of one Gaussian's part of each.
TENSORS = {"positions": (3,), "log_scales": (3,), "rotations": (4,), "density": (), "colours": (COLOUR_TERMS, 3),
           "textures": (TEXTURE_FLOATS,)}
#: The tensors a file of an earlier version lacks, by the version that added them.
ADDED_IN = {"textures": 6}
#: The colour coefficients of a version-3 file: the spherical harmonics alone.
VERSION_3_COLOUR_TERMS = 4


@dataclass
class GaussianModel:
    gaussians: GaussianSet
    grid: GridShape
    density_scale: float
    march: MarchSettings
    geometry: StudyGeometry
    extra: dict[str, Any]
    #: (N, K) structure logits, K the geometry's structures.
    structures: np.ndarray | None = None
    #: The share of a Gaussian's thickness with which its structure weights read it (scene.GaussianScene).
    geometry_thickness: float = 1.0


def encode_gaussians(model: GaussianModel) -> bytes:
    from safetensors.numpy import save

    tensors = {name: np.ascontiguousarray(getattr(model.gaussians, name), np.float32) for name in TENSORS}
    expected = (model.gaussians.count, len(model.geometry.structures))
    if model.structures is None or np.shape(model.structures) != expected:
        raise ValueError(f"structure weights of shape {np.shape(model.structures)}, expected {expected} (a logit per "
                         "Gaussian and structure); nothing was written")
    tensors["structures"] = np.ascontiguousarray(model.structures, np.float32)
    if not all(np.isfinite(t).all() for t in tensors.values()):
        raise ValueError("the Gaussians hold NaN or infinity; nothing was written")
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "count": model.gaussians.count,
        "grid": {"low": list(model.grid.low), "high": list(model.grid.high), "dims": list(model.grid.dims)},
        "density_scale": model.density_scale,
        "step_mm": model.march.step_mm,
        "min_transmittance": model.march.min_transmittance,
        "geometry_thickness": model.geometry_thickness,
        "geometry": model.geometry.as_dict(),
        "tensors_sha256": _digest(tensors),
        "extra": model.extra,
    }
    return save(tensors, metadata={METADATA_KEY: json.dumps(metadata)})


def save_gaussians(path: str | Path, model: GaussianModel) -> Path:
    """Write the model atomically (files.write_bytes: never half-written under ``path``)."""
    return write_bytes(path, encode_gaussians(model))


def _settings(path: Path, metadata: dict[str, Any]) -> tuple[int, GridShape, float, MarchSettings, StudyGeometry]:
    try:
        count = int(metadata["count"])
        grid = metadata["grid"]
        shape = GridShape(tuple(map(float, grid["low"])), tuple(map(float, grid["high"])),
                          tuple(int(d) for d in grid["dims"]))
        density, step = float(metadata["density_scale"]), float(metadata["step_mm"])
        march = MarchSettings(step, float(metadata["min_transmittance"]))
        geometry = StudyGeometry.from_dict(metadata["geometry"])
        str(metadata["tensors_sha256"])
    except (KeyError, TypeError, ValueError) as error:
        raise ModelFileError(f"{path}: inconsistent metadata ({error})") from error
    if count < 1 or len(shape.dims) != 3 or min(shape.dims) < 1 or not (density > 0 and step > 0) \
            or not (np.asarray(shape.high) > np.asarray(shape.low)).all():
        raise ModelFileError(f"{path}: inconsistent metadata (count {count}, grid {shape}, density scale {density}, "
                             f"step {step} mm)")
    return count, shape, density, march, geometry


def load_gaussians(path: str | Path, expected: StudyGeometry | None = None) -> GaussianModel:
    """Read and check a Gaussian model file; with ``expected``, also refuse one made for another study grid."""
    path = Path(path)
    tensors, metadata, version = read_checked(path, FORMAT, KNOWN_VERSIONS)
    if version < OLDEST_READ:
        raise ModelFileError(f"{path}: Gaussians of format version {version}, written before their density followed "
                             f"their orientation (version {OLDEST_READ}): they would not render as trained; fit "
                             "the study again")
    count, grid, density, march, geometry = _settings(path, metadata)
    shapes = {name: shape for name, shape in TENSORS.items() if version >= ADDED_IN.get(name, 0)}
    shapes["structures"] = (len(geometry.structures),)
    if version == 3:
        shapes["colours"] = (VERSION_3_COLOUR_TERMS, 3)
    if set(tensors) != set(shapes):
        raise ModelFileError(f"{path}: tensors {sorted(tensors)} differ from the expected {sorted(shapes)}")
    for name, shape in shapes.items():
        if tensors[name].dtype != np.float32 or tensors[name].shape != (count, *shape):
            raise ModelFileError(f"{path}: tensor '{name}' is {tensors[name].dtype}{tensors[name].shape}, expected "
                                 f"float32{(count, *shape)}")
    if _digest(tensors) != metadata["tensors_sha256"]:
        raise ModelFileError(f"{path}: the Gaussians do not match their checksum (file modified or damaged)")
    if not all(np.isfinite(t).all() for t in tensors.values()):
        raise ModelFileError(f"{path}: the Gaussians contain NaN or infinity")
    if expected is not None:
        geometry.check_matches(expected, path)
    parts = {name: tensors[name] for name in TENSORS if name in tensors}  # (no textures before version 6)
    if version == 3:  # the facing and side coefficients at zero: the colours of version 3
        parts["colours"] = np.concatenate(
            [parts["colours"], np.zeros((count, COLOUR_TERMS - VERSION_3_COLOUR_TERMS, 3), np.float32)], axis=1)
    gaussians = GaussianSet(**parts)
    structures = tensors.get("structures")
    thickness = 1.0  # before version 5 the structure weights read the whole thickness
    if version >= 5:
        try:
            thickness = float(metadata["geometry_thickness"])
        except (KeyError, TypeError, ValueError) as error:
            raise ModelFileError(f"{path}: inconsistent metadata ({error})") from error
        if not 0.0 < thickness <= 1.0:
            raise ModelFileError(f"{path}: inconsistent metadata (geometry thickness {thickness})")
    return GaussianModel(gaussians, grid, density, march, geometry, dict(metadata.get("extra") or {}),
                         structures, thickness)
