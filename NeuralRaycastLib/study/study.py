"""A study: co-registered MRI channels, an optional label map, tumour probability and brain mask, one grid.

Conventions (also in the README):
- Arrays are indexed ``[i, j, k]`` (nibabel order). Slicer's ``arrayFromVolume`` gives ``[k, j, i]``:
  pass ``axis_order="kji"`` to :meth:`Study.from_arrays` and it is transposed once, here.
- ``affine`` maps voxel indices ``(i, j, k, 1)`` to RAS millimetres (Slicer's IJKToRAS, NIfTI's affine
  converted to RAS by nibabel). Voxel centres sit at integer indices.
- Labels are non-negative integers; 0 is background.
- The brain mask (from skull stripping, say) is optional: without one, preprocessing finds the brain
  by thresholding the images.

Loaders: a BraTS-named folder, a folder with ``manifest.json``, or numpy arrays. Everything is checked
before a :class:`Study` is returned; each problem raises :class:`StudyError` naming the file and the fault.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..grid import grid_corners_bounds, off_grid_mm, voxel_box_slices
from .structures import BRATS_STRUCTURES

#: BraTS channel suffixes (both the classic and the 2023 names) -> channel name used here.
BRATS_CHANNELS = {
    "t1": "t1", "t1n": "t1",
    "t1ce": "t1ce", "t1c": "t1ce",
    "t2": "t2", "t2w": "t2",
    "flair": "flair", "t2f": "flair",
}
BRATS_LABELS = ("seg",)
BRATS_BRAIN_MASK = ("brainmask",)
NIFTI_SUFFIXES = (".nii.gz", ".nii")
MANIFEST = "manifest.json"
MANIFEST_KEYS = {"name", "description", "channels", "labels", "probability", "brain_mask", "structures",
                 "exact_surfaces"}
#: Studies whose structures' exact surfaces are known (manifest key ``exact_surfaces``): the analytic phantom.
EXACT_SURFACES = ("phantom",)
#: The most voxels one volume may hold (512³, a 0.5 mm grid over a whole head): a header claiming more is
#: refused before any voxel is read, since reading allocates what the header claims.
MAX_VOLUME_VOXELS = 512**3
MAX_VOLUME_SIDE = round(MAX_VOLUME_VOXELS ** (1 / 3))

#: Two grids are the same when every corner of the volume lands within this fraction of a voxel.


T = TypeVar("T")
R = TypeVar("R")


class StudyError(ValueError):
    """A study cannot be used; the message names the file (or array) and the problem."""


@dataclass
class Study:
    """Co-registered volumes on one grid; see the module docstring for conventions."""

    name: str
    channels: dict[str, np.ndarray]
    affine: np.ndarray
    labels: np.ndarray | None = None
    probability: np.ndarray | None = None
    brain_mask: np.ndarray | None = None  # bool; None: found by thresholding the images
    structures: dict[str, tuple[int, ...]] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    colors: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # RGB in [0, 1]; else defaults
    exact_surfaces: str | None = None  # one of EXACT_SURFACES: the surfaces the labels were drawn from are known

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(next(iter(self.channels.values())).shape)  # type: ignore[return-value]

    @property
    def spacing(self) -> np.ndarray:
        """Voxel size in millimetres along i, j, k."""
        return np.linalg.norm(self.affine[:3, :3], axis=0)

    @property
    def channel_names(self) -> list[str]:
        return list(self.channels)

    def bounds(self) -> np.ndarray:
        """RAS box ``[[min x, y, z], [max x, y, z]]`` covering every voxel centre."""
        return grid_corners_bounds(self.affine, self.shape)

    @classmethod
    def from_arrays(
        cls,
        channels: dict[str, np.ndarray],
        affine: np.ndarray,
        labels: np.ndarray | None = None,
        probability: np.ndarray | None = None,
        structures: dict[str, list[int]] | None = None,
        name: str = "study",
        axis_order: str = "ijk",
        colors: dict[str, tuple[float, float, float]] | None = None,
        brain_mask: np.ndarray | None = None,
    ) -> Study:
        """Build a checked study from arrays (the Slicer path). ``axis_order='kji'`` for Slicer arrays;
        ``colors``: RGB in [0, 1] per structure name (e.g. the segments' colours), defaults otherwise."""
        if axis_order not in ("ijk", "kji"):
            raise StudyError(f"axis_order must be 'ijk' or 'kji', not '{axis_order}'")

        def reorder(array: np.ndarray | None) -> np.ndarray | None:
            if array is None:
                return None
            array = np.asarray(array)
            return array.transpose(2, 1, 0) if axis_order == "kji" and array.ndim == 3 else array

        sources = {f"channel {n}": f"array '{n}'" for n in channels}
        sources.update({"labels": "label array", "probability": "probability array", "brain mask": "brain mask array"})
        study = cls(
            name=name,
            channels={n: reorder(a) for n, a in channels.items()},
            affine=np.asarray(affine, dtype=np.float64),
            labels=reorder(labels),
            probability=reorder(probability),
            brain_mask=reorder(brain_mask),
            structures=_parse_structures(structures, "structures argument"),
            sources=sources,
            colors={n: tuple(float(v) for v in c) for n, c in (colors or {}).items()},
        )
        return validate(study)


# ---------------------------------------------------------------------------------------------------------
# validation


def _squeeze_to_3d(array: np.ndarray, source: str) -> np.ndarray:
    if array.ndim > 3 and all(s == 1 for s in array.shape[3:]):
        array = array.reshape(array.shape[:3])
    if array.ndim != 3:
        raise StudyError(f"{source}: expected a 3-D volume, got shape {tuple(array.shape)}")
    if min(array.shape) < 2:
        raise StudyError(f"{source}: volume is too thin to hold a surface (shape {tuple(array.shape)})")
    return array


def _check_finite(array: np.ndarray, source: str) -> None:
    bad = int(np.count_nonzero(~np.isfinite(array)))
    if bad:
        raise StudyError(f"{source}: contains {bad} NaN or infinite voxel(s)")


def validate(study: Study) -> Study:
    """Check a study in place (shapes, grid, values, structures) and return it; raise StudyError."""
    if not study.channels:
        raise StudyError(f"{study.name}: no image channels given (need at least one, e.g. t1)")
    affine = np.asarray(study.affine, dtype=np.float64)
    if affine.shape != (4, 4) or not np.all(np.isfinite(affine)) or abs(np.linalg.det(affine[:3, :3])) < 1e-9:
        raise StudyError(f"{study.name}: affine must be a finite, invertible 4x4 IJK->RAS matrix")
    study.affine = affine

    reference_name = next(iter(study.channels))
    shape: tuple[int, ...] | None = None
    for name, array in list(study.channels.items()):
        source = study.sources.get(f"channel {name}", name)
        array = _squeeze_to_3d(np.asarray(array), source)
        if not np.issubdtype(array.dtype, np.number) or np.iscomplexobj(array):
            raise StudyError(f"{source}: voxel type {array.dtype} is not a real number type")
        if shape is None:
            shape = array.shape
        elif array.shape != shape:
            raise StudyError(f"{source}: shape {array.shape} differs from channel '{reference_name}' {shape}")
        array = array.astype(np.float32, copy=False)
        _check_finite(array, source)
        if float(array.max()) == float(array.min()):
            raise StudyError(f"{source}: image is constant ({float(array.min())}); nothing to learn from")
        study.channels[name] = array
    assert shape is not None

    def on_grid(array: np.ndarray, role: str) -> tuple[np.ndarray, str]:
        """A volume that must share the channels' grid, as 3-D, with the name to report it by."""
        source = study.sources.get(role, role)
        array = _squeeze_to_3d(np.asarray(array), source)
        if array.shape != shape:
            raise StudyError(f"{source}: shape {array.shape} differs from channel '{reference_name}' {shape}")
        return array, source

    if study.labels is not None:
        labels, source = on_grid(study.labels, "labels")
        if not np.issubdtype(labels.dtype, np.integer):
            _check_finite(labels, source)
            if not np.all(labels == np.round(labels)):
                raise StudyError(f"{source}: label map holds non-integer values (is it a probability map?)")
        if labels.min() < 0:
            raise StudyError(f"{source}: label map holds negative values (min {labels.min()})")
        if labels.max() > 32767:
            raise StudyError(f"{source}: label values above 32767 are not supported (max {labels.max()})")
        study.labels = labels.astype(np.int16)

    if study.probability is not None:
        probability, source = on_grid(study.probability, "probability")
        probability = probability.astype(np.float32)
        _check_finite(probability, source)
        low, high = float(probability.min()), float(probability.max())
        if low < -1e-3 or high > 1 + 1e-3:
            raise StudyError(f"{source}: probabilities must lie in [0, 1], found [{low:g}, {high:g}]")
        study.probability = np.clip(probability, 0.0, 1.0)

    if study.brain_mask is not None:
        mask, source = on_grid(study.brain_mask, "brain mask")
        if not np.issubdtype(mask.dtype, np.bool_):
            _check_finite(mask, source)
            if not np.all((mask == 0) | (mask == 1)):
                raise StudyError(f"{source}: a brain mask holds only 0 and 1 (is it a label map or an image?)")
        mask = mask.astype(bool)
        if not mask.any() or mask.all():
            raise StudyError(f"{source}: the brain mask is empty or fills the whole volume")
        study.brain_mask = mask

    study.structures = _resolve_structures(study)
    return study


def _parse_structures(raw: Any, source: str) -> dict[str, tuple[int, ...]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not raw:
        raise StudyError(f"{source}: 'structures' must be a non-empty mapping of name -> list of label values")
    parsed: dict[str, tuple[int, ...]] = {}
    for name, values in raw.items():
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_\-]*", str(name)):
            raise StudyError(f"{source}: structure name '{name}' must start with a letter (letters, digits, _ -)")
        values = [values] if isinstance(values, int) else values
        if not isinstance(values, list | tuple) or not values or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values
        ):
            raise StudyError(f"{source}: structure '{name}' needs a list of positive integer label values")
        parsed[str(name)] = tuple(sorted(set(values)))
    return parsed


