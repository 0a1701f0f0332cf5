"""Fault injection: corrupted and oversized inputs.

NIfTI headers that claim more voxels than a volume may hold, truncated and garbage files, view sizes out of
range, and downsampling that would lose a structure. Each is refused before anything is allocated for it or
written, as one line naming the file (or structure) and what to do; through the command line, exit status 2
and no traceback. None of these needs a GPU: every check comes before the device is used.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from conftest import save_nifti

from NeuralRaycastLib.app import cli
from NeuralRaycastLib.gpu.memory_budget import MemoryBudget
from NeuralRaycastLib.render.camera import MAX_VIEW_SIZE, MIN_VIEW_SIZE, Camera, check_view_size, orbit_cameras
from NeuralRaycastLib.study.study import (
    MAX_VOLUME_VOXELS,
    Study,
    StudyError,
    downsample_factors,
    downsample_study,
    load_study,
    write_study,
)
from NeuralRaycastLib.train.presets import RunSettings

REPOSITORY = Path(__file__).resolve().parent.parent

#: Loads a study through the command line with tracemalloc on; prints its exit status, peak and time.
MEASURED_CLI = """
import json, sys, time, tracemalloc
from NeuralRaycastLib.app.cli import main
tracemalloc.start()
start = time.perf_counter()
status = main(sys.argv[1:])
print(json.dumps({"status": status, "peak": tracemalloc.get_traced_memory()[1],
                  "seconds": time.perf_counter() - start}))
"""


def _header_only(path: Path, shape: tuple[int, ...], dtype=np.int16) -> Path:
    """A NIfTI file of a header claiming ``shape`` and a few kilobytes of voxels (gzipped for .nii.gz)."""
    header = nib.Nifti1Header()
    header.set_data_shape(shape)
    header.set_data_dtype(dtype)
    header["vox_offset"] = 352
    blob = header.binaryblock + bytes(4) + bytes(2648)
    path.write_bytes(gzip.compress(blob) if path.name.endswith(".gz") else blob)
    return path


def _manifest_study(folder: Path, t1: str) -> Path:
    (folder / "manifest.json").write_text(json.dumps({"channels": {"t1": t1}}))
    return folder


def _cli(capsys, *argv: str) -> tuple[int, str]:
    status = cli.main(list(argv))
    return status, capsys.readouterr().err


def _one_line(err: str) -> str:
    """The error: one line, the last one written (progress lines may come before it), no traceback."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines and [line for line in lines if "error" in line] == lines[-1:], err
    return lines[-1]


