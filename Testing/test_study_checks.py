"""The study checks at their edges: each refusal names its file or array first and says what is wrong,
values just inside a limit are kept (and clipped where documented), and downsampling keeps everything a
study carries. Fast: small arrays and the tiny BraTS folder only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from conftest import save_nifti

from NeuralRaycastLib.study.study import (
    Study,
    StudyError,
    _thickness_mm,
    downsample_factors,
    downsample_study,
    load_manifest,
    load_study,
    validate,
    write_study,
)

SHAPE = (5, 6, 7)


def _image(shape=SHAPE, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random(shape).astype(np.float32)


def _labels(shape=SHAPE, value: int = 1) -> np.ndarray:
    labels = np.zeros(shape, np.int32)
    labels[1:3, 2:4, 2:5] = value
    return labels


def _refused(message: str, **kwargs) -> None:
    """from_arrays refuses with ``message`` at the start of the error (the array named first)."""
    kwargs.setdefault("channels", {"t1": _image()})
    kwargs.setdefault("affine", np.eye(4))
    with pytest.raises(StudyError) as refused:
        Study.from_arrays(**kwargs)
    assert str(refused.value).startswith(message), str(refused.value)
    assert "\n" not in str(refused.value)


# ---------------------------------------------------------------------------------------------------------
# arrays (the Slicer path): each fault names the array


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"channels": {"t1": _image((5, 6, 7, 2))}}, "array 't1': expected a 3-D volume, got shape (5, 6, 7, 2)"),
        ({"channels": {"t1": _image((5, 6))}}, "array 't1': expected a 3-D volume, got shape (5, 6)"),
        ({"channels": {"t1": _image((1, 6, 7))}}, "array 't1': volume is too thin to hold a surface (shape (1, 6, 7))"),
        ({"channels": {"t1": _image() + 1j}}, "array 't1': voxel type complex64 is not a real number type"),
        ({"channels": {"t1": _image() > 0.5}}, "array 't1': voxel type bool is not a real number type"),
        ({"labels": _labels() + 0.5}, "label array: label map holds non-integer values"),
        ({"labels": np.where(_labels() > 0, np.nan, 0.0)}, "label array: contains 12 NaN or infinite voxel(s)"),
        ({"labels": _labels(value=32768)},
         "label array: label values above 32767 are not supported (max 32768)"),
        ({"labels": np.ones((5, 6), np.int32)}, "label array: expected a 3-D volume, got shape (5, 6)"),
        ({"probability": np.full(SHAPE, 1.5)}, "probability array: probabilities must lie in [0, 1], found [1.5, 1.5]"),
        ({"probability": np.where(_labels() > 0, np.nan, 0.5)}, "probability array: contains 12 NaN"),
        ({"probability": np.full((5, 6, 8), 0.5)}, "probability array: shape (5, 6, 8) differs from channel 't1'"),
        ({"brain_mask": np.where(_labels() > 0, np.nan, 1.0)}, "brain mask array: contains 12 NaN"),
        ({"brain_mask": np.ones((5, 6, 8), bool)}, "brain mask array: shape (5, 6, 8) differs"),
        ({"axis_order": "xyz"}, "axis_order must be 'ijk' or 'kji', not 'xyz'"),
        ({"labels": _labels(), "structures": {"x": [2]}},
         "label array: structure 'x' (labels [2]) has no voxels; labels present: [1]"),
        ({"labels": _labels(value=7)},
         "label array: labels [7] match none of the BraTS regions (1, 2, 3 or 4); name the structures in "
         "manifest.json"),
    ],
)
def test_an_array_fault_names_the_array_first(kwargs, message):
    _refused(message, **kwargs)


@pytest.mark.parametrize("affine", [np.full((4, 4), np.nan), np.diag([1.0, np.inf, 1.0, 1.0]), np.eye(3),
                                    np.diag([1.0, 1.0, 0.0, 1.0])])
def test_an_affine_that_is_not_finite_4x4_and_invertible_is_refused(affine):
    _refused("study: affine must be a finite, invertible 4x4 IJK->RAS matrix", affine=affine)


@pytest.mark.parametrize(
    "structures",
    [{"x": [0]}, {"x": [-1]}, {"x": [True]}, {"x": [1.5]}, {"x": ["1"]}, {"x": []}],
)
def test_structure_label_values_must_be_positive_integers(structures):
    _refused("structures argument: structure 'x' needs a list of positive integer label values",
             labels=_labels(), structures=structures)


@pytest.mark.parametrize("structures", [[1], {}])
def test_structures_must_be_a_non_empty_mapping(structures):
    _refused("structures argument: 'structures' must be a non-empty mapping of name -> list of label values",
             labels=_labels(), structures=structures)


def test_values_at_the_limits_are_kept():
    """Two voxels thick, trailing axes of one, whole-number float labels, label 32767, probabilities within
    1e-3 of [0, 1] (clipped onto it), a 0/1 integer mask, one label value as a bare integer, capitals and
    digits in a structure name, colours as floats, a whole-number affine: all accepted."""
    labels = _labels((2, 6, 7)).astype(np.float64)
    labels[0, 0, 0] = 32767
    probability = np.full((2, 6, 7), 0.5)
    probability[0, 0, :2] = (-0.0009, 1.0009)
    mask = np.zeros((2, 6, 7), np.uint8)
    mask[:, 1:5, 1:6] = 1
    study = Study.from_arrays({"t1": _image((2, 6, 7, 1, 1))}, np.eye(4, dtype=int), labels=labels,
                              probability=probability, brain_mask=mask, structures={"Lesion_2-b": 1, "big": [32767]},
                              colors={"Lesion_2-b": [1, 0, 0]})
    assert study.name == "study" and study.shape == (2, 6, 7)
    assert study.affine.dtype == np.float64
    assert study.labels.dtype == np.int16 and study.labels.max() == 32767 and study.labels[1, 2, 2] == 1
    assert study.probability.dtype == np.float32
    assert study.probability[0, 0, 0] == 0.0 and study.probability[0, 0, 1] == 1.0
    assert study.brain_mask.dtype == bool and study.brain_mask.sum() == 40
    assert study.structures == {"Lesion_2-b": (1,), "big": (32767,)}
    assert study.colors == {"Lesion_2-b": (1.0, 0.0, 0.0)} and all(type(v) is float for v in study.colors["Lesion_2-b"])


@pytest.mark.parametrize("value", [-0.0011, 1.0011])
def test_probabilities_just_beyond_the_rounding_allowance_are_refused(value):
    probability = np.full(SHAPE, 0.5)
    probability[0, 0, 0] = value
    low, high = min(value, 0.5), max(value, 0.5)
    _refused(f"probability array: probabilities must lie in [0, 1], found [{low:g}, {high:g}]", probability=probability)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"channels": {"t1": np.full(SHAPE, np.nan, np.float32)}}, "t1: contains 210 NaN"),
        ({"labels": _labels() - 2}, "labels: label map holds negative values"),
        ({"labels": np.zeros(SHAPE, np.int16)}, "labels: label map is empty"),
        ({"probability": np.full(SHAPE, 2.0)}, "probability: probabilities must lie in [0, 1]"),
        ({"brain_mask": np.full(SHAPE, 2)}, "brain mask: a brain mask holds only 0 and 1"),
    ],
)
def test_a_study_built_without_sources_names_each_volume_by_its_role(fields, message):
    """A Study made directly (no file or array names known), then checked: the volume is named by its role."""
    study = Study(**{"name": "s", "channels": {"t1": _image()}, "affine": np.eye(4), **fields})
    with pytest.raises(StudyError) as refused:
        validate(study)
    assert str(refused.value).startswith(message), str(refused.value)


def test_an_affine_of_integers_is_kept_as_floats():
    study = validate(Study(name="s", channels={"t1": _image()}, affine=np.eye(4, dtype=int)))
    assert study.affine.dtype == np.float64


def test_bounds_are_the_outermost_voxel_centres():
    affine = np.array([[0.0, 0.0, -2.0, 10.0], [1.5, 0.0, 0.0, -4.0], [0.0, 3.0, 0.0, 1.0], [0, 0, 0, 1]])
    study = Study.from_arrays({"t1": _image()}, affine)
    # i runs along y (1.5 mm, 5 voxels), j along z (3 mm, 6), k along -x (2 mm, 7)
    np.testing.assert_allclose(study.bounds(), [[10.0 - 12.0, -4.0, 1.0], [10.0, -4.0 + 6.0, 1.0 + 15.0]])


# ---------------------------------------------------------------------------------------------------------
# files


def test_a_manifest_that_is_missing_is_named(tmp_path):
    with pytest.raises(StudyError, match=f"^{re.escape(str(tmp_path / 'manifest.json'))}: manifest not found$"):
        load_manifest(tmp_path / "manifest.json")


@pytest.mark.parametrize("key", ["labels", "probability", "brain_mask", "name", "description"])
def test_a_manifest_entry_that_is_not_a_string_is_refused(tiny_brats, key):
    manifest = tiny_brats / "manifest.json"
    manifest.write_text(json.dumps({"channels": {"t1": "case_t1.nii.gz"}, key: 3}))
    with pytest.raises(StudyError, match=f"^{re.escape(str(manifest))}: '{key}' must be a string$"):
        load_study(tiny_brats)


@pytest.mark.parametrize("channels", [{}, {"t1": 3}, ["case_t1.nii.gz"]])
def test_manifest_channels_must_map_names_to_file_names(tiny_brats, channels):
    manifest = tiny_brats / "manifest.json"
    manifest.write_text(json.dumps({"channels": channels}))
    with pytest.raises(StudyError, match=f"^{re.escape(str(manifest))}: 'channels' must map channel names"):
        load_study(tiny_brats)


def test_manifest_structures_are_checked_naming_the_manifest(tiny_brats):
    manifest = tiny_brats / "manifest.json"
    manifest.write_text(json.dumps({"channels": {"t1": "case_t1.nii.gz"}, "labels": "case_seg.nii.gz",
                                    "structures": {"x": [0]}}))
    with pytest.raises(StudyError, match=f"^{re.escape(str(manifest))}: structure 'x' needs a list"):
        load_study(tiny_brats)


def test_a_manifest_without_a_name_is_named_by_its_folder(tiny_brats):
    (tiny_brats / "manifest.json").write_text(json.dumps({"channels": {"t1": "case_t1.nii.gz"}}))
    assert load_study(tiny_brats).name == tiny_brats.name


def test_brats_folders_with_capital_suffixes_stray_files_and_no_labels(tiny_brats):
    """Suffixes in capitals are read; a NIfTI file that is no BraTS role (sorted first, or of another
    name) is left alone; without a _seg there are no labels; the case's name is the files' prefix."""
    for channel in ("t1", "t1ce", "t2", "flair"):
        (tiny_brats / f"case_{channel}.nii.gz").rename(tiny_brats / f"case_{channel.upper()}.nii.gz")
    (tiny_brats / "case_seg.nii.gz").rename(tiny_brats / "aaa.nii.gz")  # no '_role': not a BraTS name
    save_nifti(tiny_brats / "case_notes.nii.gz", np.zeros((20, 22, 18), np.uint8),
               nib.load(tiny_brats / "case_T1.nii.gz").affine)
    study = load_study(tiny_brats)
    assert study.name == "case" and study.channel_names == ["t1", "t1ce", "t2", "flair"]
    assert study.labels is None and study.brain_mask is None and study.structures == {}


def test_a_brats_folder_of_two_case_names_is_named_by_the_folder(tiny_brats):
    (tiny_brats / "case_t2.nii.gz").rename(tiny_brats / "other_t2.nii.gz")
    assert load_study(tiny_brats).name == tiny_brats.name


def test_a_later_file_with_a_trailing_axis_of_one_is_on_the_grid(tiny_brats):
    image = nib.load(tiny_brats / "case_t2.nii.gz")
    save_nifti(tiny_brats / "case_t2.nii.gz", np.asanyarray(image.dataobj)[..., None], image.affine)
    assert load_study(tiny_brats).channels["t2"].shape == (20, 22, 18)


def test_a_grid_off_the_first_channel_says_what_to_do(tiny_brats):
    image = nib.load(tiny_brats / "case_seg.nii.gz")
    affine = image.affine.copy()
    affine[1, 3] += 0.2  # a tenth of the smallest side (1.5 mm) is 0.15 mm
    save_nifti(tiny_brats / "case_seg.nii.gz", np.asanyarray(image.dataobj), affine)
    seg = tiny_brats / "case_seg.nii.gz"
    with pytest.raises(StudyError, match=f"^{re.escape(str(seg))}: not on the same grid as the first channel "
                                         r"\(corners differ by up to 0.20 mm\); co-register and resample it first$"):
        load_study(tiny_brats)


def test_an_unreadable_file_gives_the_readers_reason_on_one_line(tiny_brats):
    t2 = tiny_brats / "case_t2.nii.gz"
    t2.write_bytes(b"this is not an image")
    with pytest.raises(Exception) as raw:
        nib.load(str(t2))
    reason = " ".join(str(raw.value).split())
    with pytest.raises(StudyError) as refused:
        load_study(tiny_brats)
    assert str(refused.value) == f"{t2}: channel t2 is not a readable NIfTI file ({reason})"


def test_a_damaged_file_says_it_may_be_truncated(tiny_brats):
    flair = tiny_brats / "case_flair.nii.gz"
    flair.write_bytes(flair.read_bytes()[:-300])
    with pytest.raises(StudyError) as refused:
        load_study(tiny_brats)
    assert str(refused.value).startswith(f"{flair}: channel flair data cannot be read (")
    assert str(refused.value).endswith("); the file may be damaged or truncated")


def _header_only(path: Path, shape: tuple[int, ...]) -> Path:
    """A .nii file of a uint8 header claiming ``shape`` and 1000 bytes of voxels."""
    header = nib.Nifti1Header()
    header.set_data_shape(shape)
    header.set_data_dtype(np.uint8)
    header["vox_offset"] = 352
    path.write_bytes(header.binaryblock + bytes(4) + bytes(1000))
    (path.parent / "manifest.json").write_text(json.dumps({"channels": {"t1": path.name}}))
    return path


def test_a_header_of_exactly_the_largest_volume_is_not_refused_for_its_size(tmp_path):
    """512³ voxels is allowed: this header (of a file without its voxels) is refused as truncated instead."""
    t1 = _header_only(tmp_path / "t1.nii", (512, 512, 512))
    with pytest.raises(StudyError, match=f"^{re.escape(str(t1))}: channel t1 is truncated: its header "
                                         r"\(shape \(512, 512, 512\), uint8\) needs 134,218,080 bytes"):
        load_study(tmp_path)


@pytest.mark.parametrize("shape", [(20, 22, 18, 2), (20, 22)])
def test_a_header_that_is_not_3_d_is_refused_before_the_voxels_are_read(tmp_path, shape):
    t1 = _header_only(tmp_path / "t1.nii", shape)
    with pytest.raises(StudyError, match=f"^{re.escape(str(t1))}: expected a 3-D volume, got shape "
                                         f"{re.escape(str(shape))}$"):
        load_study(tmp_path)


def test_two_files_for_one_channel_are_both_named(tiny_brats):
    (tiny_brats / "other_t1.nii.gz").write_bytes((tiny_brats / "case_t1.nii.gz").read_bytes())
    with pytest.raises(StudyError, match=f"^{re.escape(str(tiny_brats))}: several files for t1: case_t1.nii.gz, "
                                         "other_t1.nii.gz$"):
        load_study(tiny_brats)


def test_write_study_makes_its_folders_and_writes_over_an_earlier_copy(tmp_path):
    study = Study.from_arrays({"t1": _image()}, np.diag([1.5, 1.5, 2.0, 1.0]), labels=_labels(),
                              structures={"x": [1]}, name="scene")
    for _ in range(2):
        manifest = write_study(study, tmp_path / "a" / "b")
    again = load_study(manifest)
    assert again.name == "scene" and again.structures == {"x": (1,)}
    np.testing.assert_array_equal(again.labels, study.labels)


# ---------------------------------------------------------------------------------------------------------
# downsampling


def test_factors_never_leave_an_axis_thinner_than_two_voxels():
    """Cubic voxels of the forced 4 mm would take a short axis below two voxels: it is coarsened by at most
    half its length (whole factors), or not at all."""
    assert downsample_factors((400, 400, 3), (1.0, 1.0, 1.0), 100) == (4, 4, 1)
    factors = downsample_factors((400, 400, 7), (1.0, 1.0, 1.0), 100)
    assert factors == (4, 4, 3) and all(type(f) is int for f in factors)
    assert downsample_factors((400, 400, 4), (1.0, 1.0, 1.0), 100) == (4, 4, 2)


def test_nothing_to_downsample_gives_the_study_itself():
    study = Study.from_arrays({"t1": _image()}, np.eye(4))
    assert downsample_study(study, 7) is study


def test_downsampling_averages_blocks_and_keeps_what_the_study_carries():
    """12 × 9 × 6 voxels under a limit of 4: blocks of 3 × 3 × 3 (the 3 mm the long axis needs, on every
    axis), images and P(x) averaged over each block, labels taken at its centre, the new voxel centred on
    the block, and the name, structures, colours and sources kept, the grid's change added."""
    rng = np.random.default_rng(4)
    shape = (12, 9, 6)
    labels = np.zeros(shape, np.int16)
    labels[3:9, 3:6, 0:6] = 1
    affine = np.eye(4)
    affine[:3, 3] = (-5.0, 2.0, 7.0)
    study = Study.from_arrays({"t1": rng.random(shape), "t2": rng.random(shape)}, affine, labels=labels,
                              probability=rng.random(shape), structures={"x": [1]}, name="case",
                              colors={"x": (0.1, 0.2, 0.3)})
    small = downsample_study(study, 4)
    assert small.shape == (4, 3, 2)

    def blocks(array: np.ndarray) -> np.ndarray:
        return array.reshape(4, 3, 3, 3, 2, 3).mean(axis=(1, 3, 5))

    for name in ("t1", "t2"):
        np.testing.assert_allclose(small.channels[name], blocks(study.channels[name]), rtol=1e-6)
        assert small.channels[name].dtype == np.float32
    np.testing.assert_allclose(small.probability, blocks(study.probability), rtol=1e-6)
    assert small.probability.dtype == np.float32
    np.testing.assert_array_equal(small.labels, study.labels[1::3, 1::3, 1::3])
    np.testing.assert_allclose(small.affine @ [0, 0, 0, 1], affine @ [1, 1, 1, 1])
    np.testing.assert_allclose(small.spacing, [3.0, 3.0, 3.0])
    assert small.name == "case" and small.structures == {"x": (1,)} and small.colors == {"x": (0.1, 0.2, 0.3)}
    assert small.sources == {**study.sources, "grid": "downsampled by 3×3×3"}


