"""Labels as drawn: a noisy observation of a smooth surface.

A label map drawn by a person or a network is ragged: slice outlines shifted against each other, specks and
small holes, skipped or doubled slices, stair steps from thick slices. The surface through every voxel of such a
label (marching cubes, even after Slicer's smoothing) follows all of it. Here:

- pieces smaller than a size the user sets are left out of the surface, or kept apart as separate small
  surfaces, and holes that small are filled; each is listed (:class:`LabelNote`), never dropped unsaid;
- a label whose voxels disagree with its own lightly smoothed surface more often than an exact voxelisation
  of a smooth shape does, or any label on thick slices, is taken as drawn: its surface is the zero level of
  its signed distance smoothed over about a voxel in-plane and half a slice across thick slices
  (:func:`smoothing_mm`), levelled so that it holds as many voxels as the label (the volume clinicians
  measure is kept).

A label that is the exact voxelisation of a smooth shape passes unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..grid import voxel_box_slices
from .order_statistics import neighbouring_order_statistics
from .pieces import Piece, fill_holes, label_pieces, pieces_of
from .slabs import gaussian_reach, in_slabs

#: Pieces (and holes) of a label smaller than this many millilitres are left out of its surface by default:
#: specks of a few voxels, which no smooth surface at the study's resolution holds.
MIN_PIECE_ML = 0.1
#: Above this many voxels on the other side of its surface smoothed over :data:`PROBE_VOXELS`, as a fraction of
#: its boundary voxels, a label is taken as drawn (see :func:`disagreement`): exact voxelisations of smooth
#: shapes, small cavities and thin shells among them, stay below 0.04; drawn labels reach 0.07 and more.
DRAWN_DISAGREEMENT = 0.05
#: The smoothing (Gaussian σ, voxels) that probes a label's raggedness: too light to move a smooth surface
#: across a voxel centre, enough to move a ragged one.
PROBE_VOXELS = 0.8
#: Slices this many times thicker than the finest spacing or more: a label on them is always taken as drawn. Its
#: stair steps are the slicing's, not the structure's, and on slices that thick a ragged outline cannot be told
#: from the slope between slices.
THICK_SLICES = 2.0


@dataclass
class LabelNote:
    """What was done to one structure's label before its surface was taken."""

    left_out: list[Piece] = field(default_factory=list)  # small pieces not in the surface
    kept_apart: list[Piece] = field(default_factory=list)  # small pieces kept as surfaces of their own
    holes_filled: list[Piece] = field(default_factory=list)
    drawn: bool = False  # smoothed as a drawn label
    disagreement: float = 0.0  # the fraction that decided it

    def as_dict(self) -> dict:
        return {"left_out": [p.as_dict() for p in self.left_out],
                "kept_apart": [p.as_dict() for p in self.kept_apart],
                "holes_filled": [p.as_dict() for p in self.holes_filled],
                "drawn": self.drawn, "disagreement": round(self.disagreement, 4)}

    @classmethod
    def from_dict(cls, data: dict) -> LabelNote:
        def pieces(key: str) -> list[Piece]:
            return [Piece.from_dict(piece) for piece in data.get(key, [])]

        return cls(pieces("left_out"), pieces("kept_apart"), pieces("holes_filled"), bool(data.get("drawn", False)),
                   float(data.get("disagreement", 0.0)))


def check_min_piece_ml(value: object) -> float:
    """``value`` as a minimum piece size, or ValueError saying what it must be."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
        raise ValueError(f"the minimum piece size must be a number of millilitres of at least 0 (got {value!r})")
    return float(value)


def split_small_pieces(mask: np.ndarray, affine: np.ndarray, min_piece_ml: float
                       ) -> tuple[np.ndarray, np.ndarray, list[Piece]]:
    """``mask`` as (its pieces of at least ``min_piece_ml``, the smaller ones, the list of the smaller ones).
    The largest piece always stays, whatever its size: a structure is never emptied."""
    found, pieces = label_pieces(mask, affine)
    small = [index for index, piece in enumerate(pieces) if index > 0 and piece.volume_ml < min_piece_ml]
    if not small:
        return mask, np.zeros_like(mask), []
    small_mask = pieces_of(found, len(pieces), small)
    return mask & ~small_mask, small_mask, [pieces[index] for index in small]


def fill_small_holes(mask: np.ndarray, affine: np.ndarray, min_piece_ml: float) -> tuple[np.ndarray, list[Piece]]:
    """``mask`` with its holes (what is outside it but enclosed, face-connected) smaller than
    ``min_piece_ml`` filled, and the list of them. Only the mask's bounding box is searched."""
    if not mask.any() or min_piece_ml <= 0:
        return mask, []
    box = voxel_box_slices(mask)
    holes = np.zeros(mask.shape, bool)
    holes[box] = fill_holes(mask[box]) & ~mask[box]
    found, pieces = label_pieces(holes, affine)
    fill = [index for index, piece in enumerate(pieces) if piece.volume_ml < min_piece_ml]
    if not fill:
        return mask, []
    return mask | pieces_of(found, len(pieces), fill), [pieces[index] for index in fill]