def _limit_memory() -> None:  # pragma: no cover - runs in the child
    """Keep a child that allocates what a header claims from taking the machine's memory: it fails instead."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))


# ---------------------------------------------------------------------------------------------------------
# NIfTI files


@pytest.mark.parametrize("side, suffix", [(1500, ".nii.gz"), (4000, ".nii")])
def test_a_header_claiming_too_many_voxels_is_refused_before_any_voxel_is_read(tmp_path, side, suffix):
    """A 3 KB file whose header claims 1500³ (or 4000³) voxels: refused from its header, in a fraction of a
    second and without allocating what it claims (a memory-capped child reports a failed allocation, or
    an empty reason, if it does), the message naming the file, the claimed shape and the limit."""
    t1 = _header_only(tmp_path / f"t1{suffix}", (side,) * 3)
    assert t1.stat().st_size < 4096
    study = _manifest_study(tmp_path, t1.name)
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY), "NEURALRAYCAST_CACHE": str(tmp_path / "cache"),
                   "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-c", MEASURED_CLI, "prepare", str(study)], capture_output=True,
                           text=True, env=environment, timeout=120,
                           preexec_fn=_limit_memory if sys.platform.startswith("linux") else None)
    assert child.returncode == 0, child.stderr
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    line = _one_line(child.stderr)
    assert measured["status"] == 2
    assert measured["peak"] < 100 << 20 and measured["seconds"] < 10, measured
    assert str(t1) in line and f"({side}, {side}, {side})" in line and f"{MAX_VOLUME_VOXELS:,}" in line, line
    assert not (tmp_path / "cache" / "studies").exists() or not any((tmp_path / "cache" / "studies").iterdir())


def test_a_truncated_nii_is_refused_with_both_sizes(tmp_path, capsys):
    image = np.random.default_rng(0).random((20, 22, 18)).astype(np.float32)
    t1 = save_nifti(tmp_path / "t1.nii", image)
    whole = t1.read_bytes()
    t1.write_bytes(whole[: len(whole) // 2])
    needed = 352 + image.nbytes
    status, err = _cli(capsys, "prepare", str(_manifest_study(tmp_path, "t1.nii")))
    line = _one_line(err)
    assert status == 2
    assert str(t1) in line and "truncated" in line and f"{needed:,}" in line and f"{len(whole) // 2:,}" in line, line
    assert t1.read_bytes() == whole[: len(whole) // 2]  # the input is left as it was


def test_a_truncated_nii_gz_is_one_line_naming_the_file(tiny_brats, capsys):
    t1 = tiny_brats / "case_t1.nii.gz"
    t1.write_bytes(t1.read_bytes()[:-300])
    status, err = _cli(capsys, "prepare", str(tiny_brats))
    line = _one_line(err)
    assert status == 2 and str(t1) in line and "cannot be read" in line, line
    assert "()" not in line


@pytest.mark.parametrize("name", ["case_t1.nii.gz", "case_seg.nii.gz"])
def test_a_file_of_garbage_is_one_line_naming_it(tiny_brats, capsys, name):
    corrupt = tiny_brats / name
    corrupt.write_bytes(np.random.default_rng(3).bytes(corrupt.stat().st_size))
    status, err = _cli(capsys, "prepare", str(tiny_brats))
    line = _one_line(err)
    assert status == 2 and str(corrupt) in line and "not a readable NIfTI file" in line, line


def test_a_garbage_header_claiming_a_huge_shape_is_refused_by_its_header(tmp_path):
    """Garbage whose header fields happen to parse: the claimed shape, not the data, decides."""
    t1 = _header_only(tmp_path / "t1.nii", (700, 700, 700), np.float64)
    with pytest.raises(StudyError, match=r"t1\.nii: channel t1 header claims shape \(700, 700, 700\)"):
        load_study(_manifest_study(tmp_path, t1.name))


def test_a_failure_without_text_is_named_by_its_type(tiny_brats, monkeypatch):
    """A read that fails with an empty message (a MemoryError, say) never gives an empty reason."""
    from nibabel.arrayproxy import ArrayProxy

    def out_of_memory(self, dtype=None, copy=None):
        raise MemoryError()

    monkeypatch.setattr(ArrayProxy, "__array__", out_of_memory)
    with pytest.raises(StudyError, match=r"case_t1\.nii\.gz: channel t1 data cannot be read \(MemoryError\)"):
        load_study(tiny_brats)


# ---------------------------------------------------------------------------------------------------------
# view sizes


@pytest.mark.parametrize("width, height", [(100000, 100000), (10000, 10000), (512, MAX_VIEW_SIZE + 1),
                                           (MIN_VIEW_SIZE - 1, 256), (8, 8)])
def test_view_sizes_outside_the_limits_are_refused_stating_them(width, height):
    limits = f"from {MIN_VIEW_SIZE} to {MAX_VIEW_SIZE} pixels"
    with pytest.raises(ValueError, match=limits):
        check_view_size(width, height)
    box = np.array([[-50.0, -60.0, -40.0], [50.0, 60.0, 40.0]])
    with pytest.raises(ValueError, match=limits):
        orbit_cameras(box, 4, width, height)
    with pytest.raises(ValueError, match=limits):
        Camera.from_slicer((0, -300, 0), (0, 0, 0), (0, 0, 1), 30.0, (width, height))
    if max(width, height) > MAX_VIEW_SIZE:  # a camera made directly: small test pictures pass, huge ones never
        with pytest.raises(ValueError, match=limits):
            Camera((0.0, -300.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0), 30.0, width, height)


def test_view_sizes_at_the_limits_are_accepted():
    box = np.array([[-50.0, -60.0, -40.0], [50.0, 60.0, 40.0]])
    for width, height in [(MIN_VIEW_SIZE, MIN_VIEW_SIZE), (MAX_VIEW_SIZE, MAX_VIEW_SIZE), (MIN_VIEW_SIZE, 4000)]:
        check_view_size(width, height)
        assert orbit_cameras(box, 2, width, height)[0].width == width


class _UnusedDevice:
    """Stands in for the GPU where a check must come before any device work: anything more than its name
    fails the test."""

    backend = "stand-in"
    memory = MemoryBudget(4 << 30, "a stand-in")  # the budget is read as work is sized, not device work

    def __init__(self) -> None:
        self.uses: list[str] = []  # also what a thread of the run asked for, where its error is not raised

    def __getattr__(self, name):
        self.uses.append(name)
        raise AssertionError(f"the device was used ({name}) before the size was checked")


@pytest.mark.parametrize("size", ["100000", "10000", "4"])
def test_fit_with_a_view_size_out_of_range_is_one_line_before_any_work(tiny_brats, tmp_path, capsys, monkeypatch,
                                                                        size):
    monkeypatch.setattr(cli, "open_device", lambda device=None: _UnusedDevice())
    out = tmp_path.parent / f"{tmp_path.name}-run"  # the study is tmp_path: output beside it, not inside
    status, err = _cli(capsys, "fit", str(tiny_brats), "--out", str(out), "--preset", "quick", "--size", size)
    line = _one_line(err)
    assert status == 2 and f"view size {size} x {size}" in line and f"{MAX_VIEW_SIZE} pixels" in line, line
    assert not out.exists()


def test_render_reference_with_a_view_size_out_of_range_is_one_line(tiny_brats, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "open_device", lambda device=None: _UnusedDevice())
    out = tmp_path.parent / f"{tmp_path.name}-views"
    status, err = _cli(capsys, "render-reference", str(tiny_brats), "--out", str(out), "--size", "10000", "10000")
    line = _one_line(err)
    assert status == 2 and "view size 10000 x 10000" in line and f"{MAX_VIEW_SIZE} pixels" in line, line
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------
# downsampling


def _thin_slab_study(shape, spacing, labels_at, label: int = 3) -> Study:
    """A study with a tumour-sized blob (oedema, label 2) and a one-voxel sheet of ``label`` (enhancing
    tumour by default) where ``labels_at`` (index expressions) says."""
    rng = np.random.default_rng(0)
    ijk = np.indices(shape).transpose(1, 2, 3, 0)
    centre = (np.asarray(shape) - 1) / 2
    r = np.linalg.norm((ijk - centre) * spacing, axis=-1)
    labels = np.zeros(shape, np.int16)
    labels[r < 0.25 * float(np.min(np.asarray(shape) * spacing))] = 2
    labels[labels_at] = label
    image = (r < 0.45 * float(np.min(np.asarray(shape) * spacing))) * 500 + 50 * labels + rng.normal(0, 5, shape)
    return Study.from_arrays({"t1": image.astype(np.float32)}, np.diag([*spacing, 1.0]), labels=labels)


def test_per_axis_factors_follow_the_physical_size():
    assert downsample_factors((288, 288, 9), (0.2, 0.2, 8.0), 96) == (3, 3, 1)  # thick slices untouched
    assert downsample_factors((200, 200, 200), (1.0, 1.0, 1.0), 96) == (3, 3, 3)  # isotropic: one factor
    assert downsample_factors((240, 240, 150), (1.0, 1.0, 1.2), 96) == (3, 3, 2)  # 3 × 3 × 2.4 mm
    assert downsample_factors((400, 400, 200), (0.5, 0.5, 1.0), 96) == (6, 6, 3)  # 3 mm cubes
    assert downsample_factors((90, 90, 40), (1.0, 1.0, 3.0), 96) == (1, 1, 1)


def test_thick_slices_are_kept_and_the_downsampling_is_reported(monkeypatch):
    """A 0.2 × 0.2 × 8 mm study under the quick preset: the in-plane axes are coarsened to 0.6 mm, the nine
    8 mm slices are kept (not cut to three 24 mm ones), the physical extent stays within a voxel, the
    progress says what was done, and finding its brain warns of nothing."""
    from NeuralRaycastLib.study.preprocess import head_mask
    from NeuralRaycastLib.train import run_folder

    shape, spacing = (288, 288, 9), np.array([0.2, 0.2, 8.0])
    study = _thin_slab_study(shape, spacing, (slice(130, 150), slice(130, 150), 4))
    small = downsample_study(study, 96)
    assert small.shape == (96, 96, 9)
    np.testing.assert_allclose(small.spacing, [0.6, 0.6, 8.0])
    extent, small_extent = np.asarray(shape) * spacing, np.asarray(small.shape) * small.spacing
    assert np.all(np.abs(small_extent - extent) <= small.spacing + 1e-9)
    np.testing.assert_array_equal(small.labels, study.labels[1::3, 1::3, :])  # the centre of each 3 × 3 × 1 block
    np.testing.assert_allclose(small.affine @ [0, 0, 0, 1], study.affine @ [1, 1, 0, 1])
    np.testing.assert_allclose(small.channels["t1"][5, 7, 2], study.channels["t1"][15:18, 21:24, 2].mean(), rtol=1e-5)

    messages: list[str] = []
    monkeypatch.setattr(run_folder, "prepare", lambda study, progress=None, **pieces: study)  # what it would prepare
    prepared = run_folder.prepare_for_run(study, RunSettings("quick", max_voxels=96),
                                          lambda message, fraction: messages.append(message))
    assert prepared.shape == (96, 96, 9)
    assert "study downsampled from 288×288×9 voxels of 0.2×0.2×8 mm to 96×96×9 voxels of 0.6×0.6×8 mm" in messages

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no scikit-image warning that a last axis of 3 "looks like RGB"
        assert head_mask({"t1": study.channels["t1"][::9, ::9, 3:6]}).shape == (32, 32, 3)


def test_a_finer_grid_is_used_where_cubic_voxels_would_lose_a_structure():
    """Coarsening the fine axis to cubic voxels would miss a one-voxel sheet the grid the limit needs keeps:
    that grid is used."""
    spacing = np.array([0.5, 0.5, 0.25])
    assert downsample_factors((192, 192, 100), spacing, 96) == (2, 2, 4)
    study = _thin_slab_study((192, 192, 100), spacing, (slice(80, 110), slice(80, 110), 53))
    small = downsample_study(study, 96)
    np.testing.assert_allclose(small.spacing, [1.0, 1.0, 0.5])
    assert np.any(small.labels == 3)


def test_a_downsampled_phantom_keeps_its_exact_surfaces():
    """The quick preset's coarser grid holds the same surfaces in the same place: evaluate still measures the
    learned surfaces against the exact ones (it measured nothing on the quick preset when this was lost)."""
    study = _thin_slab_study((192, 192, 20), np.array([0.5, 0.5, 3.0]), (slice(80, 110), slice(80, 110), 10))
    study.exact_surfaces = "phantom"
    assert downsample_study(study, 96).exact_surfaces == "phantom"


def test_a_structure_that_would_vanish_is_named_with_its_size_and_what_to_do(tmp_path, capsys, monkeypatch):
    """A thin tumour core (a necrotic sheet) that no block centre lands in: ``fit --preset quick`` refuses it
    naming the label file, the structure, its size and what to do, before the device is used or anything is
    written."""
    study = _thin_slab_study((200, 200, 20), np.array([1.0, 1.0, 3.0]), (101, slice(80, 120), slice(5, 15)), 1)
    folder = write_study(study, tmp_path / "study").parent.resolve()
    with pytest.raises(StudyError) as refused:
        downsample_study(load_study(folder), 96)
    message = str(refused.value)
    assert str(folder / "labels.nii") in message and "structure 'tumor_core' (labels [1, 3, 4])" in message
    assert "is 400 voxels, 1.0 mm thick at its thickest" in message and "200×200×20 to 66×66×20" in message
    assert "no voxel of it would be left" in message
    assert "larger voxel limit" in message and "standard preset" in message

    unused = _UnusedDevice()
    monkeypatch.setattr(cli, "open_device", lambda device=None: unused)
    # With the maps' transforms on the device, their kernels are set up as soon as the study's size is checked.
    monkeypatch.setenv("NEURALRAYCAST_DEVICE_MAPS", "1")
    out = tmp_path / "run"
    status, err = _cli(capsys, "fit", str(folder), "--out", str(out), "--preset", "quick")
    assert status == 2 and _one_line(err) == f"neuralraycast fit: error: {message}"
    assert not out.exists() and unused.uses == []


def test_a_structure_without_voxels_is_named_by_preparing():
    """A study built without the loader's checks (as downsampling once did) whose structure has no voxel:
    preparing names the structure, its labels and their file instead of 'the mask'."""
    from NeuralRaycastLib.study.preprocess import prepare

    checked = _thin_slab_study((24, 24, 24), np.ones(3), (12, slice(8, 16), slice(8, 16)))
    labels = checked.labels.copy()
    labels[labels == 3] = 0
    study = Study(checked.name, checked.channels, checked.affine, labels, structures={"lesion": (3,)},
                  sources={"labels": "/data/case/seg.nii.gz"})
    with pytest.raises(StudyError, match=r"signed distance for structure 'lesion' \(labels \[3\] of "
                                         r"/data/case/seg\.nii\.gz\): the mask is empty"):
        prepare(study, use_cache=False)
