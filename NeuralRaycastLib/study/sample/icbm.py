"""The default sample case: real anatomy (ICBM152 2009a) with a synthetic tumour and synthetic contrasts.

The ICBM152 2009a symmetric T1 template and its grey/white-matter probability maps ship inside the
nilearn wheel. That wheel is fetched once from the Python package index by a pinned, checksummed
``pip download`` (the only network access NeuralRaycast ever makes, and only for this command), kept in
the cache directory, and read without installing nilearn.

On that real anatomy a tumour is synthesised: a necrotic core inside an enhancing rim with an irregular
outline, oedema that spreads along white matter and stops at CSF, and a mass effect that pushes the
surrounding tissue away. T1ce, T2 and FLAIR are synthesised from the tissue maps and carry the real T1's
fine texture. It is real anatomy with a synthetic lesion, and is labelled as such everywhere it appears.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

from ...paths import cache_folder
from .contrast import CHANNELS, TISSUE_CONTRAST, TUMOUR_CONTRAST, rician_noise, smooth_noise

NILEARN_VERSION = "0.14.1"
NILEARN_WHEEL = f"nilearn-{NILEARN_VERSION}-py3-none-any.whl"
NILEARN_SHA256 = "725206484e9fb3f6691f9c2d20204a068759d5072f12055324702ee0cb2bbe8a"
WHEEL_ENV = "NEURALRAYCAST_NILEARN_WHEEL"
TEMPLATE_FILES = {
    "t1": "nilearn/datasets/data/mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz",
    "gm": "nilearn/datasets/data/mni_icbm152_gm_tal_nlin_sym_09a_converted.nii.gz",
    "wm": "nilearn/datasets/data/mni_icbm152_wm_tal_nlin_sym_09a_converted.nii.gz",
}
DESCRIPTION = (
    "Real anatomy with a synthetic lesion and synthetic contrasts: the ICBM152 2009a T1 template "
    "(skull-stripped, from the nilearn package) with a simulated tumour (necrotic core, enhancing rim, "
    "oedema along white matter, mass effect); T1ce, T2 and FLAIR are synthesised from tissue maps."
)


class SampleDataError(RuntimeError):
    """The sample data could not be fetched or verified."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def template_wheel() -> Path:
    """The verified nilearn wheel: ``$NEURALRAYCAST_NILEARN_WHEEL``, the cache, or a pinned ``pip download``."""
    if os.environ.get(WHEEL_ENV):
        candidates = [Path(os.environ[WHEEL_ENV])]
    else:
        candidates = [cache_folder("downloads") / NILEARN_WHEEL]
    for path in candidates:
        if path.is_file() and _sha256(path) == NILEARN_SHA256:
            return path
        if path.is_file():
            raise SampleDataError(f"{path}: checksum mismatch; delete it and run again")
    if os.environ.get(WHEEL_ENV):
        raise SampleDataError(f"{candidates[0]}: not found ({WHEEL_ENV})")

    target = candidates[0].parent
    target.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(target), f"nilearn=={NILEARN_VERSION}"]
    result = subprocess.run(command, capture_output=True, text=True)
    path = target / NILEARN_WHEEL
    if result.returncode != 0 or not path.is_file():
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SampleDataError(
            f"could not fetch nilearn=={NILEARN_VERSION} from the package index ({tail[0]}); "
            f"without network, copy {NILEARN_WHEEL} to {path} or set {WHEEL_ENV}"
        )
    if _sha256(path) != NILEARN_SHA256:
        path.unlink()
        raise SampleDataError(f"downloaded {NILEARN_WHEEL} has the wrong checksum; removed it")
    return path


