"""Shared fixtures: small studies written to temporary folders, and the GPU context."""

from __future__ import annotations

import os
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
    from NeuralRaycastLib.study.sample import write_sample

    return write_sample(tmp_path_factory.mktemp("phantom"), "phantom", spacing=2.0).parent


@pytest.fixture(scope="session", autouse=True)
def own_data_caches(tmp_path_factory):
    """The tests' studies, prepared maps and reference views go to a cache of their own, so a test run
    never pushes a user's entries out of theirs (nor reads them); the compiled kernels, samples and
    downloads are shared, so kernels compile once per machine for both."""
    from NeuralRaycastLib.paths import CACHE_ENV, cache_dir

    user, own = cache_dir(), tmp_path_factory.mktemp("cache")
    for name in ("shaders", "modules", "samples", "downloads"):
        (user / name).mkdir(parents=True, exist_ok=True)
        (own / name).symlink_to(user / name, target_is_directory=True)
    previous = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(own)
    yield own
    if previous is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = previous


@pytest.fixture(scope="session")
def gpu():
    """The device every GPU test shares (CUDA or Vulkan; on a machine without a GPU, lavapipe)."""
    from NeuralRaycastLib.gpu.device import open_device

    return open_device()


def analytic_prepared(sdfs: dict, spacing: float, low, high, channel=None, channel_count: int = 1):
    """A PreparedStudy whose boundary maps are exact signed distances sampled on a grid.

    ``sdfs`` maps structure names to functions of RAS points (..., 3); isolates the renderer from the
    distance transform (which has its own tests). ``channel_count`` > 1 repeats the channel, scaled, under
    the BraTS names (a field then has as many appearance inputs as one of a BraTS study).
    """
    from NeuralRaycastLib.study.preprocess import PreparedStudy
    from NeuralRaycastLib.study.sample.phantom import voxel_centres
    from NeuralRaycastLib.study.structures import make_structures
    from NeuralRaycastLib.study.study import Study

    low, high = np.asarray(low, float), np.asarray(high, float)
    shape = tuple(int(np.ceil((high - low) / spacing)) + 1 for low, high in zip(low, high, strict=True))
    affine = np.diag([spacing, spacing, spacing, 1.0])
    affine[:3, 3] = low
    points = voxel_centres(affine, shape)
    boundary = np.stack([np.asarray(f(points), np.float32) for f in sdfs.values()])
    image = np.ones(shape, np.float32) if channel is None else np.asarray(channel(points), np.float32)
    names = ["t1", "t1ce", "t2", "flair"][:channel_count] if channel_count > 1 else ["t1"]
    channels = np.stack([image * (1.0 - 0.2 * index) for index in range(len(names))])
    study = Study("analytic", dict(zip(names, channels, strict=True)), affine)
    structures = make_structures({name: (index + 1,) for index, name in enumerate(sdfs)}, include_brain=False)
    mask = (boundary < 0).any(axis=0)
    return PreparedStudy(
        study=study, channels=channels, channel_names=names, structures=structures, boundary=boundary,
        probability=np.zeros(shape, np.float32), mask=mask, occupancy=np.ones((1, 1, 1), bool), occupancy_block=8,
        bounds=np.stack([low, high]),
    )


def sphere_trace(sdf, origin, directions, t_max=2000.0, iterations=400):
    """Exact first-hit distances of rays against an analytic SDF (inf where missed)."""
    t = np.zeros(directions.shape[:-1])
    done = np.zeros_like(t, bool)
    for _ in range(iterations):
        d = sdf(origin + t[..., None] * directions)
        done |= d < 1e-5
        t = np.where(done, t, t + d)
        if done.all():
            break
    return np.where(done & (t < t_max), t, np.inf)


def sphere_actor(radius: float, centre=(0.0, 0.0, 0.0)):
    """A VTK actor of a sphere: something for a test's 3D view to show."""
    import vtk

    sphere = vtk.vtkSphereSource()
    sphere.SetCenter(*centre)
    sphere.SetRadius(radius)
    mapper = vtk.vtkPolyDataMapper()
    mapper.SetInputConnection(sphere.GetOutputPort())
    actor = vtk.vtkActor()
    actor.SetMapper(mapper)
    return actor


def phantom_prepared(spacing: float, channel_count: int = 1):
    """The analytic phantom, exact boundary maps on a grid of ``spacing`` mm around its brain: (phantom, prepared)."""
    from NeuralRaycastLib.study.sample.phantom import Phantom

    phantom = Phantom()
    low = np.asarray(phantom.brain_centre) - np.asarray(phantom.brain_half_extent) - 6.0
    high = np.asarray(phantom.brain_centre) + np.asarray(phantom.brain_half_extent) + 6.0
    sdfs = {name: (lambda p, name=name: phantom.sdf(name, p)) for name in phantom.structure_names}
    return phantom, analytic_prepared(sdfs, spacing, low, high, channel_count=channel_count)
