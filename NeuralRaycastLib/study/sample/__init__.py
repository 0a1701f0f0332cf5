"""Sample studies written as BraTS-named folders with a ``manifest.json``.

- ``icbm`` (default): real anatomy (ICBM152 2009a) with a synthetic tumour and synthetic contrasts.
- ``phantom``: an analytic phantom whose exact signed distances are known everywhere (geometry ground truth).
- ``fixture``: a tiny real T1 head (nibabel's bundled ``anatomical.nii``, 2 mm) with a small synthetic
  spherical lesion; fast enough for continuous integration.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import numpy as np

from ...files import atomic_folder
from ...progress import Progress

CASES = ("icbm", "phantom", "fixture")
#: Bump when a case's files change, so cached copies are written again.
SAMPLE_VERSION = 3

PHANTOM_DESCRIPTION = (
    "Analytic phantom: a rounded-box brain with ventricles and a spherical tumour (necrotic core, "
    "enhancing rim, oedema); exact signed distances known everywhere; synthetic contrasts."
)
FIXTURE_DESCRIPTION = (
    "Real T1 head (nibabel's anatomical.nii, 2 mm, not skull-stripped) with a small synthetic spherical lesion."
)


def write_case(
    folder: Path,
    name: str,
    channels: dict[str, np.ndarray],
    labels: np.ndarray | None,
    affine: np.ndarray,
    description: str,
    brain_mask: np.ndarray | None = None,
    exact_surfaces: str | None = None,
) -> Path:
    """Write ``<name>_<channel>.nii.gz``, ``<name>_seg.nii.gz``, ``<name>_brainmask.nii.gz`` (if given) and
    ``manifest.json``; return the manifest."""
    import nibabel as nib

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"name": name, "description": description, "channels": {}}
    if exact_surfaces:
        manifest["exact_surfaces"] = exact_surfaces
    for channel, image in channels.items():
        file = f"{name}_{channel}.nii.gz"
        data = np.clip(np.round(image), -32768, 32767).astype(np.int16)  # scanner-like integers
        nib.save(nib.Nifti1Image(data, affine), folder / file)
        manifest["channels"][channel] = file
    for key, suffix, volume in (("labels", "seg", labels), ("brain_mask", "brainmask", brain_mask)):
        if volume is not None:
            file = f"{name}_{suffix}.nii.gz"
            nib.save(nib.Nifti1Image(volume.astype(np.uint8), affine), folder / file)
            manifest[key] = file
    path = folder / "manifest.json"
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def fixture_case():
    """nibabel's real ``anatomical.nii`` T1 with a synthetic lesion: ({t1}, labels, affine)."""
    import nibabel as nib
    from nibabel.testing import data_path

    from ..preprocess import head_mask

    image = nib.as_closest_canonical(nib.load(str(Path(data_path) / "anatomical.nii")))
    t1 = image.get_fdata(dtype=np.float32)
    affine = image.affine.copy()
    spacing = np.linalg.norm(affine[:3, :3], axis=0)
    mask = head_mask({"t1": t1})
    centre = np.argwhere(mask).mean(axis=0) + np.array([3.0, 2.0, 1.0])  # off-centre, still deep inside
    offset = (np.stack(np.meshgrid(*[np.arange(n) for n in t1.shape], indexing="ij"), axis=-1) - centre) * spacing
    distance = np.linalg.norm(offset, axis=-1)
    labels = np.zeros(t1.shape, dtype=np.int16)
    labels[(distance < 12.0) & mask] = 2
    labels[(distance < 8.0) & mask] = 3
    labels[(distance < 4.5) & mask] = 1
    return {"t1": t1}, labels, affine


