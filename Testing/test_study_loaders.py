"""Every loader path with good inputs, and each bad input with its own message."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from conftest import save_nifti

from NeuralRaycastLib.grid import interpolate_ijk, sample_at
from NeuralRaycastLib.study.study import Study, StudyError, load_study, write_study


def test_brats_folder_loads_channels_labels_and_default_structures(tiny_brats):
    study = load_study(tiny_brats)
    assert study.name == "case"
    assert study.channel_names == ["t1", "t1ce", "t2", "flair"]
    assert study.shape == (20, 22, 18)
    np.testing.assert_allclose(study.spacing, [1.5, 1.5, 2.0])
    assert set(np.unique(study.labels)) == {0, 1, 2, 3}
    assert list(study.structures) == ["whole_tumor", "tumor_core", "enhancing_tumor"]
    assert study.labels.dtype == np.int16 and study.channels["t1"].dtype == np.float32


def test_brats_2023_names_are_mapped(tiny_brats):
    for old, new in (("t1", "t1n"), ("t1ce", "t1c"), ("t2", "t2w"), ("flair", "t2f")):
        (tiny_brats / f"case_{old}.nii.gz").rename(tiny_brats / f"BraTS-GLI-00001-000-{new}.nii.gz")
    (tiny_brats / "case_seg.nii.gz").rename(tiny_brats / "BraTS-GLI-00001-000-seg.nii.gz")
    study = load_study(tiny_brats)
    assert study.channel_names == ["t1", "t1ce", "t2", "flair"]
    assert study.name == "BraTS-GLI-00001-000"
    assert study.labels is not None


def test_manifest_with_structures_and_probability(tiny_brats):
    probability = np.zeros((20, 22, 18), np.float32)
    probability[8:12, 9:13, 7:11] = 0.8
    save_nifti(tiny_brats / "p.nii.gz", probability, nib.load(tiny_brats / "case_t1.nii.gz").affine)
    manifest = {
        "name": "mine",
        "channels": {"flair": "case_flair.nii.gz", "t2": "case_t2.nii.gz"},
        "labels": "case_seg.nii.gz",
        "probability": "p.nii.gz",
        "structures": {"lesion": [1, 2, 3], "necrosis": [1]},
    }
    (tiny_brats / "manifest.json").write_text(json.dumps(manifest))
    for path in (tiny_brats, tiny_brats / "manifest.json"):
        study = load_study(path)
        assert study.name == "mine" and study.channel_names == ["flair", "t2"]
        assert study.structures == {"lesion": (1, 2, 3), "necrosis": (1,)}
        assert study.probability is not None and study.probability.max() == pytest.approx(0.8)


def test_a_study_written_out_loads_back_the_same(tiny_brats, tmp_path):
    """write_study: what another process reads of a study held in memory (Slicer's) is that study."""
    study = load_study(tiny_brats)
    probability = (study.labels > 0).astype(np.float32) * 0.7
    mask = np.ones(study.shape, bool)
    mask[0] = False
    study = Study(name="from scene", channels=study.channels, affine=study.affine, labels=study.labels,
                  probability=probability, brain_mask=mask, structures={"lesion": (1, 2, 3), "core": (1, 3)})
    again = load_study(write_study(study, tmp_path / "out"))
    assert again.name == "from scene" and again.channel_names == study.channel_names
    assert np.allclose(again.affine, study.affine)
    for name in study.channels:
        assert np.array_equal(again.channels[name], study.channels[name])
    assert np.array_equal(again.labels, study.labels)
    assert np.array_equal(again.probability, probability)
    assert np.array_equal(again.brain_mask.astype(bool), mask)
    assert again.structures == {"lesion": (1, 2, 3), "core": (1, 3)}


def test_brain_mask_file_is_read_from_a_brats_folder_and_a_manifest(tiny_brats):
    mask = np.zeros((20, 22, 18), np.uint8)
    mask[3:17, 3:19, 2:16] = 1
    affine = nib.load(tiny_brats / "case_t1.nii.gz").affine
    save_nifti(tiny_brats / "case_brainmask.nii.gz", mask, affine)
    study = load_study(tiny_brats)
    assert study.brain_mask is not None and study.brain_mask.dtype == bool
    np.testing.assert_array_equal(study.brain_mask, mask.astype(bool))
    (tiny_brats / "case_brainmask.nii.gz").rename(tiny_brats / "skullstrip.nii.gz")
    manifest = {"channels": {"t1": "case_t1.nii.gz"}, "labels": "case_seg.nii.gz", "brain_mask": "skullstrip.nii.gz"}
    (tiny_brats / "manifest.json").write_text(json.dumps(manifest))
    np.testing.assert_array_equal(load_study(tiny_brats).brain_mask, mask.astype(bool))


@pytest.mark.parametrize(
    "mask, message",
    [
        (np.full((6, 7, 8), 2, np.uint8), "holds only 0 and 1"),
        (np.zeros((6, 7, 8), bool), "empty or fills"),
        (np.ones((6, 7, 9), bool), "shape"),
    ],
)
def test_bad_brain_mask_is_refused(mask, message):
    image = np.random.default_rng(0).random((6, 7, 8)).astype(np.float32)
    with pytest.raises(StudyError, match=message):
        Study.from_arrays({"t1": image}, np.eye(4), brain_mask=mask)


def test_downsampling_keeps_the_brain_mask_on_the_new_grid():
    from NeuralRaycastLib.study.study import downsample_study

    image = np.random.default_rng(0).random((12, 12, 12)).astype(np.float32)
    mask = np.zeros(image.shape, bool)
    mask[2:9, 3:10, 1:12] = True
    small = downsample_study(Study.from_arrays({"t1": image}, np.eye(4), brain_mask=mask), 6)
    assert small.brain_mask is not None and small.brain_mask.shape == small.shape == (6, 6, 6)
    np.testing.assert_array_equal(small.brain_mask, mask[1::2, 1::2, 1::2])


def test_arrays_in_slicer_order_are_transposed_once():
    rng = np.random.default_rng(0)
    ijk = rng.random((6, 7, 8)).astype(np.float32)
    labels = np.zeros((6, 7, 8), np.int16)
    labels[2:4, 3:5, 1:6] = 3
    a = Study.from_arrays({"t1": ijk}, np.eye(4), labels=labels)
    b = Study.from_arrays({"t1": ijk.transpose(2, 1, 0)}, np.eye(4), labels=labels.transpose(2, 1, 0), axis_order="kji")
    np.testing.assert_array_equal(a.channels["t1"], b.channels["t1"])
    np.testing.assert_array_equal(a.labels, b.labels)
    assert b.structures == {"whole_tumor": (1, 2, 3, 4), "tumor_core": (1, 3, 4), "enhancing_tumor": (3, 4)}


def test_flipped_axis_is_reoriented_onto_the_first_channel(tiny_brats):
    image = nib.load(tiny_brats / "case_t2.nii.gz")
    data = np.asanyarray(image.dataobj)
    flipped = image.affine.copy()
    flipped[:, 0] *= -1
    flipped[:3, 3] = image.affine[:3, :3] @ [19, 0, 0] + image.affine[:3, 3]
    save_nifti(tiny_brats / "case_t2.nii.gz", data[::-1].copy(), flipped)
    study = load_study(tiny_brats)
    np.testing.assert_allclose(study.channels["t2"], data, rtol=1e-6)


def test_trailing_singleton_axis_is_squeezed(tiny_brats):
    image = nib.load(tiny_brats / "case_t1.nii.gz")
    save_nifti(tiny_brats / "case_t1.nii.gz", np.asanyarray(image.dataobj)[..., None], image.affine)
    assert load_study(tiny_brats).channels["t1"].shape == (20, 22, 18)


# --- bad input: each gets its own message -------------------------------------------------------------


def _rewrite(folder: Path, name: str, data, affine=None):
    reference = nib.load(folder / "case_t1.nii.gz")
    save_nifti(folder / name, data, reference.affine if affine is None else affine)


def test_missing_path():
    with pytest.raises(StudyError, match="no such file or folder"):
        load_study("/definitely/not/here")


def test_folder_without_channels(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(StudyError, match="no MRI channels found"):
        load_study(tmp_path)


def test_two_files_for_one_channel(tiny_brats):
    shutil.copy(tiny_brats / "case_t1.nii.gz", tiny_brats / "other_t1.nii.gz")
    with pytest.raises(StudyError, match="several files for t1"):
        load_study(tiny_brats)


def test_single_image_instead_of_folder(tiny_brats):
    with pytest.raises(StudyError, match="not a single image"):
        load_study(tiny_brats / "case_t1.nii.gz")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"channels": {"t1": "case_t1.nii.gz"}, "colour": 1}', r"unknown key\(s\) \['colour'\]"),
        ('{"labels": "case_seg.nii.gz"}', "'channels' must map channel names"),
        ('{"channels": {"t1": "case_t1.nii.gz"}, "labels": 3}', "'labels' must be a string"),
        ('{"channels": {"t1": "gone.nii.gz"}}', "gone.nii.gz: channel t1 file not found"),
        ('{"channels": {"t1": "case_t1.nii.gz"}, "structures": {"x": []}}', "structure 'x' needs a list"),
        ('{"channels": {"t1": "case_t1.nii.gz"}, "structures": {"1x": [1]}}', "must start with a letter"),
        ('{"channels": {"t1": "case_t1.nii.gz"}, "structures": {"x": [1]}}', "declared but no label map"),
        ('{"channels": {"t1": "case_t1.nii.gz"}, "labels": "case_seg.nii.gz", "structures": {"x": [7]}}',
         r"structure 'x' \(labels \[7\]\) has no voxels"),
    ],
)
def test_bad_manifest(tiny_brats, content, message):
    (tiny_brats / "manifest.json").write_text(content)
    with pytest.raises(StudyError, match=message):
        load_study(tiny_brats)


