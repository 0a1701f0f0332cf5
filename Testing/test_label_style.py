"""Labels as people draw them: each effect of a style is there, seeded, and the structure is still the one
the clean label holds (its extent and, roughly, its volume)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from scipy import ndimage

from NeuralRaycastLib.study.sample.label_style import STYLES, LabelStyle, draw_like_people, style_named


def sphere_labels(shape=(40, 40, 40), radius=10.0, core=5.0) -> np.ndarray:
    """Oedema (2) around a core (1): nested labels, as BraTS's."""
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), axis=-1)
    r = np.linalg.norm(ijk - (np.asarray(shape) - 1) / 2.0, axis=-1)
    labels = np.zeros(shape, np.int16)
    labels[r < radius] = 2
    labels[r < core] = 1
    return labels


def pieces(mask: np.ndarray) -> int:
    return int(ndimage.label(mask)[1])


def test_clean_leaves_the_labels_as_they_are():
    labels = sphere_labels()
    drawn = draw_like_people(labels, (1.0, 1.0, 1.0), STYLES["clean"])
    np.testing.assert_array_equal(drawn, labels)
    assert drawn is not labels


def test_a_style_is_seeded_and_keeps_shape_dtype_and_label_values():
    labels = sphere_labels()
    first = draw_like_people(labels, (1.0, 1.0, 1.0), STYLES["ragged"], seed=3)
    np.testing.assert_array_equal(first, draw_like_people(labels, (1.0, 1.0, 1.0), STYLES["ragged"], seed=3))
    assert not np.array_equal(first, draw_like_people(labels, (1.0, 1.0, 1.0), STYLES["ragged"], seed=4))
    assert first.shape == labels.shape and first.dtype == labels.dtype
    assert set(np.unique(first)) == set(np.unique(labels))


def test_specks_add_pieces_and_holes_remove_voxels_inside():
    labels = sphere_labels()
    specks = draw_like_people(labels, (1.0, 1.0, 1.0), LabelStyle("specks", specks=10), seed=1)
    assert pieces(specks > 0) > 1 and pieces(labels > 0) == 1
    holes = draw_like_people(labels, (1.0, 1.0, 1.0), LabelStyle("holes", holes=5), seed=1)
    inside = ndimage.binary_erosion(labels == 2, iterations=2)
    assert np.any(inside & (holes == 0)) and np.all(holes[labels == 0] == 0)


def test_slice_jitter_moves_each_slices_outline_not_the_structure():
    labels = sphere_labels()
    drawn = draw_like_people(labels, (1.0, 1.0, 1.0), LabelStyle("jitter", jitter_voxels=1.0), seed=2)
    centroids = [np.argwhere(drawn[:, :, k] > 0).mean(axis=0) for k in range(40) if drawn[:, :, k].any()]
    clean = [np.argwhere(labels[:, :, k] > 0).mean(axis=0) for k in range(40) if labels[:, :, k].any()]
    offsets = np.linalg.norm(np.asarray(centroids) - np.asarray(clean), axis=1)
    assert offsets.max() >= 1.0  # slices moved against each other
    assert np.linalg.norm(np.mean(centroids, axis=0) - np.mean(clean, axis=0)) < 1.0  # the structure did not


def test_nested_labels_stay_nested_when_outlines_grow_shrink_and_gain_rims():
    labels = sphere_labels()
    drawn = draw_like_people(labels, (1.0, 1.0, 1.0), LabelStyle("wobble", wobble=1.0, rims=0.3), seed=5)
    assert not np.array_equal(drawn, labels)
    core = drawn == 1
    assert core.any() and not np.any(ndimage.binary_dilation(core) & (drawn == 0))  # the core never meets outside


