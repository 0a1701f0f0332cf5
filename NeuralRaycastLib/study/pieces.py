"""A structure's connected pieces: drawn labels hold specks and fragments, which a smooth learned surface
may leave out; they are counted and listed (size and place) so that nothing is smoothed away unsaid."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..grid import voxel_ml


@dataclass(frozen=True)
class Piece:
    voxels: int
    volume_ml: float
    centre_ras: tuple[float, float, float]  # mm, the piece's centre of mass

    def as_dict(self) -> dict:
        return {"voxels": self.voxels, "volume_ml": self.volume_ml, "centre_ras": list(self.centre_ras)}


def label_pieces(mask: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray, list[Piece]]:
    """The 26-connected pieces of ``mask``, largest first, and the map of them (0 outside, i + 1 inside the
    i-th piece of the list). The work is done on the mask's bounding box: a tumour is small beside the grid."""
    from scipy import ndimage

    pieces_map = np.zeros(mask.shape, np.int32)
    if not mask.any():
        return pieces_map, []
    spans = [np.flatnonzero(mask.any(axis=tuple(other for other in range(3) if other != axis))) for axis in range(3)]
    box = tuple(slice(int(span[0]), int(span[-1]) + 1) for span in spans)
    found, count = ndimage.label(mask[box], structure=np.ones((3, 3, 3), bool))
    indices = np.arange(1, count + 1)
    sizes = np.bincount(found.ravel(), minlength=count + 1)[1:]
    centres = np.asarray(ndimage.center_of_mass(mask[box], found, indices), np.float64).reshape(count, 3)
    centres += [s.start for s in box]
    affine = np.asarray(affine, np.float64)
    voxel = voxel_ml(affine)
    order = np.argsort(-sizes, kind="stable")
    renumber = np.zeros(count + 1, np.int32)
    renumber[order + 1] = np.arange(1, count + 1)
    pieces_map[box] = renumber[found]
    ras = np.c_[centres, np.ones(count)] @ affine.T
    pieces = [Piece(int(sizes[piece]), float(sizes[piece] * voxel),
                    tuple(round(float(v), 2) for v in ras[piece, :3]))  # type: ignore[arg-type]
              for piece in order]
    return pieces_map, pieces