def read_template(spacing: float | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """ICBM152 T1, GM and WM maps in RAS orientation, optionally resampled: ({t1, gm, wm}, affine)."""
    import nibabel as nib
    from scipy import ndimage

    with zipfile.ZipFile(template_wheel()) as archive:
        images = {
            key: nib.as_closest_canonical(nib.Nifti1Image.from_bytes(gzip.decompress(archive.read(name))))
            for key, name in TEMPLATE_FILES.items()
        }
    affine = images["t1"].affine.copy()
    volumes = {key: image.get_fdata(dtype=np.float32) for key, image in images.items()}
    volumes["gm"] /= 255.0
    volumes["wm"] /= 255.0
    native = float(np.linalg.norm(affine[:3, :3], axis=0).min())
    if spacing and abs(spacing - native) > 1e-6:
        factor = native / spacing
        volumes = {k: ndimage.zoom(v, factor, order=1, grid_mode=False) for k, v in volumes.items()}
        affine[:3, :3] *= spacing / native
    return volumes, affine


def _warp_radially(
    volumes: dict[str, np.ndarray], centre_vox: np.ndarray, spacing: float, radius: float, amount: float
) -> dict[str, np.ndarray]:
    """Mass effect: tissue at distance r from the centre comes from r - amount·exp(-(r / 1.6 radius)²)."""
    from scipy import ndimage

    shape = next(iter(volumes.values())).shape
    grid = np.stack(np.meshgrid(*[np.arange(n, dtype=np.float32) for n in shape], indexing="ij"))
    offset = (grid - centre_vox[:, None, None, None]) * spacing
    r = np.sqrt((offset**2).sum(axis=0)) + 1e-6
    source_r = np.maximum(r - amount * np.exp(-((r / (1.6 * radius)) ** 2)), 0.0)
    source = centre_vox[:, None, None, None] + offset * (source_r / r) / spacing
    return {
        k: ndimage.map_coordinates(v, source, order=1, mode="nearest").astype(np.float32) for k, v in volumes.items()
    }


def synthesise_case(spacing: float | None = None, seed: int = 0):
    """Build the sample case: (channels {t1, t1ce, t2, flair}: float32, labels int16, affine)."""
    from scipy import ndimage  # here, not at the top: the CLI imports this module for its error class

    rng = np.random.default_rng(seed)
    volumes, affine = read_template(spacing)
    voxel = float(np.linalg.norm(affine[:3, :3], axis=0).min())
    brain = ndimage.binary_fill_holes(volumes["t1"] > 0)

    wm_median = float(np.median(volumes["t1"][volumes["wm"] > 0.9]))
    volumes["t1"] /= wm_median

    # Seed deep in white matter, far from the brain surface.
    depth = ndimage.distance_transform_edt(brain, sampling=voxel)
    candidates = np.argwhere((volumes["wm"] > 0.7) & (depth > 25.0))
    centre = candidates[rng.integers(len(candidates))].astype(np.float32)
    radius = float(rng.uniform(14.0, 20.0))

    volumes["brain"] = brain.astype(np.float32)
    volumes = _warp_radially(volumes, centre, voxel, radius, amount=0.35 * radius)
    brain = volumes.pop("brain") > 0.5
    gm, wm = np.clip(volumes["gm"], 0, 1), np.clip(volumes["wm"], 0, 1)
    csf = np.clip(brain.astype(np.float32) - gm - wm, 0.0, 1.0)

    shape = brain.shape
    grid = np.stack(np.meshgrid(*[np.arange(n, dtype=np.float32) for n in shape], indexing="ij"))
    distance = np.sqrt(((grid - centre[:, None, None, None]) ** 2).sum(axis=0)) * voxel
    outline = 1.0 + 0.35 * smooth_noise(shape, sigma_voxels=7.0 / voxel, rng=rng)
    r = distance / (radius * outline)
    core_fraction = float(rng.uniform(0.45, 0.7))
    tumour = (r < 1.0) & brain
    necrotic = (r < core_fraction) & brain

    # Oedema: spreads from the tumour, favouring white matter, never into CSF.
    from_tumour = ndimage.distance_transform_edt(~tumour, sampling=voxel)
    spread = np.exp(-from_tumour / 14.0) * (wm + 0.35 * gm)
    spread = ndimage.gaussian_filter(spread, sigma=1.5 / voxel)
    oedema = (spread > 0.3) & brain & (csf < 0.5) & ~tumour
    connected, _ = ndimage.label(oedema | tumour)
    keep = np.unique(connected[tumour])
    oedema &= np.isin(connected, keep[keep > 0])

    labels = np.zeros(shape, dtype=np.int16)
    labels[oedema] = 2
    labels[tumour] = 3
    labels[necrotic] = 1

    # Contrasts: normal tissue from the tissue maps carrying the real T1 texture, tumour blended on top.
    jitter = {c: {t: v * rng.uniform(0.95, 1.05) for t, v in TISSUE_CONTRAST[c].items()} for c in CHANNELS}
    tissues = {"gm": gm, "wm": wm, "csf": csf}
    t1_model = sum(tissues[t] * jitter["t1"][t] for t in tissues) + 1e-3
    texture = np.clip(volumes["t1"] / t1_model, 0.6, 1.6)
    soft = {name: ndimage.gaussian_filter((labels == value).astype(np.float32), 0.6)
            for name, value in (("necrotic", 1), ("oedema", 2), ("enhancing", 3))}
    lesion_weight = np.clip(sum(soft.values()), 0.0, 1.0)
    heterogeneity = 1.0 + 0.08 * smooth_noise(shape, sigma_voxels=2.0 / voxel, rng=rng)
    channels = {}
    for channel in CHANNELS:
        if channel == "t1":
            normal = volumes["t1"]
        else:
            normal = sum(tissues[t] * jitter[channel][t] for t in tissues) * texture
        lesion = sum(soft[t] * TUMOUR_CONTRAST[channel][t] for t in soft) * heterogeneity
        image = (1.0 - lesion_weight) * normal + lesion
        image = rician_noise(np.clip(image, 0.0, None), 0.02, rng) * brain
        channels[channel] = (1000.0 * image).astype(np.float32)
    return channels, labels, affine