def test_a_length_that_is_no_multiple_of_the_factor_drops_its_last_partial_block():
    """11 voxels by 3: three blocks; the two voxels left over make no block, for the labels as for the image."""
    labels = np.zeros((11, 9, 9), np.int16)
    labels[3:8, 3:6, 3:6] = 1
    study = Study.from_arrays({"t1": _image((11, 9, 9))}, np.eye(4), labels=labels, structures={"x": [1]})
    small = downsample_study(study, 4)
    assert small.shape == small.labels.shape == (3, 3, 3)
    np.testing.assert_array_equal(small.labels, labels[1:9:3, 1::3, 1::3])


def test_the_near_cubic_grid_is_kept_where_it_loses_nothing():
    """40 × 20 × 20 voxels under a limit of 20: the long axis needs a factor 2 alone; 2 mm cubes lose no
    structure, so the other axes are coarsened too."""
    labels = np.zeros((40, 20, 20), np.int16)
    labels[10:30, 5:15, 5:15] = 1
    study = Study.from_arrays({"t1": _image((40, 20, 20))}, np.eye(4), labels=labels, structures={"x": [1]})
    assert downsample_study(study, 20).shape == (20, 10, 10)


def test_a_grid_two_voxels_thick_is_kept_and_one_voxel_thick_is_refused():
    study = Study.from_arrays({"t1": _image((4, 40, 40))}, np.eye(4))
    assert downsample_study(study, 20).shape == (2, 20, 20)
    small = Study.from_arrays({"t1": _image((3, 8, 8))}, np.eye(4))
    with pytest.raises(StudyError, match=r"^study: downsampling \(3, 8, 8\) by \(3, 8, 8\) leaves \(1, 1, 1\), too "
                                         "thin to hold a surface; use a larger voxel limit$"):
        downsample_study(small, 1)