def _resolve_structures(study: Study) -> dict[str, tuple[int, ...]]:
    """Explicit structures must all be present; BraTS defaults keep the regions that exist."""
    if study.labels is None:
        if study.structures:
            raise StudyError(f"{study.name}: structures are declared but no label map is given")
        return {}
    source = study.sources.get("labels", "labels")
    present = set(np.unique(study.labels).tolist()) - {0}
    if not present:
        raise StudyError(f"{source}: label map is empty (every voxel is 0)")
    if study.structures:
        for name, values in study.structures.items():
            if not present.intersection(values):
                raise StudyError(
                    f"{source}: structure '{name}' (labels {list(values)}) has no voxels; labels present: "
                    f"{sorted(present)}"
                )
        return dict(study.structures)
    defaults = {n: v for n, v in BRATS_STRUCTURES.items() if present.intersection(v)}
    if not defaults:
        raise StudyError(
            f"{source}: labels {sorted(present)} match none of the BraTS regions (1, 2, 3 or 4); "
            "name the structures in manifest.json"
        )
    return defaults


# ---------------------------------------------------------------------------------------------------------
# files


def _reason(error: BaseException) -> str:
    """An exception's text on one line, or its type's name where it has none (a MemoryError, say)."""
    return " ".join(str(error).split()) or type(error).__name__


