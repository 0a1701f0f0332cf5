"""Shared fixtures: small studies written to temporary folders, and the GPU context."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest


def save_nifti(path: Path, data: np.ndarray, affine: np.ndarray | None = None) -> Path:
    nib.save(nib.Nifti1Image(data, np.eye(4) if affine is None else affine), path)
    return path


@pytest.fixture
def tiny_brats(tmp_path: Path) -> Path:
    """A 20x22x18 BraTS-named study: four channels, a label map with labels 1, 2 and 3."""
    rng = np.random.default_rng(1)
    shape = (20, 22, 18)
    affine = np.diag([1.5, 1.5, 2.0, 1.0])
    affine[:3, 3] = (-15, -16, -18)
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), axis=-1)
    r = np.linalg.norm((ijk - (10, 11, 9)) * (1.5, 1.5, 2.0), axis=-1)
    labels = np.zeros(shape, np.int16)
    labels[r < 9] = 2
    labels[r < 6] = 3
    labels[r < 3] = 1
    head = np.linalg.norm((ijk - (10, 11, 9)) / (8.5, 9.5, 7.5), axis=-1) < 1.0
    for channel in ("t1", "t1ce", "t2", "flair"):
        image = head * (500 + 100 * labels + rng.normal(0, 10, shape))
        save_nifti(tmp_path / f"case_{channel}.nii.gz", image.astype(np.float32), affine)
    save_nifti(tmp_path / "case_seg.nii.gz", labels.astype(np.uint8), affine)
    return tmp_path


@pytest.fixture(scope="session")
def phantom_study_dir(tmp_path_factory) -> Path:
    from NeuralRaycastLib.sample import write_sample

    return write_sample(tmp_path_factory.mktemp("phantom"), "phantom", spacing=2.0).parent


@pytest.fixture(scope="session")
def gpu():
    """The device every GPU test shares (CUDA or Vulkan; on a machine without a GPU, lavapipe)."""
    from NeuralRaycastLib.gpu import open_device

    return open_device()
