"""Gaussian model files: the Gaussians (safetensors, a tensor per kind) with JSON metadata in the same file.

As the field's files (field/model_io.py): a format name and version, the study's geometry, the scene's
settings (grid, density scale, segment length) and a SHA-256 of the tensor bytes, all checked before
anything is used; a file that is truncated, tampered with, from an unknown version or for another study is
refused with a ModelFileError naming it, never half-loaded.

Version 6 is the first read: each Gaussian's density follows its orientation, its colour coefficients are
linear, and its look record (``looks``: the channels' texture and the specular weight, gaussians/look.py) and the
lights of the specular terms (``highlights``) come with it, with the structure weights (a tensor ``structures`` of
one logit per Gaussian and structure of the study's geometry: the geometry of ``evaluate`` and ``mesh``) and the
share of a Gaussian's thickness with which they read it (``geometry_thickness``). Version 7 adds the structure
weights' slopes across each Gaussian (``structure_slopes``, gaussians/geometry.py); a version 6 file reads with
slopes of zero, the occupancy its weights were trained for. Files of earlier versions would render otherwise than
they were trained: they are refused in one line that says to fit the study again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..field.model_io import METADATA_KEY, ModelFileError, StudyGeometry, _digest, read_checked
from ..files import write_bytes
from .look import LOOK_FLOATS, NO_HIGHLIGHTS, Highlights
from .scene import COLOUR_TERMS, GaussianSet, GridShape, MarchSettings

FORMAT = "neuralraycast-gaussians"
FORMAT_VERSION = 7
#: The earliest version read, and the first with the structure weights' slopes (those before read them as zeros).
FIRST_READ_VERSION = 6
SLOPES_VERSION = 7
#: Versions recognised: those from FIRST_READ_VERSION are read, the earlier ones refused with what to do.
KNOWN_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
#: The tensors and the shape of one Gaussian's part of each.
TENSORS = {"positions": (3,), "log_scales": (3,), "rotations": (4,), "density": (), "colours": (COLOUR_TERMS, 3),
           "looks": (LOOK_FLOATS,)}


@dataclass
class GaussianModel:
    gaussians: GaussianSet
    grid: GridShape
    density_scale: float
    march: MarchSettings
    geometry: StudyGeometry
    extra: dict[str, Any]
    #: (N, 2K) structure weights, K the geometry's structures: the logits, then the slopes (gaussians/geometry.py).
    structures: np.ndarray | None = None
    #: The share of a Gaussian's thickness with which its structure weights read it (scene.GaussianScene).
    geometry_thickness: float = 1.0
    #: The lights of the Gaussians' specular terms.
    highlights: Highlights = NO_HIGHLIGHTS


def encode_gaussians(model: GaussianModel) -> bytes:
    from safetensors.numpy import save

    tensors = {name: np.ascontiguousarray(getattr(model.gaussians, name), np.float32) for name in TENSORS}
    k = len(model.geometry.structures)
    expected = (model.gaussians.count, 2 * k)
    if model.structures is None or np.shape(model.structures) != expected:
        raise ValueError(f"structure weights of shape {np.shape(model.structures)}, expected {expected} (a logit and "
                         "a slope per Gaussian and structure); nothing was written")
    tensors["structures"] = np.ascontiguousarray(model.structures[:, :k], np.float32)
    tensors["structure_slopes"] = np.ascontiguousarray(model.structures[:, k:], np.float32)
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
        "highlights": model.highlights.as_dict(),
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
    if version < FIRST_READ_VERSION:
        raise ModelFileError(f"{path}: Gaussians of format version {version}, written before their colours took "
                             f"their structure's look (version {FIRST_READ_VERSION}): they would not render as "
                             "trained; fit the study again")
    count, grid, density, march, geometry = _settings(path, metadata)
    k = len(geometry.structures)
    shapes = {**TENSORS, "structures": (k,)}
    if version >= SLOPES_VERSION:
        shapes["structure_slopes"] = (k,)
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
    try:
        thickness = float(metadata["geometry_thickness"])
        highlights = Highlights.from_dict(metadata["highlights"])
    except (KeyError, TypeError, ValueError) as error:
        raise ModelFileError(f"{path}: inconsistent metadata ({error})") from error
    if not 0.0 < thickness <= 1.0:
        raise ModelFileError(f"{path}: inconsistent metadata (geometry thickness {thickness})")
    gaussians = GaussianSet(**{name: tensors[name] for name in TENSORS})
    slopes = tensors.get("structure_slopes", np.zeros((count, k), np.float32))
    return GaussianModel(gaussians, grid, density, march, geometry, dict(metadata.get("extra") or {}),
                         np.concatenate([tensors["structures"], slopes], axis=1), thickness, highlights)
