"""Volumes and pieces of a structure, as evaluate reports them: the label's against the learned surface's,
and every piece of the label the learned surface drops, said with its size and place."""

from __future__ import annotations

import numpy as np
import pytest

from NeuralRaycastLib.train.evaluate import pieces, volumes


def grid(shape=(40, 40, 40), spacing=(1.0, 1.0, 2.0)) -> tuple[np.ndarray, np.ndarray]:
    affine = np.diag([*spacing, 1.0])
    affine[:3, 3] = (-20.0, -20.0, -40.0)
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), axis=-1).reshape(-1, 3)
    ras = (np.c_[ijk, np.ones(len(ijk))] @ affine.T)[:, :3].reshape(*shape, 3)
    return ras, affine


def test_the_learned_volume_is_what_its_surface_encloses_and_the_label_volume_its_voxels():
    ras, affine = grid()
    radius = 12.0
    sdf = np.linalg.norm(ras, axis=-1) - radius
    truth = sdf < 0
    found = volumes(truth, sdf, affine)
    exact_ml = 4.0 / 3.0 * np.pi * radius**3 / 1000.0
    assert found["label_volume_ml"] == pytest.approx(truth.sum() * 2.0 / 1000.0)  # 2 mm³ voxels
    assert found["learned_volume_ml"] == pytest.approx(exact_ml, rel=0.02)
    assert found["volume_difference_percent"] == pytest.approx(
        100.0 * (found["learned_volume_ml"] - found["label_volume_ml"]) / found["label_volume_ml"])
    shrunk = volumes(truth, sdf + 1.0, affine)  # the surface 1 mm inside: about 3 dr / r less
    assert shrunk["volume_difference_percent"] == pytest.approx(found["volume_difference_percent"] - 25.0, abs=3.0)


def test_an_empty_label_has_no_volume_difference_and_no_pieces():
    ras, affine = grid()
    sdf = np.linalg.norm(ras, axis=-1) - 5.0
    empty = np.zeros(sdf.shape, bool)
    assert volumes(empty, sdf, affine)["volume_difference_percent"] is None
    assert pieces(empty, sdf < 0, affine) == {"label_pieces": 0, "pieces_kept": 0, "pieces_dropped": []}


def test_pieces_the_learned_surface_drops_are_each_said_with_size_and_place():
    ras, affine = grid()
    truth = np.linalg.norm(ras, axis=-1) < 10.0  # the tumour
    truth[2:4, 2:4, 2:3] = True  # a speck of 4 voxels near a corner
    truth[35, 35, 35] = True  # a speck of 1 voxel
    truth[30, 5, 10:12] = True  # and one of 2, touching nothing
    learned = np.linalg.norm(ras, axis=-1) < 9.5  # smooth: keeps the tumour, drops the specks
    learned[35, 35, 35] = True  # ... but this one
    found = pieces(truth, learned, affine)
    assert found["label_pieces"] == 4 and found["pieces_kept"] == 2
    assert [p["voxels"] for p in found["pieces_dropped"]] == [4, 2]  # largest first
    assert found["pieces_dropped"][0]["volume_ml"] == pytest.approx(4 * 2.0 / 1000.0)
    expected = affine @ np.array([2.5, 2.5, 2.0, 1.0])
    assert found["pieces_dropped"][0]["centre_ras"] == pytest.approx(list(expected[:3]))


def test_pieces_touching_at_a_corner_are_one_piece():
    _, affine = grid((10, 10, 10))
    truth = np.zeros((10, 10, 10), bool)
    truth[2, 2, 2] = truth[3, 3, 3] = True  # 26-connected: one piece, as a drawn blob would be
    assert pieces(truth, np.zeros_like(truth), affine)["label_pieces"] == 1


def test_the_level_that_holds_a_volume_is_found_on_a_thick_sliced_grid():
    """A sphere's distance on 1 × 1 × 2 mm voxels: the level whose mesh encloses what the mesh of the sphere
    0.4 mm larger encloses is 0.4 mm (bisection to 10⁻⁴ of the volume); a volume out of a voxel's reach is not
    chased (0)."""
    from NeuralRaycastLib.train.evaluate import enclosed_ml, extract_surface, level_for_volume

    ras, affine = grid()
    radius = np.linalg.norm(ras, axis=-1)
    target = enclosed_ml(*extract_surface(radius - 10.4, affine))
    assert level_for_volume(radius - 10.0, affine, target) == pytest.approx(0.4, abs=0.005)
    assert level_for_volume(radius - 10.0, affine, enclosed_ml(*extract_surface(radius - 9.7, affine))) == \
        pytest.approx(-0.3, abs=0.005)
    assert level_for_volume(radius - 10.0, affine, 2.0 * target) == 0.0