def _read_nifti(path: Path, role: str):
    import nibabel as nib

    if not path.is_file():
        raise StudyError(f"{path}: {role} file not found")
    try:
        image = nib.load(str(path))  # reads the header only; the voxels are read in _image_data
    except Exception as error:  # nibabel raises many types for corrupt files
        raise StudyError(f"{path}: {role} is not a readable NIfTI file ({_reason(error)})") from error
    _check_header(image, path, role)
    return image


def _check_header(image, path: Path, role: str) -> None:
    """Refuse what the header claims before anything is allocated for it: more than 3 dimensions, more
    voxels than :data:`MAX_VOLUME_VOXELS`, or (uncompressed ``.nii``) more bytes than the file holds."""
    shape = tuple(int(n) for n in image.shape)
    if len(shape) < 3 or any(n != 1 for n in shape[3:]):
        raise StudyError(f"{path}: expected a 3-D volume, got shape {shape}")
    voxels = math.prod(shape)
    if voxels > MAX_VOLUME_VOXELS:
        raise StudyError(
            f"{path}: {role} header claims shape {shape} ({voxels:,} voxels), more than the {MAX_VOLUME_VOXELS:,} "
            f"({MAX_VOLUME_SIDE}³) a volume may have; resample it to a coarser grid (or the file is damaged)"
        )
    proxy = image.dataobj  # where the voxels start and their type on disk, as the header says
    if path.name.endswith(".nii") and hasattr(proxy, "offset") and hasattr(proxy, "dtype"):
        needed = int(proxy.offset) + voxels * np.dtype(proxy.dtype).itemsize
        size = path.stat().st_size
        if size < needed:
            raise StudyError(
                f"{path}: {role} is truncated: its header (shape {shape}, {np.dtype(proxy.dtype)}) needs "
                f"{needed:,} bytes but the file holds {size:,}; copy or export it again"
            )


