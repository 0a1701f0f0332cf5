"""Model files: the trained parameters (safetensors) with JSON metadata in the same file.

The metadata holds everything needed to rebuild and to trust a field: format version, the precision the
parameters are stored in (float32; float16 for exported copies, half the size), configuration,
the study's geometry (affine, shape, bounds), channel names, structures and their colours, the
parameter layout sizes and a SHA-256 of the tensor bytes. Loading checks all of it before anything is
used; a file that is truncated, tampered with, from an unknown version or for another study is refused
with a ModelFileError, never half-loaded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..files import write_bytes
from ..gpu.device import GpuContext
from .field import FieldConfig, FieldConfigError, FieldLayout, NeuralField

FORMAT = "neuralraycast-field"
# 2 adds "precision" (version 1 files are float32); 3 adds the encoding's "hash" (files of versions 1 and 2
# were trained with the "xor" hash, and are read with it)
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
PRECISIONS = {"float32": np.float32, "float16": np.float16}
METADATA_KEY = "neuralraycast"
GEOMETRY_TOLERANCE_MM = 1e-3


class ModelFileError(ValueError):
    """A model file that cannot be used; the message says which file and why."""


@dataclass
class StudyGeometry:
    """What a field is tied to: the grid it was fitted on and the meaning of its inputs and outputs."""

    affine: np.ndarray  # (4, 4) IJK -> RAS
    shape: tuple[int, int, int]
    bounds: np.ndarray  # (2, 3) RAS mm box of the field
    channel_names: list[str]
    structures: list[str]
    colors: list[tuple[float, float, float]]

    @classmethod
    def from_prepared(cls, prepared) -> StudyGeometry:
        return cls(
            affine=np.asarray(prepared.affine, dtype=np.float64),
            shape=tuple(int(n) for n in prepared.study.shape),  # type: ignore[arg-type]
            bounds=np.asarray(prepared.bounds, dtype=np.float64),
            channel_names=list(prepared.channel_names),
            structures=[s.name for s in prepared.structures],
            colors=[tuple(map(float, s.color)) for s in prepared.structures],  # type: ignore[misc]
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "affine": self.affine.tolist(),
            "shape": list(self.shape),
            "bounds": self.bounds.tolist(),
            "channel_names": self.channel_names,
            "structures": self.structures,
            "colors": [list(c) for c in self.colors],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StudyGeometry:
        geometry = cls(
            affine=np.asarray(data["affine"], dtype=np.float64),
            shape=tuple(int(n) for n in data["shape"]),  # type: ignore[arg-type]
            bounds=np.asarray(data["bounds"], dtype=np.float64),
            channel_names=[str(c) for c in data["channel_names"]],
            structures=[str(s) for s in data["structures"]],
            colors=[tuple(float(v) for v in c) for c in data["colors"]],  # type: ignore[misc]
        )
        if geometry.affine.shape != (4, 4) or len(geometry.shape) != 3 or geometry.bounds.shape != (2, 3):
            raise ValueError("study geometry has the wrong dimensions")
        if len(geometry.colors) != len(geometry.structures):
            raise ValueError("one colour per structure is required")
        return geometry

    def mismatches(self, other: StudyGeometry) -> list[str]:
        """Human-readable differences that make a field unusable for ``other``."""
        problems = []
        if tuple(self.shape) != tuple(other.shape):
            problems.append(f"grid shape {tuple(self.shape)} vs {tuple(other.shape)}")
        if not np.allclose(self.affine, other.affine, atol=GEOMETRY_TOLERANCE_MM):
            problems.append("IJK-to-RAS matrix differs")
        if self.channel_names != other.channel_names:
            problems.append(f"channels {self.channel_names} vs {other.channel_names}")
        if self.structures != other.structures:
            problems.append(f"structures {self.structures} vs {other.structures}")
        return problems

    def check_matches(self, other: StudyGeometry, path: Path) -> None:
        """Refuse (ModelFileError naming ``path``, the model file) a model made for a study other than ``other``."""
        if problems := self.mismatches(other):
            raise ModelFileError(f"{path}: made for a different study: " + "; ".join(problems))


@dataclass
class ModelFile:
    config: FieldConfig
    layout: FieldLayout
    geometry: StudyGeometry
    parameters: np.ndarray  # (count,) float32
    extra: dict[str, Any]
    precision: str = "float32"  # as stored in the file


def _tensors(layout: FieldLayout, parameters: np.ndarray) -> dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(parameters[a:b]) for name, (a, b) in layout.segments().items()}


def _digest(tensors: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(str(tensors[name].dtype).encode())
        digest.update(str(tensors[name].shape).encode())
        digest.update(tensors[name].tobytes())
    return digest.hexdigest()


def save_model(
    path: str | Path,
    layout: FieldLayout,
    parameters: np.ndarray,
    geometry: StudyGeometry,
    extra: dict[str, Any] | None = None,
    precision: str = "float32",
) -> Path:
    """Write the model atomically (a crash or a full disk never leaves a half-written file under ``path``, and
    an earlier file there stays until the new one is complete; files.WriteError names ``path`` otherwise),
    its parameters stored in ``precision`` (PRECISIONS; loading turns them back into float32)."""
    # Serialised here and written by files.py: safetensors' own writer reports a full disk as an error of its
    # own type and leaves files readable by their owner only.
    return write_bytes(path, encode_model(layout, parameters, geometry, extra, precision))


def encode_model(
    layout: FieldLayout,
    parameters: np.ndarray,
    geometry: StudyGeometry,
    extra: dict[str, Any] | None = None,
    precision: str = "float32",
) -> bytes:
    """A model file's bytes (see :func:`save_model`), for writers that write it with other files."""
    from safetensors.numpy import save

    parameters = np.asarray(parameters, dtype=np.float32).reshape(-1)
    if parameters.shape != (layout.count,):
        raise ValueError(f"expected {layout.count} parameters, got {parameters.shape}")
    if len(geometry.structures) != layout.structures or len(geometry.channel_names) + 1 != layout.appearance_inputs:
        raise ValueError("the study geometry does not match the layout's structures or channels")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, not '{precision}'")
    with np.errstate(over="ignore"):
        stored = parameters.astype(PRECISIONS[precision])
    if not np.all(np.isfinite(stored)):
        raise ValueError(f"some parameters are outside the range of {precision} (largest magnitude "
                         f"{float(np.abs(parameters).max()):.3g}); keep this model in float32")
    tensors = _tensors(layout, stored)
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "precision": precision,
        "config": layout.config.as_dict(),
        "geometry": geometry.as_dict(),
        "parameter_count": layout.count,
        "tensors_sha256": _digest(tensors),
        "extra": extra or {},
    }
    return save(tensors, metadata={METADATA_KEY: json.dumps(metadata)})


