"""A structure's connected pieces: drawn labels hold specks and fragments, which a smooth learned surface
may leave out; they are counted and listed (size and place) so that nothing is smoothed away unsaid. And a
mask's holes: what is outside it but enclosed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..grid import voxel_box_slices, voxel_ml


@dataclass(frozen=True)
class Piece:
    voxels: int
    volume_ml: float
    centre_ras: tuple[float, float, float]  # mm, the piece's centre of mass

    def as_dict(self) -> dict:
        return {"voxels": self.voxels, "volume_ml": self.volume_ml, "centre_ras": list(self.centre_ras)}

    @classmethod
    def from_dict(cls, data: dict) -> Piece:
        """The piece :meth:`as_dict` gave."""
        centre = tuple(float(v) for v in data["centre_ras"])
        return cls(int(data["voxels"]), float(data["volume_ml"]), centre)  # type: ignore[arg-type]


def label_pieces(mask: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray, list[Piece]]:
    """The 26-connected pieces of ``mask``, largest first, and the map of them (0 outside, i + 1 inside the
    i-th piece of the list). The work is done on the mask's bounding box: a tumour is small beside the grid."""
    from scipy import ndimage

    pieces_map = np.zeros(mask.shape, np.int32)
    if not mask.any():
        return pieces_map, []
    box = voxel_box_slices(mask)
    found, count = ndimage.label(mask[box], structure=np.ones((3, 3, 3), bool))
    sizes = np.bincount(found.ravel(), minlength=count + 1)[1:]
    centres = _centres_of_mass(found, sizes)
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


def _centres_of_mass(found: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The voxel centre of mass of each piece numbered in ``found`` (``sizes``: their voxel counts), as
    ``ndimage.center_of_mass`` gives it, from each piece's voxel count in each slice along each axis: one count
    per slice instead of a weighted sum over every voxel for each axis. The sums are of whole numbers, exact in
    float64, so the centres are the same."""
    count = len(sizes)
    centres = np.empty((count, 3), np.float64)
    for axis in range(3):
        if count == 1:  # one piece (a brain, most structures): the slices' counts of what is not background
            others = tuple(a for a in range(3) if a != axis)
            moment = np.array([0, (np.count_nonzero(found, axis=others) * np.arange(found.shape[axis])).sum()])
        else:
            slices = np.moveaxis(found, axis, 0)
            moment = np.zeros(count + 1, np.int64)
            for index in range(1, len(slices)):  # slice 0 adds nothing
                moment += index * np.bincount(slices[index].ravel(), minlength=count + 1)
        centres[:, axis] = moment[1:].astype(np.float64) / sizes.astype(np.float64)
    return centres


def pieces_of(pieces_map: np.ndarray, count: int, chosen: list[int]) -> np.ndarray:
    """The voxels of the ``chosen`` pieces (indices into :func:`label_pieces`' list of ``count`` pieces) of its
    ``pieces_map``."""
    selected = np.zeros(count + 1, bool)
    selected[np.asarray(chosen, np.int64) + 1] = True
    return selected[pieces_map]


def fill_holes(mask: np.ndarray) -> np.ndarray:
    """``scipy.ndimage.binary_fill_holes`` with its default (face) connectivity, by one labelling of what is
    outside the mask instead of dilating from the border until nothing changes: what outside is not
    connected to the grid's faces is a hole."""
    from scipy import ndimage

    background, _ = ndimage.label(~mask)
    faces = [background[[0, -1]], background[:, [0, -1]], background[:, :, [0, -1]]]
    reaches_a_face = np.zeros(int(background.max()) + 1, bool)
    for face in faces:
        reaches_a_face[face.ravel()] = True
    reaches_a_face[0] = False  # the mask itself
    return ~reaches_a_face[background]
