"""How good a trained field is: its pictures against the reference renderer, its geometry against the
segmentation.

Geometry, per structure k:
- Dice of {s_k < 0} against the structure's voxels (the labels; the sign of B_k where there are none),
  on the study's grid;
- surface distance: the learned surface (marching cubes of s_k on the grid) is measured against the
  segmentation's (|B_k| at its vertices) and the segmentation's surface against the learned field
  (|s_k| at the vertices of B_k's zero level); the mean and the 95th percentile of both together.
"""

from __future__ import annotations

import numpy as np

from ..field.field import NeuralField
from ..grid import sample_at
from ..mesh.mesh import extract_surface, resample_sdf
from ..study.preprocess import PreparedStudy, structure_mask


def learned_distances(field: NeuralField, prepared: PreparedStudy) -> np.ndarray:
    """s_k on the study's voxel centres, (K, I, J, K)."""
    return resample_sdf(field.distances, prepared.affine, prepared.study.shape)


def dice(a: np.ndarray, b: np.ndarray) -> float:
    """2|A ∩ B| / (|A| + |B|) of two masks; 1 where both are empty (they agree: nothing on either side)."""
    total = int(a.sum()) + int(b.sum())
    return 1.0 if total == 0 else 2.0 * int(np.logical_and(a, b).sum()) / total


def geometry_metrics(field: NeuralField, prepared: PreparedStudy) -> dict[str, dict[str, float]]:
    """Per structure name: ``dice``, ``mean_surface_distance_mm``, ``hd95_mm``."""
    learned = learned_distances(field, prepared)
    results: dict[str, dict[str, float]] = {}
    for k, structure in enumerate(prepared.structures):
        if prepared.study.labels is not None or structure.from_mask:
            truth = structure_mask(structure, prepared.study.labels, prepared.mask)
        else:
            truth = prepared.boundary[k] < 0
        learned_vertices, _ = extract_surface(learned[k], prepared.affine)
        truth_vertices, _ = extract_surface(prepared.boundary[k], prepared.affine)
        distances = []
        if len(learned_vertices):
            distances.append(np.abs(sample_at(prepared.boundary[k], prepared.affine, learned_vertices)))
        if len(truth_vertices):
            distances.append(np.abs(field.distances(truth_vertices)[:, k]))
        both = np.concatenate(distances) if distances else np.array([np.inf])
        results[structure.name] = {
            "dice": dice(learned[k] < 0, truth),
            "mean_surface_distance_mm": float(np.mean(both)),
            "hd95_mm": float(np.percentile(both, 95)) if distances else float("inf"),  # not inf - inf
        }
    return results
