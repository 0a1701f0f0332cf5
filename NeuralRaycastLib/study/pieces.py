"""A structure's connected pieces: drawn labels hold specks and fragments, which a smooth learned surface
may leave out; they are counted and listed (size and place) so that nothing is smoothed away unsaid."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Piece:
    voxels: int
    volume_ml: float
    centre_ras: tuple[float, float, float]  # mm, the piece's centre of mass

    def as_dict(self) -> dict:
        return {"voxels": self.voxels, "volume_ml": self.volume_ml, "centre_ras": list(self.centre_ras)}


def label_pieces(mask: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray, list[Piece]]:
    """The 26-connected pieces of ``mask``, largest first, and the map of them (0 outside, i + 1 inside the
    i-th piece of the list)."""
    from scipy import ndimage

    found, count = ndimage.label(mask, structure=np.ones((3, 3, 3), bool))
    if count == 0:
        return found, []
    indices = np.arange(1, count + 1)
    sizes = np.bincount(found.ravel(), minlength=count + 1)[1:]
    centres = ndimage.center_of_mass(mask, found, indices)
    affine = np.asarray(affine, np.float64)
    voxel_ml = abs(float(np.linalg.det(affine[:3, :3]))) / 1000.0
    order = np.argsort(-sizes, kind="stable")
    renumber = np.zeros(count + 1, found.dtype)
    renumber[order + 1] = np.arange(1, count + 1)
    pieces = []
    for piece in order:
        ras = affine @ np.append(np.asarray(centres[piece], np.float64), 1.0)
        pieces.append(Piece(int(sizes[piece]), float(sizes[piece] * voxel_ml),
                            tuple(round(float(v), 2) for v in ras[:3])))  # type: ignore[arg-type]
    return renumber[found], pieces
