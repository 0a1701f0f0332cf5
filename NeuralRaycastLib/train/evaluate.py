"""How good a trained field is: its pictures against the reference renderer, its geometry against the
segmentation.

Geometry, per structure k:
- Dice of {s_k < 0} against the structure's voxels (the labels; the sign of B_k where there are none),
  on the study's grid;
- surface distance: the learned surface (marching cubes of s_k on the grid) is measured against the
  segmentation's (|B_k| at its vertices) and the segmentation's surface against the learned field
  (|s_k| at the vertices of B_k's zero level); the mean and the 95th percentile of both together;
- volume: the label's (its voxels, what a clinician measures from the label map) and the learned surface's
  (the volume its mesh encloses), and their difference in %;
- pieces: the label's connected pieces, and those the learned surface keeps (holds a voxel of) or drops,
  each dropped one with its size and where it is, so that nothing is smoothed away unsaid;
- where the surfaces the labels were drawn from are known (the phantom), the learned surface's distance to
  them: what no label-based figure can tell, since the labels themselves are off by up to a voxel or more.
"""

from __future__ import annotations

import numpy as np

from ..field.field import NeuralField
from ..grid import sample_at, voxel_ml
from ..mesh.mesh import extract_surface, resample_sdf
from ..study.pieces import label_pieces
from ..study.preprocess import PreparedStudy, structure_mask


def learned_distances(field: NeuralField, prepared: PreparedStudy) -> np.ndarray:
    """s_k on the study's voxel centres, (K, I, J, K)."""
    return resample_sdf(field.distances, prepared.affine, prepared.study.shape)


def dice(a: np.ndarray, b: np.ndarray) -> float:
    """2|A ∩ B| / (|A| + |B|) of two masks; 1 where both are empty (they agree: nothing on either side)."""
    total = int(a.sum()) + int(b.sum())
    return 1.0 if total == 0 else 2.0 * int(np.logical_and(a, b).sum()) / total


def shown(value: float | None, spec: str) -> str:
    """A metric for people: formatted by ``spec``, or "–" where it is missing."""
    return "–" if value is None else format(value, spec)


def geometry_metrics(field: NeuralField, prepared: PreparedStudy) -> dict[str, dict[str, float | None]]:
    """Per structure name: ``dice``, ``mean_surface_distance_mm``, ``hd95_mm``. The distances are None
    (missing) where the learned surface or the segmentation's has no vertices: there is no distance between
    a surface and nothing, and a number there would read as a result."""
    learned = learned_distances(field, prepared)
    results: dict[str, dict[str, float | None]] = {}
    for k, structure in enumerate(prepared.structures):
        if prepared.study.labels is not None or structure.from_mask:
            truth = structure_mask(structure, prepared.study.labels, prepared.mask)
        else:
            truth = prepared.boundary[k] < 0
        learned_vertices, _ = extract_surface(learned[k], prepared.affine)
        truth_vertices, _ = extract_surface(prepared.boundary[k], prepared.affine)
        mean = hd95 = None
        if len(learned_vertices) and len(truth_vertices):
            both = np.concatenate([np.abs(sample_at(prepared.boundary[k], prepared.affine, learned_vertices)),
                                   np.abs(field.distances(truth_vertices)[:, k])])
            mean, hd95 = float(np.mean(both)), float(np.percentile(both, 95))
        results[structure.name] = {
            "dice": dice(learned[k] < 0, truth),
            "mean_surface_distance_mm": mean,
            "hd95_mm": hd95,
            **volumes(truth, learned[k], prepared.affine),
            **pieces(truth, learned[k] < 0, prepared.affine),
            **exact_surface_distances(prepared.study.exact_surfaces, structure.name, learned_vertices),
        }
    return results


def exact_surface_distances(exact_surfaces: str | None, name: str, vertices: np.ndarray) -> dict[str, float]:
    """``exact_mean_distance_mm`` and ``exact_hd95_mm``: how far the vertices of a learned surface lie from the
    exact surface of structure ``name`` (the phantom's signed distances are exact, so ``|sdf|`` at a vertex is
    its distance); nothing where the exact surfaces are not known or the surface is empty."""
    if exact_surfaces != "phantom" or not len(vertices):
        return {}
    from ..study.sample.phantom import Phantom

    phantom = Phantom()
    if name not in phantom.structure_names:
        return {}
    distance = np.abs(phantom.sdf(name, vertices))
    return {"exact_mean_distance_mm": float(distance.mean()), "exact_hd95_mm": float(np.percentile(distance, 95))}


def volumes(truth: np.ndarray, learned: np.ndarray, affine: np.ndarray) -> dict[str, float | None]:
    """``label_volume_ml`` (the label's voxels), ``learned_volume_ml`` (what the learned surface, the zero level
    of ``learned`` on the grid, encloses) and ``volume_difference_percent`` (learned against label; None where
    the label is empty)."""
    label = float(truth.sum()) * voxel_ml(affine)
    vertices, faces = extract_surface(learned, affine)
    enclosed = 0.0
    if len(faces):
        a, b, c = (vertices[faces[:, i]] for i in range(3))
        enclosed = abs(float(np.einsum("ij,ij->i", a, np.cross(b, c)).sum() / 6.0)) / 1000.0
    return {"label_volume_ml": label, "learned_volume_ml": enclosed,
            "volume_difference_percent": 100.0 * (enclosed - label) / label if label > 0 else None}


def pieces(truth: np.ndarray, learned_inside: np.ndarray, affine: np.ndarray) -> dict[str, object]:
    """The label's connected pieces (26-connected): ``label_pieces`` in all, ``pieces_kept`` (the learned
    surface holds a voxel of them) and ``pieces_dropped``: one entry per dropped piece with its ``voxels``,
    ``volume_ml`` and ``centre_ras`` (mm), largest first."""
    found, listed = label_pieces(truth, affine)
    if not listed:
        return {"label_pieces": 0, "pieces_kept": 0, "pieces_dropped": []}
    kept = np.zeros(len(listed) + 1, bool)
    kept[np.unique(found[learned_inside & (found > 0)])] = True
    dropped = [piece.as_dict() for index, piece in enumerate(listed, start=1) if not kept[index]]
    return {"label_pieces": len(listed), "pieces_kept": int(kept.sum()), "pieces_dropped": dropped}