def cached_sample(case: str = "icbm", spacing: float | tuple[float, float, float] | None = None, seed: int = 0,
                  progress=None, labels_drawn: str = "clean") -> Path:
    """A sample study kept in the cache folder (written on first use): the path of its manifest."""
    from ...paths import cache_folder

    grid = "x".join(f"{s:g}" for s in spacing) if isinstance(spacing, (tuple, list)) else (spacing or "native")
    drawn = "" if labels_drawn == "clean" else f"-{labels_drawn}"
    folder = cache_folder("samples") / f"{case}-{grid}-seed{seed}{drawn}-v{SAMPLE_VERSION}"
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        # Complete folders only: each process writes its own copy and moves it in whole, so neither an
        # interrupted run nor two runs starting together leave a half-written sample behind.
        partial = folder.with_name(f"{folder.name}.partial-{uuid.uuid4().hex}")
        try:
            write_sample(partial, case, spacing, seed, progress, labels_drawn=labels_drawn)
            try:
                partial.replace(folder)
            except OSError:
                if not manifest.is_file():  # not a copy another process finished first: a real failure
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return manifest


def write_sample(
    folder: str | Path,
    case: str = "icbm",
    spacing: float | tuple[float, float, float] | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    labels_drawn: str = "clean",
) -> Path:
    """Create a sample study in ``folder``; returns the path of its ``manifest.json``. ``labels_drawn``: a
    style of :mod:`.label_style` (``clean``: the exact voxelisation; ``ragged``, ``thick``: as people draw)."""
    from .label_style import draw_like_people, style_named

    style = style_named(labels_drawn)
    report = progress or (lambda message, fraction: None)
    brain_mask = None
    if isinstance(spacing, (tuple, list)) and case != "phantom":
        raise ValueError(f"a voxel size per axis is for the phantom only; give the {case} case one number")
    if case == "icbm":
        from .icbm import DESCRIPTION, synthesise_case

        report("fetching/reading the ICBM152 template", 0.0)
        channels, labels, affine = synthesise_case(spacing=spacing, seed=seed)
        name, description = "icbm152_synthetic_lesion", DESCRIPTION
    elif case == "phantom":
        from .phantom import Phantom, render_phantom, voxel_centres

        report("sampling the analytic phantom", 0.0)
        phantom = Phantom()
        channels, labels, affine = render_phantom(phantom, spacing=spacing or 2.0, seed=seed)
        # The brain is voxelised exactly, as the labels are, so meshes are judged against the same kind of
        # mask for every structure (thresholding the images would put it a quarter voxel inside).
        brain_mask = phantom.sdf("brain", voxel_centres(affine, labels.shape)) < 0
        name, description = "phantom", PHANTOM_DESCRIPTION
    elif case == "fixture":
        if spacing is not None:
            raise ValueError("the fixture case has a fixed 2 mm grid; do not pass a spacing")
        channels, labels, affine = fixture_case()
        name, description = "fixture", FIXTURE_DESCRIPTION
    else:
        raise ValueError(f"unknown sample case '{case}'; choose one of {', '.join(CASES)}")
    if labels is not None and style.name != "clean":
        labels = draw_like_people(labels, np.linalg.norm(affine[:3, :3], axis=0), style, seed)
        description += f" Labels drawn {style.name} (as people draw them: label_style.py)."
    report("writing NIfTI files", 0.8)
    folder = Path(folder)
    # Whole or not at all; an earlier sample there is replaced, any other folder's files never are.
    with atomic_folder(folder, is_sample_folder, "write a sample into a new or empty folder") as staging:
        write_case(staging, name, channels, labels, affine, description, brain_mask,
                   "phantom" if case == "phantom" else None)
    report("sample written", 1.0)
    return folder / "manifest.json"


#: The names of the sample cases' studies (write_case's ``name``): the files a sample folder holds start so.
SAMPLE_NAMES = ("icbm152_synthetic_lesion", "phantom", "fixture")


def is_sample_folder(folder: Path) -> bool:
    """A folder that holds a sample written by :func:`write_sample` and nothing else."""
    entries = [entry.name for entry in Path(folder).iterdir()]
    return "manifest.json" in entries and all(
        entry == "manifest.json" or (entry.startswith(SAMPLE_NAMES) and entry.endswith(".nii.gz"))
        for entry in entries)
