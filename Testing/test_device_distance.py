"""The device's exact distance transform (shaders/distance_transform.slang) gives the CPU's values: against a
brute-force search, against the ``edt`` package the boundary maps use without a device, for masks that are empty
or fill the grid, and along lines longer than any fixed per-thread array would hold; boundary maps made with it
keep the processor's accuracy bounds, and their cache entries are kept apart from the processor's."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from NeuralRaycastLib.array_cache import finish_writes
from NeuralRaycastLib.study import preprocess
from NeuralRaycastLib.study.device_distance import distance_transform, squared_distance_transform
from NeuralRaycastLib.study.preprocess import EXACT_REACH_MM, prepare, signed_distance
from NeuralRaycastLib.study.sample.phantom import Phantom, voxel_centres
from NeuralRaycastLib.study.study import load_study

ANISOTROPIC = (0.7, 1.3, 2.1)


def brute_force_squared(inside: np.ndarray, spacing) -> np.ndarray:
    """Squared mm to the nearest voxel not in ``inside``, by looking at every one (inf where there is none)."""
    outside = np.argwhere(~inside) * np.asarray(spacing)
    points = np.array(list(itertools.product(*map(range, inside.shape)))) * np.asarray(spacing)
    if not len(outside):
        return np.full(inside.shape, np.inf)
    squared = ((points[:, None, :] - outside[None, :, :]) ** 2).sum(axis=2).min(axis=1)
    return squared.reshape(inside.shape)


@pytest.mark.parametrize("shape, fraction", [((6, 7, 5), 0.6), ((9, 5, 4), 0.9), ((1, 1, 12), 0.8)])
def test_squared_distances_are_the_brute_force_ones(gpu, shape, fraction):
    inside = np.random.default_rng(3).random(shape) < fraction
    inside.flat[0] = False  # at least one voxel outside
    squared = squared_distance_transform(gpu, inside, ANISOTROPIC)
    assert squared.dtype == np.float32 and squared.shape == shape
    np.testing.assert_allclose(squared, brute_force_squared(inside, ANISOTROPIC), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("shape, fraction, spacing", [
    ((23, 17, 19), 0.97, ANISOTROPIC),
    ((20, 21, 22), 0.995, (0.5, 0.5, 5.0)),  # a thin-sliced scan: few voxels outside, far apart
    ((300, 3, 2), 0.99, (1.0, 2.0, 3.0)),  # long lines along the last pass
    ((2, 3, 300), 0.99, (3.0, 2.0, 1.0)),  # and along the first
])
def test_distances_are_the_edt_package_ones(gpu, shape, fraction, spacing):
    edt = pytest.importorskip("edt")
    inside = np.random.default_rng(5).random(shape) < fraction
    inside.flat[-1] = False
    expected = edt.edt(inside, anisotropy=spacing, black_border=False)
    distance = distance_transform(gpu, inside, spacing)
    assert np.isfinite(distance).all()
    np.testing.assert_allclose(distance, expected, rtol=1e-6, atol=1e-6)


def test_empty_and_full_masks(gpu):
    """No voxel inside: all 0. Every voxel inside: no voxel to reach, infinite, as the CPU transforms say."""
    empty = np.zeros((4, 5, 6), bool)
    assert np.array_equal(distance_transform(gpu, empty, ANISOTROPIC), np.zeros(empty.shape, np.float32))
    full = distance_transform(gpu, ~empty, ANISOTROPIC)
    assert np.isinf(full).all() and (full > 0).all()


def test_a_fortran_ordered_mask_is_read_in_its_index_order(gpu):
    """NIfTI volumes come in Fortran order; the transform follows the [i, j, k] indices, not the memory."""
    inside = np.asfortranarray(np.random.default_rng(7).random((7, 9, 11)) < 0.8)
    inside[3, 4, 5] = False
    expected = np.sqrt(brute_force_squared(inside, ANISOTROPIC)).astype(np.float32)
    np.testing.assert_allclose(distance_transform(gpu, inside, ANISOTROPIC), expected, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("shape_name", ["shell", "slit ring"])
def test_a_boundary_map_on_the_device_is_the_whole_grid_one(gpu, shape_name, monkeypatch):
    """signed_distance with a device takes both its transforms there and keeps the bounds the processor's
    transforms are held to: exact near the mask, the same sides, never further than the distance beyond."""
    from test_preprocess import whole_grid_signed_distance

    from NeuralRaycastLib.study import device_distance

    taken, measured = [], []
    monkeypatch.setattr(device_distance, "distance_transform",
                        lambda *args, __transform=device_distance.distance_transform: taken.append(1)
                        or __transform(*args))
    monkeypatch.setattr(device_distance, "mesh_distances",
                        lambda *args, __measure=device_distance.mesh_distances: measured.append(1)
                        or __measure(*args))

    spacing = np.array([1.5, 2.0, 2.5])
    shape = (72, 50, 44)
    centre = np.array([30.3, 40.2, 50.1])
    points = (np.indices(shape).reshape(3, -1).T * spacing).reshape(*shape, 3)
    if shape_name == "slit ring":
        across = np.linalg.norm((points - centre)[..., :2], axis=-1)
        slit = (np.abs(points[..., 1] - centre[1]) < 1.7) & (points[..., 0] > centre[0])
        inside = (across < 14.0) & (across >= 5.0) & (np.abs(points[..., 2] - centre[2]) < 6.0) & ~slit
    else:
        inside = (np.linalg.norm(points - centre, axis=-1) < 13.0) & (np.linalg.norm(points - centre, axis=-1) >= 6.5)
    reference = whole_grid_signed_distance(inside, spacing)
    on_device = signed_distance(inside, spacing, gpu=gpu)
    assert len(taken) == 2  # outside and inside
    assert measured  # the band's distances to the smoothed surface
    near = np.abs(reference) <= EXACT_REACH_MM
    np.testing.assert_allclose(on_device[near], reference[near], atol=1e-4)
    np.testing.assert_array_equal(np.sign(on_device), np.sign(reference))
    assert np.all(on_device[~near] <= reference[~near] + 1e-4)
    np.testing.assert_allclose(on_device, signed_distance(inside, spacing), atol=1e-4)


def test_distances_to_a_mesh_on_the_device_are_the_processors(gpu):
    """The band's distances to a smoothed surface on the device: the processor's signed distances to float32
    rounding, through a nearest triangle at the same distance, for points inside and outside a closed mesh whose
    candidates come from the same search."""
    from skimage.measure import marching_cubes

    from NeuralRaycastLib.mesh import surface_distance
    from NeuralRaycastLib.study.device_distance import mesh_distances

    grid = np.indices((24, 22, 20)).reshape(3, -1).T * np.array([1.0, 1.2, 1.5])
    field = (np.linalg.norm((grid - [11.0, 12.5, 14.0]) / [8.0, 9.0, 10.0], axis=1) - 1.0).reshape(24, 22, 20)
    vertices, faces, _, _ = marching_cubes(field, 0.0, spacing=(1.0, 1.2, 1.5))
    faces = faces[:, ::-1]  # outward
    rng = np.random.default_rng(4)
    points = vertices[rng.integers(0, len(vertices), 500)] + rng.normal(0.0, 1.5, (500, 3))
    nearest = surface_distance.candidate_triangles(vertices, faces, points)
    expected, expected_triangles = surface_distance.mesh_distances(vertices, faces, points, nearest)
    found, triangles = mesh_distances(gpu, vertices, faces, points, nearest)
    assert found.dtype == np.float64 and triangles.dtype == np.int64
    np.testing.assert_allclose(found, expected, atol=2e-5)
    assert (found < 0).sum() > 50 and (found > 0).sum() > 50
    same, _ = surface_distance.mesh_distances(vertices, faces, points, triangles[:, None])
    np.testing.assert_allclose(np.abs(same), np.abs(expected), atol=2e-5)
    assert np.mean(triangles == expected_triangles) > 0.95
    empty = mesh_distances(gpu, vertices, faces, points[:0], nearest[:0])
    assert empty[0].shape == (0,) and empty[1].shape == (0,)


def test_a_study_prepared_on_the_device_is_cached_apart_and_reused_without_it(gpu, phantom_study_dir, tmp_path,
                                                                               monkeypatch):
    """The device's maps agree with the processor's within the cache's float16 rounding, keep the phantom's
    accuracy, and are kept under a key of their own; a later preparation without a device (a run reopened by
    ``evaluate``) reads them instead of making the maps again, and the device reads an entry the processor made."""
    study = load_study(phantom_study_dir)
    on_device = prepare(study, cache_root=tmp_path / "device", gpu=gpu)
    on_cpu = prepare(study, cache_root=tmp_path / "cpu")
    assert on_device.key != on_cpu.key
    finish_writes()  # the entries are written behind
    assert [entry.name for entry in (tmp_path / "device").iterdir()] == [on_device.key]
    np.testing.assert_allclose(on_device.boundary, on_cpu.boundary, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(on_device.mask, on_cpu.mask)
    voxel = float(on_device.spacing.min())
    points = voxel_centres(on_device.affine, study.shape)
    for name in Phantom.structure_names:  # test_preprocess's bound on the processor's maps
        exact = Phantom().sdf(name, points)
        band = np.abs(exact) < 3 * voxel
        error = np.abs(on_device.boundary[on_device.structure_index(name)][band] - exact[band])
        assert error.mean() <= 0.5 * voxel, f"{name}: mean error {error.mean():.3f} mm"

    def no_maps(*args, **kwargs):
        raise AssertionError("the maps were made again instead of read from the cache")

    monkeypatch.setattr(preprocess, "mask_and_boundary_maps", no_maps)
    reopened = prepare(study, cache_root=tmp_path / "device")
    assert reopened.key == on_device.key
    np.testing.assert_array_equal(reopened.boundary, on_device.boundary)
    assert prepare(study, cache_root=tmp_path / "cpu", gpu=gpu).key == on_cpu.key


def test_a_transform_beyond_the_memory_budget_is_taken_on_the_processor():
    """A grid whose transform the device's budget cannot hold is transformed by the processor, never sent to the
    device (this stand-in has none to send it to)."""
    from types import SimpleNamespace

    from NeuralRaycastLib.gpu.memory_budget import MemoryBudget
    from NeuralRaycastLib.study.device_distance import BYTES_PER_VOXEL, fits_device

    outside = np.ones((20, 16, 12), bool)
    outside[3, 4, 5] = False
    small = SimpleNamespace(memory=MemoryBudget(outside.size * BYTES_PER_VOXEL - 1, "a test"))
    assert not fits_device(small, outside.shape)
    assert fits_device(SimpleNamespace(memory=MemoryBudget(outside.size * BYTES_PER_VOXEL, "a test")), outside.shape)
    spacing = np.array(ANISOTROPIC)
    np.testing.assert_array_equal(preprocess._distance_transform(outside, spacing, small),
                                  preprocess._distance_transform(outside, spacing))


def test_a_device_that_fails_the_transform_leaves_it_to_the_processor_and_is_said_once(caplog):
    """A driver's error in the device's transform does not stop the maps: the processor's transform gives the
    same values, one warning line says so, and the device is not asked again."""
    from types import SimpleNamespace

    from NeuralRaycastLib.gpu.memory_budget import GIB, MemoryBudget

    calls = []

    def load_module(name, structures=None):
        calls.append(name)
        raise RuntimeError("a driver's error\nand its details")

    failing = SimpleNamespace(memory=MemoryBudget(GIB, "a test"), device=None, load_module=load_module,
                              use_on_this_thread=lambda: True, lock=threading.RLock())
    outside = np.ones((9, 8, 7), bool)
    outside[2, 3, 4] = False
    spacing = np.array(ANISOTROPIC)
    expected = preprocess._distance_transform(outside, spacing)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            np.testing.assert_array_equal(preprocess._distance_transform(outside, spacing, failing), expected)
    assert calls == ["distance_transform"]
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert warnings == ["the boundary maps' distance transforms run on the processor: the device could not take "
                        "them (a driver's error)"]


def test_a_cuda_context_that_cannot_be_made_current_leaves_the_transform_to_the_processor():
    """A CUDA device takes calls only from a thread its context is current on (the maps' transforms run in worker
    threads): where the context cannot be made current there, the processor's transform is taken, and the device
    is never called."""
    from types import SimpleNamespace

    from NeuralRaycastLib.gpu.device import GpuContext
    from NeuralRaycastLib.gpu.memory_budget import GIB, MemoryBudget

    no_context = SimpleNamespace(native_handles=[])  # a device that names no CUDA context
    gpu = GpuContext(no_context, "cuda", report=None, memory=MemoryBudget(GIB, "a test"))
    assert not gpu.use_on_this_thread()
    assert GpuContext(no_context, "vulkan", report=None).use_on_this_thread()
    outside = np.ones((9, 8, 7), bool)
    outside[2, 3, 4] = False
    spacing = np.array(ANISOTROPIC)
    np.testing.assert_array_equal(preprocess._distance_transform(outside, spacing, gpu),
                                  preprocess._distance_transform(outside, spacing))
    assert gpu._modules == {}  # nothing was loaded on the device


def test_fit_prepares_its_study_with_its_device(phantom_study_dir, tmp_path, monkeypatch):
    """train_study (fit, the demo, the Slicer module) hands its device to the preparation, so the boundary maps'
    transforms run there; nothing is written when the preparation stops it."""
    from types import SimpleNamespace

    from NeuralRaycastLib.train import run
    from NeuralRaycastLib.train.presets import RunSettings

    class Prepared(Exception):
        pass

    given = []

    def prepare_for_run(study, settings, progress, gpu=None, with_outline=None, before_maps=None):
        given.append(gpu)
        raise Prepared

    device = SimpleNamespace(backend="vulkan", report=SimpleNamespace(software=True, adapter="a CPU"))
    monkeypatch.setattr(run, "prepare_for_run", prepare_for_run)
    with pytest.raises(Prepared):
        run.train_study(device, phantom_study_dir, tmp_path / "run", RunSettings("quick"), warm_up=False)
    assert given == [device]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting, software, on_device", [
    (None, False, True), (None, True, False), ("0", False, False), ("1", True, True)])
def test_a_runs_preparation_takes_the_device_where_it_is_a_gpu_or_asked(phantom_study_dir, monkeypatch, setting,
                                                                       software, on_device):
    """Unset, $NEURALRAYCAST_DEVICE_MAPS sends the boundary maps' transforms of a run's preparation to its device
    where that is a hardware GPU, and leaves them to the processor on a software device (lavapipe); 1 and 0 choose
    the device or the processor whatever it is."""
    from types import SimpleNamespace

    from NeuralRaycastLib.train import run_folder
    from NeuralRaycastLib.train.presets import RunSettings

    given = []
    monkeypatch.setattr(run_folder, "prepare", lambda study, **options: given.append(options["gpu"]))
    if setting is None:
        monkeypatch.delenv("NEURALRAYCAST_DEVICE_MAPS", raising=False)
    else:
        monkeypatch.setenv("NEURALRAYCAST_DEVICE_MAPS", setting)
    device = SimpleNamespace(backend="vulkan", report=SimpleNamespace(software=software))
    run_folder.prepare_for_run(phantom_study_dir, RunSettings("quick"), None, device)
    assert given == [device if on_device else None]