def test_a_structure_lost_on_both_grids_is_refused_with_the_finer_grid():
    """A single voxel at index 0 along the long axis: no block centre of either grid lands on it; the
    message gives the finer grid tried last, its voxel size and the limit."""
    labels = np.zeros((40, 20, 20), np.int16)
    labels[0, 10, 10] = 1
    study = Study.from_arrays({"t1": _image((40, 20, 20))}, np.eye(4), labels=labels, structures={"x": [1]})
    with pytest.raises(StudyError) as refused:
        downsample_study(study, 20)
    message = str(refused.value)
    assert message.startswith("label array: structure 'x' (labels [1]) is 1 voxels, 1.0 mm thick at its thickest;")
    assert "downsampled to at most 20 voxels a side (40×20×20 to 20×20×20 voxels of 2×1×1 mm)" in message
    assert "no voxel of it would be left; use a larger voxel limit, or the standard preset (full resolution, on a " \
           "GPU)" in message


def test_a_structure_that_would_fill_the_grid_and_a_lost_brain_mask_are_named():
    labels = np.ones((8, 8, 8), np.int16)
    labels[:, :, 0] = 0  # outside it only where no block centre lands
    mask = np.zeros((8, 8, 8), bool)
    mask[0, 0, :] = True
    image = _image((8, 8, 8))
    study = Study.from_arrays({"t1": image}, np.eye(4), labels=labels, structures={"x": [1]})
    with pytest.raises(StudyError, match=r"\) it would fill the whole grid, leaving no surface; use a larger"):
        downsample_study(study, 4)
    masked = Study.from_arrays({"t1": image}, np.eye(4), brain_mask=mask)
    with pytest.raises(StudyError, match="^brain mask array: brain mask is 8 voxels"):
        downsample_study(masked, 4)
    unnamed = Study(name="scene", channels={"t1": image}, affine=np.eye(4), labels=labels, structures={"x": (1,)})
    with pytest.raises(StudyError, match=r"^scene: structure 'x' \(labels \[1\]\) is 448 voxels"):
        downsample_study(unnamed, 4)  # a study made in memory is named by its name


