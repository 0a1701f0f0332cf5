"""How good a trained field is: its pictures against the reference renderer, its geometry against the
segmentation.

Geometry, per structure k:
- Dice of {s_k < 0} against the structure's voxels (the labels; the sign of B_k where there are none),
  on the study's grid;
- surface distance: the learned surface (marching cubes of s_k on the grid) is measured against the
  segmentation's (|B_k| at its vertices) and the segmentation's surface against the learned field
  (|s_k| at the vertices of B_k's zero level); the mean and the 95th percentile of both together;
- volume: the label's (the voxels of the pieces its surface keeps, what a clinician measures from the label
  map; small pieces left out are counted apart) and the learned surface's (the volume its mesh encloses), and
  their difference in %. A drawn label's learned surface is taken at the level of s_k that holds the label's
  volume (:func:`volume_levels`), here and in the meshes exported;
- pieces: the label's connected pieces, and those the learned surface keeps (holds a voxel of) or drops,
  each dropped one with its size and where it is, so that nothing is smoothed away unsaid;
- where the surfaces the labels were drawn from are known (the phantom), the learned surface's distance to
  them: what no label-based figure can tell, since the labels themselves are off by up to a voxel or more;
  and what the exact surface itself scores against the label (:func:`ceilings`): the most a faithful surface
  can score on a drawn label.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..field.field import NeuralField
from ..grid import sample_at, voxel_box, voxel_ml
from ..mesh.mesh import extract_surface, resample_sdf
from ..study.drawn_labels import split_small_pieces
from ..study.pieces import label_pieces
from ..study.preprocess import PreparedStudy, structure_mask
from ..study.structures import Structure


def learned_distances(field: NeuralField, prepared: PreparedStudy) -> np.ndarray:
    """s_k on the study's voxel centres, (K, I, J, K), each drawn label's levelled to hold its volume
    (:func:`volume_levels`): the learned surfaces as evaluated, meshed and exported."""
    return learned_surfaces(field, prepared)[0]


def learned_surfaces(field: NeuralField, prepared: PreparedStudy) -> tuple[np.ndarray, list[float]]:
    """(:func:`learned_distances`, the level taken off each s_k)."""
    learned = resample_sdf(field.distances, prepared.affine, prepared.study.shape)
    levels = volume_levels(learned, prepared)
    for k, level in enumerate(levels):
        if level:
            learned[k] -= np.float32(level)
    return learned, levels


def kept_label(structure: Structure, prepared: PreparedStudy) -> np.ndarray:
    """The structure's label less the small pieces left out of its surface (``label_notes``): the voxels
    whose volume its surface is to hold. Small pieces kept apart are kept."""
    truth = structure_mask(structure, prepared.study.labels, prepared.mask)
    note = prepared.label_notes.get(structure.name)
    if note is None or not note.left_out:
        return truth
    return split_small_pieces(truth, prepared.affine, prepared.min_piece_ml)[0]


def volume_levels(learned: np.ndarray, prepared: PreparedStudy) -> list[float]:
    """Per structure, the level (mm) of s_k whose surface encloses the volume of its kept label
    (:func:`kept_label`, voxels × voxel volume, as Slicer's segment statistics count it); 0 for labels not
    taken as drawn and for the brain mask. A drawn label's surface is smoothed, and its mesh on the study's grid
    cuts the caps between thick slices: without this its volume falls short of the label's by several per cent."""
    levels = [0.0] * len(prepared.structures)
    for k, structure in enumerate(prepared.structures):
        note = prepared.label_notes.get(structure.name)
        if note is not None and note.drawn and not structure.from_mask and prepared.study.labels is not None:
            target = float(kept_label(structure, prepared).sum()) * voxel_ml(prepared.affine)
            levels[k] = level_for_volume(learned[k], prepared.affine, target)
    return levels


def enclosed_ml(vertices: np.ndarray, faces: np.ndarray) -> float:
    """The volume (ml) a closed mesh encloses (divergence theorem)."""
    if not len(faces):
        return 0.0
    a, b, c = (vertices[faces[:, i]] for i in range(3))
    return abs(float(np.einsum("ij,ij->i", a, np.cross(b, c)).sum() / 6.0)) / 1000.0


#: The volume :func:`level_for_volume` settles for, relative to its target: far below any figure reported.
LEVEL_VOLUME_TOLERANCE = 1e-4


def level_for_volume(sdf: np.ndarray, affine: np.ndarray, target_ml: float) -> float:
    """The level c (mm) at which the marching-cubes surface of ``sdf`` on its grid encloses ``target_ml``:
    bisection on c, which the enclosed volume grows with, within a voxel of the finest spacing either way (a
    drawn label's surface is levelled to its voxel count already; what is left is the mesh's). 0 where the
    surface is empty or the target is not reached within that."""
    reach = float(np.linalg.norm(np.asarray(affine, np.float64)[:3, :3], axis=0).min())
    near = sdf < reach
    if target_ml <= 0 or not (sdf < 0).any() or near.all():
        return 0.0
    first, last = voxel_box(near)  # only the structure's box is searched
    box = tuple(slice(max(lo - 1, 0), hi + 2) for lo, hi in zip(first, last, strict=True))
    crop, moved = sdf[box], np.array(affine, np.float64)
    moved[:3, 3] += moved[:3, :3] @ np.array([b.start for b in box], np.float64)
    volume = lambda level: enclosed_ml(*extract_surface(crop - np.float32(level), moved))  # noqa: E731
    low, high = -reach, reach
    if not volume(low) <= target_ml <= volume(high):
        return 0.0
    level = 0.0
    for _ in range(40):
        level = 0.5 * (low + high)
        found = volume(level)
        if abs(found - target_ml) <= LEVEL_VOLUME_TOLERANCE * target_ml:
            break
        low, high = (level, high) if found < target_ml else (low, level)
    return level


def dice(a: np.ndarray, b: np.ndarray) -> float:
    """2|A ∩ B| / (|A| + |B|) of two masks; 1 where both are empty (they agree: nothing on either side)."""
    total = int(a.sum()) + int(b.sum())
    return 1.0 if total == 0 else 2.0 * int(np.logical_and(a, b).sum()) / total


def shown(value: float | None, spec: str) -> str:
    """A metric for people: formatted by ``spec``, or "–" where it is missing."""
    return "–" if value is None else format(value, spec)


def structure_labels(prepared: PreparedStudy, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Structure ``k``'s label as segmented, and the pieces of it a surface keeps (both the inside of its
    boundary map where the study has no label for it)."""
    structure = prepared.structures[k]
    if prepared.study.labels is not None or structure.from_mask:
        return structure_mask(structure, prepared.study.labels, prepared.mask), kept_label(structure, prepared)
    inside = prepared.boundary[k] < 0
    return inside, inside


def geometry_metrics(field: NeuralField, prepared: PreparedStudy) -> dict[str, dict[str, float | None]]:
    """Per structure name: ``dice``, ``mean_surface_distance_mm``, ``hd95_mm``, the volumes (:func:`volumes`),
    ``volume_level_mm`` (:func:`volume_levels`), the pieces (:func:`pieces`) and, on the phantom, the distances
    to the exact surface and the ceilings (:func:`ceilings`). The distances are None (missing) where the learned
    surface or the segmentation's has no vertices: there is no distance between a surface and nothing, and a
    number there would read as a result."""
    learned, levels = learned_surfaces(field, prepared)
    results: dict[str, dict[str, float | None]] = {}
    for k, structure in enumerate(prepared.structures):
        truth, kept = structure_labels(prepared, k)
        learned_vertices, _ = extract_surface(learned[k], prepared.affine)
        distances = lambda points, k=k: field.distances(points)[:, k] - levels[k]  # noqa: E731
        figures = surface_figures(learned[k], distances, truth, kept, prepared.boundary[k], prepared.affine)
        results[structure.name] = {
            **figures,
            "volume_level_mm": levels[k],
            **pieces(truth, learned[k] < 0, prepared.affine),
            **exact_surface_distances(prepared.study.exact_surfaces, structure.name, learned_vertices),
            **ceilings(prepared, structure.name, truth, kept, prepared.boundary[k], figures["dice"]),
        }
    return results


def surface_figures(sdf: np.ndarray, distances: Callable[[np.ndarray], np.ndarray], truth: np.ndarray,
                    kept: np.ndarray, boundary: np.ndarray, affine: np.ndarray) -> dict[str, float | None]:
    """``dice`` of {``sdf`` < 0} against the label ``truth``, the surface distances both ways between its zero
    level and the label's boundary map's (``distances``: the same field at RAS points, off the grid), and the
    volumes (:func:`volumes`, against the ``kept`` label)."""
    vertices, _ = extract_surface(sdf, affine)
    truth_vertices, _ = extract_surface(boundary, affine)
    mean = hd95 = None
    if len(vertices) and len(truth_vertices):
        both = np.concatenate([np.abs(sample_at(boundary, affine, vertices)), np.abs(distances(truth_vertices))])
        mean, hd95 = float(np.mean(both)), float(np.percentile(both, 95))
    return {"dice": dice(sdf < 0, truth), "mean_surface_distance_mm": mean, "hd95_mm": hd95,
            **volumes(kept, sdf, affine, truth)}


def ceilings(prepared: PreparedStudy, name: str, truth: np.ndarray, kept: np.ndarray, boundary: np.ndarray,
             learned_dice: float) -> dict[str, float | None]:
    """Where the surfaces the labels were drawn from are known (the phantom), what the exact surface itself
    scores against the label, figured as the learned one is: ``ceiling_dice``, ``ceiling_hd95_mm`` and
    ``ceiling_volume_difference_percent``, and ``dice_of_ceiling``, the learned Dice as a fraction of the
    ceiling. A drawn label is a noisy copy of its surface: no faithful surface scores above the exact one by
    more than chance, so a Dice bound on such a label means something only against this."""
    if prepared.study.exact_surfaces != "phantom":
        return {}
    from ..study.sample.phantom import Phantom

    phantom = Phantom()
    if name not in phantom.structure_names:
        return {}
    exact = lambda points: phantom.sdf(name, points)  # noqa: E731
    grid = resample_sdf(exact, prepared.affine, prepared.study.shape)[0]
    figures = surface_figures(grid, exact, truth, kept, boundary, prepared.affine)
    return {"ceiling_dice": figures["dice"], "ceiling_hd95_mm": figures["hd95_mm"],
            "ceiling_volume_difference_percent": figures["volume_difference_percent"],
            "dice_of_ceiling": learned_dice / figures["dice"] if figures["dice"] else None}


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


def volumes(truth: np.ndarray, learned: np.ndarray, affine: np.ndarray, drawn: np.ndarray | None = None
            ) -> dict[str, float | None]:
    """``label_volume_ml`` (the voxels of ``truth``: the label's pieces kept in its surface, voxels × voxel
    volume as Slicer's segment statistics count), ``left_out_volume_ml`` (the voxels of the label as ``drawn``
    that ``truth`` leaves out: small pieces, listed by ``label_notes``; 0 where not given), ``learned_volume_ml``
    (what the learned surface, the zero level of ``learned`` on the grid, encloses) and
    ``volume_difference_percent`` (learned against label; None where the label is empty)."""
    voxel = voxel_ml(affine)
    label = float(truth.sum()) * voxel
    left_out = 0.0 if drawn is None else float((drawn & ~truth).sum()) * voxel
    enclosed = enclosed_ml(*extract_surface(learned, affine))
    return {"label_volume_ml": label, "left_out_volume_ml": left_out, "learned_volume_ml": enclosed,
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