def smoothing_mm(spacing: np.ndarray) -> np.ndarray:
    """The smoothing (Gaussian σ, mm, per axis) of a drawn label: a voxel of the finest axis, and half a slice
    along thicker ones, where the outlines of neighbouring slices were drawn apart."""
    spacing = np.asarray(spacing, np.float64)
    return np.maximum(spacing.min(), 0.5 * spacing)


def smoothed_label(sdf: np.ndarray, inside: np.ndarray, sigma_voxels: np.ndarray) -> np.ndarray:
    """The voxel signed distance ``sdf`` of the mask ``inside`` smoothed by a Gaussian of ``sigma_voxels``,
    shifted so that exactly as many voxels are below zero as ``inside`` holds (the label's volume is kept)."""
    from scipy import ndimage

    sigma = np.asarray(sigma_voxels, np.float64)
    smooth = in_slabs(lambda slab: ndimage.gaussian_filter(slab, sigma, mode="nearest"), np.asarray(sdf, np.float32),
                      gaussian_reach(sigma[0]), np.float32)
    count = int(inside.sum())
    flat = smooth.ravel()
    if count <= 0 or count >= flat.size:
        return smooth
    below, above = neighbouring_order_statistics(flat, count - 1)
    smooth -= np.float32(0.5 * (float(below) + float(above)))
    return smooth


def disagreement(sdf: np.ndarray, inside: np.ndarray) -> float:
    """The voxels of the mask ``inside`` (``sdf``: its voxel signed distance) that its surface smoothed over
    :data:`PROBE_VOXELS` puts on the other side, as a fraction of its boundary voxels (those with a face
    neighbour on the other side): its raggedness, whatever the spacing."""
    smooth = smoothed_label(sdf, inside, np.full(3, PROBE_VOXELS))
    boundary = boundary_voxel_count(inside)
    return float(((smooth < 0) != inside).sum()) / boundary if boundary else 0.0


def boundary_voxel_count(inside: np.ndarray) -> int:
    """The voxels of ``inside``'s face-connected dilation that its erosion leaves out (scipy's, whose border
    counts as outside): those with a face neighbour on the other side, and the inside ones on the grid's faces.
    Counted from each axis's neighbour differences, without the two morphological passes."""
    edge = np.zeros(inside.shape, bool)
    for axis in range(inside.ndim):
        before = [slice(None)] * inside.ndim
        after = [slice(None)] * inside.ndim
        before[axis], after[axis] = slice(None, -1), slice(1, None)
        differs = inside[tuple(before)] != inside[tuple(after)]
        edge[tuple(before)] |= differs
        edge[tuple(after)] |= differs
        for face in (0, -1):  # the grid's border counts as outside
            side = [slice(None)] * inside.ndim
            side[axis] = face
            edge[tuple(side)] |= inside[tuple(side)]
    return int(np.count_nonzero(edge))


def is_drawn(share: float, spacing: np.ndarray) -> bool:
    """Whether a label whose :func:`disagreement` is ``share`` on a grid of ``spacing`` is taken as drawn."""
    spacing = np.asarray(spacing, np.float64)
    return share > DRAWN_DISAGREEMENT or float(spacing.max()) >= THICK_SLICES * float(spacing.min())


def tidy_label(mask: np.ndarray, affine: np.ndarray, min_piece_ml: float = MIN_PIECE_ML,
               keep_small_pieces: bool = False) -> tuple[np.ndarray, np.ndarray | None, LabelNote]:
    """(the label whose surface is taken, its small pieces kept apart or None, the note listing what was
    done): pieces and holes below ``min_piece_ml`` are left out and filled; ``keep_small_pieces`` keeps the
    small pieces as surfaces of their own instead."""
    large, small, pieces = split_small_pieces(mask, affine, min_piece_ml)
    large, holes = fill_small_holes(large, affine, min_piece_ml)
    if keep_small_pieces:
        return large, small if pieces else None, LabelNote(kept_apart=pieces, holes_filled=holes)
    return large, None, LabelNote(left_out=pieces, holes_filled=holes)