def map_in_threads(function: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[function(item) for item in items]``, the items in threads at once (for numpy and zlib work, which
    release the GIL); the first exception, in item order, is raised."""
    if len(items) <= 1:
        return [function(item) for item in items]
    with ThreadPoolExecutor(min(len(items), os.cpu_count() or 1)) as pool:
        return list(pool.map(function, items))


def _image_data(image, role: str, path: Path) -> np.ndarray:
    try:
        return np.asanyarray(image.dataobj)
    except Exception as error:  # truncated gzip (EOFError), corrupt stream (zlib.error), short data (OSError) ...
        raise StudyError(f"{path}: {role} data cannot be read ({_reason(error)}); the file may be damaged or "
                         "truncated") from error


def _load_files(
    name: str,
    channel_files: dict[str, Path],
    label_file: Path | None,
    probability_file: Path | None,
    structures: dict[str, tuple[int, ...]],
    brain_mask_file: Path | None = None,
) -> Study:
    """Read NIfTI files onto the first channel's grid (axis flips are undone, anything else is refused)."""
    import nibabel as nib

    roles = [(f"channel {n}", p) for n, p in channel_files.items()]
    roles += [("labels", label_file)] if label_file else []
    roles += [("probability", probability_file)] if probability_file else []
    roles += [("brain mask", brain_mask_file)] if brain_mask_file else []

    reference = None
    images = []
    for role, path in roles:
        image = _read_nifti(path, role)
        if reference is None:
            reference = image
        else:
            target = nib.orientations.io_orientation(reference.affine)
            current = nib.orientations.io_orientation(image.affine)
            if not np.array_equal(target, current):
                image = image.as_reoriented(nib.orientations.ornt_transform(current, target))
            ref_shape = tuple(reference.shape[:3])
            if tuple(image.shape[:3]) != ref_shape:
                raise StudyError(
                    f"{path}: grid {tuple(image.shape[:3])} differs from {channel_files[next(iter(channel_files))]} "
                    f"{ref_shape}; resample it onto the first channel's grid"
                )
            if (offset := off_grid_mm(image.affine, reference.affine, ref_shape)) is not None:
                raise StudyError(
                    f"{path}: not on the same grid as the first channel (corners differ by up to {offset:.2f} mm); "
                    "co-register and resample it first"
                )
        images.append(image)
    # The headers are checked; now the voxels, file by file in threads (decompressing releases the GIL).
    data = map_in_threads(lambda item: _image_data(item[0], *item[1]), list(zip(images, roles, strict=True)))
    arrays = {role: array for (role, _), array in zip(roles, data, strict=True)}

    assert reference is not None
    study = Study(
        name=name,
        channels={n: arrays[f"channel {n}"] for n in channel_files},
        affine=np.asarray(reference.affine, dtype=np.float64),
        labels=arrays.get("labels"),
        probability=arrays.get("probability"),
        brain_mask=arrays.get("brain mask"),
        structures=structures,
        sources={role: str(path) for role, path in roles},
    )
    return validate(study)


def _nifti_stem(path: Path) -> str:
    for suffix in NIFTI_SUFFIXES:
        if path.name.endswith(suffix):
            return path.name[: -len(suffix)]
    return path.name


def load_brats_folder(folder: Path) -> Study:
    """A folder of ``<case>_t1.nii.gz, _t1ce, _t2, _flair, _seg`` (or BraTS 2023 ``-t1n, -t1c, -t2w, -t2f, -seg``),
    with an optional ``_brainmask``."""
    folder = Path(folder)
    found: dict[str, list[Path]] = {}
    case_names = set()
    for path in sorted(folder.iterdir()):
        if not path.name.endswith(NIFTI_SUFFIXES):
            continue
        match = re.fullmatch(r"(.*?)[_\-]([A-Za-z0-9]+)", _nifti_stem(path))
        if not match:
            continue
        key = match.group(2).lower()
        role = BRATS_CHANNELS.get(key) or ("labels" if key in BRATS_LABELS else None)
        role = role or ("brain mask" if key in BRATS_BRAIN_MASK else None)
        if role:
            found.setdefault(role, []).append(path)
            case_names.add(match.group(1))
    for role, paths in found.items():
        if len(paths) > 1:
            raise StudyError(f"{folder}: several files for {role}: {', '.join(p.name for p in paths)}")
    channels = {name: found[name][0] for name in ("t1", "t1ce", "t2", "flair") if name in found}
    if not channels:
        raise StudyError(
            f"{folder}: no MRI channels found; expected files named <case>_t1.nii.gz, _t1ce, _t2, _flair "
            f"(and _seg for labels), or a {MANIFEST}"
        )
    name = case_names.pop() if len(case_names) == 1 else folder.name
    labels = found.get("labels", [None])[0]
    return _load_files(name, channels, labels, None, {}, found.get("brain mask", [None])[0])


def load_manifest(path: Path) -> Study:
    """``manifest.json``: ``{"channels": {name: file}, "labels"?, "probability"?, "brain_mask"?, "structures"?,
    "name"?}``."""
    path = Path(path)
    if not path.is_file():
        raise StudyError(f"{path}: manifest not found")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise StudyError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(manifest, dict):
        raise StudyError(f"{path}: must hold a JSON object")
    unknown = set(manifest) - MANIFEST_KEYS
    if unknown:
        raise StudyError(f"{path}: unknown key(s) {sorted(unknown)}; allowed: {sorted(MANIFEST_KEYS)}")
    channels = manifest.get("channels")
    if not isinstance(channels, dict) or not channels or not all(isinstance(v, str) for v in channels.values()):
        raise StudyError(f"{path}: 'channels' must map channel names to file names, e.g. {{\"t1\": \"t1.nii.gz\"}}")
    for key in ("labels", "probability", "brain_mask", "name", "description"):
        if key in manifest and not isinstance(manifest[key], str):
            raise StudyError(f"{path}: '{key}' must be a string")
    exact = manifest.get("exact_surfaces")
    if exact is not None and exact not in EXACT_SURFACES:
        raise StudyError(f"{path}: 'exact_surfaces' must be one of {list(EXACT_SURFACES)} (got {exact!r})")
    base = path.parent
    study = _load_files(
        manifest.get("name", base.name),
        {str(n): base / f for n, f in channels.items()},
        base / manifest["labels"] if "labels" in manifest else None,
        base / manifest["probability"] if "probability" in manifest else None,
        _parse_structures(manifest.get("structures"), str(path)),
        base / manifest["brain_mask"] if "brain_mask" in manifest else None,
    )
    study.exact_surfaces = exact
    return study


def load_study(path: str | Path) -> Study:
    """Load a study from a ``manifest.json`` (or a folder holding one) or a BraTS-named folder."""
    path = Path(path).expanduser()
    if not path.exists():
        raise StudyError(f"{path}: no such file or folder")
    if path.is_file():
        if path.name.endswith(".json"):
            return load_manifest(path)
        raise StudyError(f"{path}: give a study folder or its {MANIFEST}, not a single image")
    if (path / MANIFEST).is_file():
        return load_manifest(path / MANIFEST)
    return load_brats_folder(path)


def write_study(study: Study, folder: str | Path) -> Path:
    """Write ``study`` as NIfTI files and a ``manifest.json`` that :func:`load_study` reads back (the same
    arrays, grid and structures), for a study held in memory that another process must read (the
    warm-up's workers, for a study from Slicer's scene). Returns the manifest's path."""
    import nibabel as nib

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    def save(array: np.ndarray, name: str, dtype: type) -> str:
        nib.save(nib.Nifti1Image(np.asarray(array).astype(dtype), study.affine), str(folder / name))
        return name

    manifest: dict[str, Any] = {
        "name": study.name,
        "channels": {name: save(array, f"channel{index}.nii", np.float32)
                     for index, (name, array) in enumerate(study.channels.items())},
    }
    if study.labels is not None:
        manifest["labels"] = save(study.labels, "labels.nii", np.int32)
    if study.probability is not None:
        manifest["probability"] = save(study.probability, "probability.nii", np.float32)
    if study.brain_mask is not None:
        manifest["brain_mask"] = save(study.brain_mask, "brain_mask.nii", np.uint8)
    if study.structures:
        manifest["structures"] = {name: list(values) for name, values in study.structures.items()}
    if study.exact_surfaces:
        manifest["exact_surfaces"] = study.exact_surfaces
    path = folder / MANIFEST
    path.write_text(json.dumps(manifest, indent=1))
    return path


def _needed_factors(shape: Sequence[int], max_voxels: int) -> tuple[int, ...]:
    """The smallest whole factor per axis that leaves it at most ``max_voxels`` long."""
    return tuple(max(1, math.ceil(int(n) / max_voxels)) for n in shape)


def downsample_factors(shape: Sequence[int], spacing: Sequence[float], max_voxels: int) -> tuple[int, ...]:
    """Whole factors per axis, so that no axis has more than ``max_voxels`` voxels and the new voxels are as
    close to cubes as that allows: each axis is coarsened towards the largest voxel size the limit forces
    on any axis, never further, so an axis of thick slices is coarsened only if it alone is too long."""
    needed = _needed_factors(shape, max_voxels)
    forced = [f * float(s) for f, s in zip(needed, spacing, strict=True) if f > 1]
    if not forced:
        return tuple(needed)
    target = max(forced)  # mm
    return tuple(
        max(f, min(int(np.floor(target / float(s) * (1 + 1e-6))), max(1, int(n) // 2)))
        for f, s, n in zip(needed, spacing, shape, strict=True)
    )


def downsample_study(study: Study, max_voxels: int) -> Study:
    """The study on a grid coarser by whole factors per axis (:func:`downsample_factors`), so no axis has
    more than ``max_voxels`` voxels: images and P(x) averaged over blocks, labels and the brain mask taken at
    the block's centre voxel (unchanged if small). Where the near-cubic grid would lose a structure, the grid
    the limit needs alone is tried; a structure (or brain mask) lost on both raises :class:`StudyError`
    naming it and its size."""
    needed = _needed_factors(study.shape, max_voxels)
    chosen = downsample_factors(study.shape, study.spacing, max_voxels)
    if max(chosen) <= 1:
        return study
    lost = _lost_structure(study, chosen)
    if lost is not None and chosen != needed:
        chosen = needed
        lost = _lost_structure(study, chosen)
    if lost is not None:
        raise StudyError(_lost_message(study, chosen, max_voxels, *lost))
    return _downsampled(study, chosen)


def _downsampled_shape(study: Study, factors: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(n // f for n, f in zip(study.shape, factors, strict=True))
    if min(shape) < 2:
        raise StudyError(f"{study.name}: downsampling {study.shape} by {tuple(factors)} leaves {shape}, too thin to "
                         "hold a surface; use a larger voxel limit")
    return shape


def _centres(array: np.ndarray, factors: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """The voxel at each block's centre."""
    picked = array[tuple(slice(f // 2, f // 2 + n * f, f) for f, n in zip(factors, shape, strict=True))]
    return np.ascontiguousarray(picked)


def _lost_structure(study: Study, factors: Sequence[int]) -> tuple[str, np.ndarray, np.ndarray] | None:
    """The first structure (or the brain mask) that has no voxel, or no voxel outside it, once the study is
    downsampled by ``factors``: (its name, its mask at full resolution and downsampled); None where all
    keep a surface."""
    shape = _downsampled_shape(study, factors)
    masks: list[tuple[str, np.ndarray, np.ndarray]] = []
    if study.brain_mask is not None:
        masks.append(("brain mask", study.brain_mask, _centres(study.brain_mask, factors, shape)))
    if study.labels is not None:
        small = _centres(study.labels, factors, shape)
        for name, values in study.structures.items():
            masks.append((f"structure '{name}' (labels {list(values)})", np.isin(study.labels, values),
                          np.isin(small, values)))
    for name, full, small in masks:
        if full.any() and not full.all() and (not small.any() or small.all()):
            return name, full, small
    return None


def _thickness_mm(mask: np.ndarray, spacing: np.ndarray) -> float:
    """How thick a structure is at its thickest, in mm: twice the largest distance from inside it to outside,
    taken on a grid of half voxels, where a slab of whole voxels measures exactly its thickness."""
    from scipy import ndimage

    crop = mask[voxel_box_slices(mask)]
    halves = crop.size <= 1 << 21  # a structure small enough to be lost, say; a large one is measured in voxels
    if halves:
        crop = crop.repeat(2, axis=0).repeat(2, axis=1).repeat(2, axis=2)
    step = np.asarray(spacing, np.float64) / (2.0 if halves else 1.0)
    depth = 2.0 * float(ndimage.distance_transform_edt(np.pad(crop, 1), sampling=step).max())
    return depth if halves else depth - float(step.min())


def _lost_message(study: Study, factors: Sequence[int], max_voxels: int, name: str, full: np.ndarray,
                  small: np.ndarray) -> str:
    source = study.sources.get("brain mask" if name == "brain mask" else "labels", study.name)
    shape = _downsampled_shape(study, factors)
    voxel = "×".join(f"{float(s) * f:g}" for s, f in zip(study.spacing, factors, strict=True))
    fault = "no voxel of it would be left" if not small.any() else "it would fill the whole grid, leaving no surface"
    return (
        f"{source}: {name} is {int(full.sum()):,} voxels, {_thickness_mm(full, study.spacing):.1f} mm thick at its "
        f"thickest; on the study downsampled to at most {max_voxels} voxels a side ({_shape_text(study.shape)} to "
        f"{_shape_text(shape)} voxels of {voxel} mm) {fault}; use a larger voxel limit, or the standard preset "
        "(full resolution, on a GPU)"
    )


def _shape_text(shape: Sequence[int]) -> str:
    return "×".join(str(int(n)) for n in shape)


def downsampling_note(before: Study, after: Study) -> str:
    """One line that says a study was downsampled: the grids before and after, their voxel sizes in mm."""

    def grid(study: Study) -> str:
        return f"{_shape_text(study.shape)} voxels of {'×'.join(f'{s:.3g}' for s in study.spacing)} mm"

    return f"study downsampled from {grid(before)} to {grid(after)}"


def _downsampled(study: Study, factors: Sequence[int]) -> Study:
    shape = _downsampled_shape(study, factors)
    fi, fj, fk = factors

    def blocks(array: np.ndarray) -> np.ndarray:
        cropped = array[: shape[0] * fi, : shape[1] * fj, : shape[2] * fk].astype(np.float32)
        return cropped.reshape(shape[0], fi, shape[1], fj, shape[2], fk).mean(axis=(1, 3, 5))

    def centres(array: np.ndarray | None) -> np.ndarray | None:
        return None if array is None else _centres(array, factors, shape)

    scale = np.diag([float(f) for f in factors] + [1.0])
    scale[:3, 3] = (np.asarray(factors, np.float64) - 1) / 2.0  # the new voxel centre is the old block's centre
    averaged = map_in_threads(blocks, list(study.channels.values()))
    return Study(
        name=study.name,
        channels=dict(zip(study.channels, averaged, strict=True)),
        affine=study.affine @ scale,
        labels=centres(study.labels),
        probability=None if study.probability is None else blocks(study.probability),
        brain_mask=centres(study.brain_mask),
        structures=dict(study.structures),
        sources={**study.sources, "grid": f"downsampled by {'×'.join(str(f) for f in factors)}"},
        colors=dict(study.colors),
        exact_surfaces=study.exact_surfaces,  # the same surfaces in the same place, on any grid
    )