def test_thick_slices_stair_step_along_the_thick_axis():
    labels = sphere_labels(shape=(40, 40, 40))
    spacing = (1.0, 1.0, 1.0)
    thick = draw_like_people(labels, spacing, LabelStyle("thick", slice_mm=5.0), seed=0)
    for start in range(0, 40, 5):  # each 5 mm run of slices repeats one drawn slice
        block = thick[:, :, start:start + 5]
        assert all(np.array_equal(block[:, :, 0], block[:, :, i]) for i in range(block.shape[2]))
    anisotropic = draw_like_people(labels, (1.0, 4.0, 1.0), LabelStyle("thick", slice_mm=8.0), seed=0)
    assert np.array_equal(anisotropic[:, 0, :], anisotropic[:, 1, :])  # slices along the thickest axis (j)


def test_skipped_and_doubled_slices_keep_the_structures_extent():
    labels = sphere_labels()
    style = LabelStyle("slices", missing_slices=0.3, doubled_slices=0.3)
    drawn = draw_like_people(labels, (1.0, 1.0, 1.0), style, seed=7)
    drawn_slices = [k for k in range(40) if drawn[:, :, k].any()]
    clean_slices = [k for k in range(40) if labels[:, :, k].any()]
    assert drawn_slices[0] == clean_slices[0] and drawn_slices[-1] == clean_slices[-1]
    assert len(drawn_slices) < len(clean_slices)  # some skipped
    assert any(np.array_equal(drawn[:, :, k], drawn[:, :, k - 1]) and drawn[:, :, k].any()
               and not np.array_equal(labels[:, :, k], labels[:, :, k - 1]) for k in range(1, 40))  # doubled


@pytest.mark.parametrize("name", ["ragged", "thick"])
def test_a_drawn_structure_keeps_about_its_volume(name):
    labels = sphere_labels()
    drawn = draw_like_people(labels, (1.0, 1.0, 1.0), STYLES[name], seed=11)
    clean, ragged = int((labels > 0).sum()), int((drawn > 0).sum())
    assert abs(ragged - clean) / clean < 0.25, (clean, ragged)


def test_an_unknown_style_names_the_choices():
    with pytest.raises(ValueError, match="unknown label style 'messy' \\(choose from clean, ragged, thick\\)"):
        style_named("messy")
    assert replace(STYLES["ragged"], specks=0).specks == 0


def test_the_sample_command_writes_ragged_labels(tmp_path):
    from NeuralRaycastLib.app.cli import main
    from NeuralRaycastLib.study.study import load_study

    assert main(["sample", str(tmp_path / "clean"), "--case", "phantom", "--spacing", "4"]) == 0
    assert main(["sample", str(tmp_path / "ragged"), "--case", "phantom", "--spacing", "4", "--labels",
                 "ragged"]) == 0
    clean, ragged = load_study(tmp_path / "clean"), load_study(tmp_path / "ragged")
    assert pieces(ragged.labels > 0) > pieces(clean.labels > 0)
    np.testing.assert_array_equal(ragged.channels["t1"], clean.channels["t1"])  # only the labels differ


def test_prepare_says_how_many_pieces_each_structure_has_and_where_the_specks_are(tmp_path, capsys):
    import json

    from NeuralRaycastLib.app.cli import main
    from NeuralRaycastLib.study.pieces import label_pieces
    from NeuralRaycastLib.study.study import load_study

    study = tmp_path / "ragged"
    assert main(["sample", str(study), "--case", "phantom", "--spacing", "4", "--labels", "ragged"]) == 0
    capsys.readouterr()
    assert main(["prepare", str(study), "--json"]) == 0
    summary = {s["name"]: s for s in json.loads(capsys.readouterr().out)["structures"]}
    labels = load_study(study)
    _, expected = label_pieces(np.isin(labels.labels, labels.structures["whole_tumor"]), labels.affine)
    tumour = summary["whole_tumor"]
    assert tumour["pieces"] == len(expected) > 1
    assert tumour["smaller_pieces"] == [piece.as_dict() for piece in expected[1:21]]  # largest first
    assert main(["prepare", str(study)]) == 0
    text = capsys.readouterr().out
    assert f"{len(expected)} pieces" in text and f"{len(expected) - 1} beside the largest" in text