def _read(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as handle:
            raw = (handle.metadata() or {}).get(METADATA_KEY)
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such model file") from None
    except Exception as error:  # safetensors raises several types for damaged headers and short files
        raise ModelFileError(f"{path}: not a readable model file (truncated or damaged: {error})") from error
    if raw is None:
        raise ModelFileError(f"{path}: no NeuralRaycast metadata (not a NeuralRaycast model file)")
    try:
        metadata = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ModelFileError(f"{path}: metadata is not valid JSON ({error})") from error
    if not isinstance(metadata, dict):
        raise ModelFileError(f"{path}: metadata is not a JSON object")
    return tensors, metadata


def read_checked(path: Path, file_format: str, readable_versions: tuple[int, ...] | list[int]
                 ) -> tuple[dict[str, np.ndarray], dict[str, Any], int]:
    """A safetensors model file's tensors, metadata and format version, refused (ModelFileError naming the
    file) where it is not of ``file_format`` or of a version this build reads."""
    tensors, metadata = _read(path)
    if metadata.get("format") != file_format:
        raise ModelFileError(f"{path}: format '{metadata.get('format')}' is not '{file_format}'")
    version = metadata.get("format_version")
    if version not in readable_versions:
        raise ModelFileError(f"{path}: format version {version} is not supported (this build reads "
                             f"{', '.join(map(str, readable_versions))})")
    return tensors, metadata, version


def _current_config(config: dict[str, Any], version: int) -> dict[str, Any]:
    """A stored configuration in this version's terms (the keys earlier versions had no need for)."""
    if version < 3 and isinstance(config, dict) and isinstance(config.get("encoding"), dict):
        return {**config, "encoding": {**config["encoding"], "hash": "xor"}}
    return config


def load_model(path: str | Path, expected: StudyGeometry | None = None) -> ModelFile:
    """Read and check a model file; with ``expected``, also refuse a field made for another study grid."""
    path = Path(path)
    tensors, metadata, version = read_checked(path, FORMAT, READABLE_VERSIONS)
    precision = metadata.get("precision", "float32") if version >= 2 else "float32"
    if precision not in PRECISIONS:
        raise ModelFileError(f"{path}: unknown parameter precision '{precision}'")
    dtype = np.dtype(PRECISIONS[precision])
    try:
        config = FieldConfig.from_dict(_current_config(metadata["config"], version))
        geometry = StudyGeometry.from_dict(metadata["geometry"])
        layout = FieldLayout.build(config, geometry.bounds, len(geometry.structures), len(geometry.channel_names))
        digest, count = str(metadata["tensors_sha256"]), int(metadata["parameter_count"])
    except (KeyError, TypeError, ValueError, FieldConfigError) as error:
        raise ModelFileError(f"{path}: inconsistent metadata ({error})") from error
    if count != layout.count:
        raise ModelFileError(f"{path}: {count} parameters stored, the configuration needs {layout.count}")
    segments = layout.segments()
    if set(tensors) != set(segments):
        raise ModelFileError(f"{path}: tensors {sorted(tensors)} differ from the expected {sorted(segments)}")
    for name, (a, b) in segments.items():
        if tensors[name].dtype != dtype or tensors[name].shape != (b - a,):
            raise ModelFileError(
                f"{path}: tensor '{name}' is {tensors[name].dtype}{tensors[name].shape}, expected {precision}({b - a},)"
            )
    if _digest(tensors) != digest:
        raise ModelFileError(f"{path}: the parameters do not match their checksum (file modified or damaged)")
    parameters = np.concatenate([tensors[name] for name in segments]).astype(np.float32)
    if not np.all(np.isfinite(parameters)):
        raise ModelFileError(f"{path}: parameters contain NaN or infinity")
    if expected is not None:
        geometry.check_matches(expected, path)
    return ModelFile(config, layout, geometry, parameters, dict(metadata.get("extra") or {}), precision)


def save_field(path: str | Path, field: NeuralField, prepared, extra: dict[str, Any] | None = None) -> Path:
    """Save a field fitted to ``prepared`` (a PreparedStudy)."""
    return save_model(path, field.layout, field.parameters(), StudyGeometry.from_prepared(prepared), extra)


def load_field(gpu: GpuContext, path: str | Path, prepared=None) -> NeuralField:
    """Load a field onto the device; with ``prepared``, refuse one made for another study."""
    expected = StudyGeometry.from_prepared(prepared) if prepared is not None else None
    model = load_model(path, expected)
    return NeuralField(gpu, model.layout, model.parameters)