def test_corrupt_file(tiny_brats):
    (tiny_brats / "case_t2.nii.gz").write_bytes(b"this is not an image")
    with pytest.raises(StudyError, match=r"case_t2.nii.gz: channel t2 is not a readable NIfTI file"):
        load_study(tiny_brats)


def test_truncated_file(tiny_brats):
    raw = gzip.decompress((tiny_brats / "case_flair.nii.gz").read_bytes())
    (tiny_brats / "case_flair.nii.gz").write_bytes(gzip.compress(raw[: len(raw) // 2]))
    with pytest.raises(StudyError, match=r"case_flair.nii.gz: channel flair data cannot be read"):
        load_study(tiny_brats)


def test_wrong_shape(tiny_brats):
    _rewrite(tiny_brats, "case_t2.nii.gz", np.ones((20, 22, 17), np.float32))
    with pytest.raises(StudyError, match=r"case_t2.nii.gz: grid \(20, 22, 17\) differs"):
        load_study(tiny_brats)


def test_shifted_grid(tiny_brats):
    affine = nib.load(tiny_brats / "case_t1.nii.gz").affine.copy()
    affine[0, 3] += 5.0
    _rewrite(tiny_brats, "case_seg.nii.gz", np.asanyarray(nib.load(tiny_brats / "case_seg.nii.gz").dataobj), affine)
    with pytest.raises(StudyError, match=r"case_seg.nii.gz: not on the same grid .* 5.00 mm"):
        load_study(tiny_brats)


def test_four_d_volume(tiny_brats):
    _rewrite(tiny_brats, "case_t1ce.nii.gz", np.ones((20, 22, 18, 2), np.float32))
    with pytest.raises(StudyError, match=r"case_t1ce.nii.gz: expected a 3-D volume, got shape \(20, 22, 18, 2\)"):
        load_study(tiny_brats)


def test_nan_in_channel(tiny_brats):
    data = np.asanyarray(nib.load(tiny_brats / "case_t1.nii.gz").dataobj).astype(np.float32)
    data[3, 4, 5] = np.nan
    data[4, 4, 5] = np.inf
    _rewrite(tiny_brats, "case_t1.nii.gz", data)
    with pytest.raises(StudyError, match=r"case_t1.nii.gz: contains 2 NaN or infinite voxel"):
        load_study(tiny_brats)


def test_constant_channel(tiny_brats):
    _rewrite(tiny_brats, "case_t2.nii.gz", np.zeros((20, 22, 18), np.float32))
    with pytest.raises(StudyError, match=r"case_t2.nii.gz: image is constant"):
        load_study(tiny_brats)


def test_fractional_labels(tiny_brats):
    labels = np.asanyarray(nib.load(tiny_brats / "case_seg.nii.gz").dataobj).astype(np.float32) * 0.5
    _rewrite(tiny_brats, "case_seg.nii.gz", labels)
    with pytest.raises(StudyError, match="case_seg.nii.gz: label map holds non-integer values"):
        load_study(tiny_brats)


def test_negative_labels(tiny_brats):
    labels = np.asanyarray(nib.load(tiny_brats / "case_seg.nii.gz").dataobj).astype(np.int16)
    labels[0, 0, 0] = -1
    _rewrite(tiny_brats, "case_seg.nii.gz", labels)
    with pytest.raises(StudyError, match="label map holds negative values"):
        load_study(tiny_brats)


def test_empty_label_map(tiny_brats):
    _rewrite(tiny_brats, "case_seg.nii.gz", np.zeros((20, 22, 18), np.uint8))
    with pytest.raises(StudyError, match=r"case_seg.nii.gz: label map is empty"):
        load_study(tiny_brats)


def test_labels_outside_brats_regions(tiny_brats):
    _rewrite(tiny_brats, "case_seg.nii.gz", np.full((20, 22, 18), 9, np.uint8))
    with pytest.raises(StudyError, match=r"labels \[9\] match none of the BraTS regions"):
        load_study(tiny_brats)


def test_default_structures_skip_missing_regions(tiny_brats):
    labels = np.asanyarray(nib.load(tiny_brats / "case_seg.nii.gz").dataobj).astype(np.uint8)
    labels[labels == 3] = 2  # no enhancing tumour (a non-enhancing lesion)
    labels[labels == 1] = 2
    _rewrite(tiny_brats, "case_seg.nii.gz", labels)
    assert list(load_study(tiny_brats).structures) == ["whole_tumor"]


def test_probability_out_of_range():
    image = np.random.default_rng(0).random((5, 6, 7)).astype(np.float32)
    with pytest.raises(StudyError, match=r"probabilities must lie in \[0, 1\], found \[0, 255\]"):
        Study.from_arrays({"t1": image}, np.eye(4), probability=np.linspace(0, 255, 210).reshape(5, 6, 7))


def test_array_shape_mismatch_and_bad_affine():
    image = np.random.default_rng(0).random((5, 6, 7)).astype(np.float32)
    with pytest.raises(StudyError, match=r"array 'flair': shape \(5, 6, 8\) differs from channel 't1'"):
        Study.from_arrays({"t1": image, "flair": np.ones((5, 6, 8))}, np.eye(4))
    with pytest.raises(StudyError, match="invertible 4x4"):
        Study.from_arrays({"t1": image}, np.zeros((4, 4)))
    with pytest.raises(StudyError, match="no image channels"):
        Study.from_arrays({}, np.eye(4))


@pytest.mark.parametrize("shape", [(6, 7, 5), (1, 4, 3), (2, 1, 1)])
def test_trilinear_sampling_matches_scipy_inside_and_beyond_the_grid(shape):
    """The numpy sampler used for occupancy, normals and surface distances gives scipy's numbers, edge
    values continuing outside the grid, for one volume and for a stack of them."""
    from scipy import ndimage

    rng = np.random.default_rng(3)
    stack = rng.standard_normal((3, *shape)).astype(np.float32)
    ijk = rng.uniform(-2.0, np.array(shape) + 1.0, (500, 3))
    expected = np.stack([ndimage.map_coordinates(v, ijk.T, order=1, mode="nearest") for v in stack])
    np.testing.assert_allclose(interpolate_ijk(stack, ijk), expected, atol=1e-5)
    np.testing.assert_allclose(interpolate_ijk(stack[1], ijk), expected[1], atol=1e-5)
    affine = np.array([[0.0, 0, 2, 10], [1.5, 0, 0, -4], [0, -1, 0, 3], [0, 0, 0, 1]])
    points = ijk @ affine[:3, :3].T + affine[:3, 3]
    np.testing.assert_allclose(sample_at(stack, affine, points), expected, atol=1e-5)