@pytest.mark.parametrize("axis", range(3))
@pytest.mark.parametrize("voxels", [1, 2, 3, 4])
def test_a_slab_measures_its_thickness(axis, voxels):
    """A slab of whole voxels measures exactly its thickness (voxels × side) along any axis."""
    spacing = np.array([0.8, 1.1, 1.7])
    mask = np.zeros((30, 30, 30), bool)
    index = [slice(2, 28)] * 3
    index[axis] = slice(3, 3 + voxels)
    mask[tuple(index)] = True
    assert _thickness_mm(mask, spacing) == pytest.approx(voxels * spacing[axis], abs=1e-9)


def test_a_large_slab_is_measured_in_whole_voxels():
    """Past 2²¹ voxels in its box (two slabs far apart), a structure is measured on its own grid of cubes: a
    slab of an odd number of voxels is still exact."""
    mask = np.zeros((150, 150, 100), bool)
    mask[:, :, :5] = mask[:, :, 95:] = True
    assert _thickness_mm(mask, np.full(3, 1.2)) == pytest.approx(6.0, abs=1e-9)


def test_the_manifest_name_is_used(tmp_path: Path):
    study = Study.from_arrays({"t1": _image()}, np.eye(4), name="given")
    manifest = write_study(study, tmp_path)
    assert load_study(manifest).name == "given"
