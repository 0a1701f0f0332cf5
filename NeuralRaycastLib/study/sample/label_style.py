"""Labels as people (and networks) draw them, for samples and tests.

A generated lesion's label map is the exact voxelisation of a smooth shape. Real segmentations are not:
they are drawn slice by slice, so each slice's outline is shifted and wobbles a little against its
neighbours; thresholds and brushes leave specks and small holes; a slice is skipped or drawn twice; thick
slices (1 × 1 × 5 mm, say) stair-step; partial volume adds one-voxel rims in patches. :func:`draw_like_people`
applies these to a label map, seeded, so a test knows what it asked for, and on the phantom the exact
surface underneath is still known.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LabelStyle:
    """How a label map is drawn. Zero everywhere: exactly as given."""

    name: str = "clean"
    jitter_voxels: float = 0.0  # each slice's outline shifted in-plane by about this much (standard deviation)
    wobble: float = 0.0  # the fraction of slices whose outline is grown or shrunk by one voxel
    specks: int = 0  # isolated blobs of one to a few voxels scattered around each structure
    holes: int = 0  # small holes punched inside each structure
    missing_slices: float = 0.0  # fraction of the structure's slices left undrawn
    doubled_slices: float = 0.0  # fraction drawn as a copy of the slice before
    slice_mm: float | None = None  # labels drawn on slices this thick (then repeated on the grid's slices)
    rims: float = 0.0  # fraction of the boundary given a one-voxel partial-volume rim, in patches


STYLES = {
    "clean": LabelStyle(),
    "ragged": LabelStyle("ragged", jitter_voxels=0.6, wobble=0.3, specks=12, holes=3, missing_slices=0.03,
                         doubled_slices=0.03, rims=0.15),
    "thick": LabelStyle("thick", jitter_voxels=0.6, wobble=0.3, specks=12, holes=3, slice_mm=5.0, rims=0.15),
}


def style_named(name: str) -> LabelStyle:
    if name not in STYLES:
        raise ValueError(f"unknown label style '{name}' (choose from {', '.join(STYLES)})")
    return STYLES[name]


def draw_like_people(labels: np.ndarray, spacing, style: LabelStyle, seed: int = 0) -> np.ndarray:
    """``labels`` (I, J, K, integer) as ``style`` draws them, slices along the axis of the thickest voxels (K
    where all are equal). The result has the same shape, dtype and label values."""
    if style == STYLES["clean"]:
        return labels.copy()
    rng = np.random.default_rng(seed)
    spacing = np.asarray(spacing, np.float64)
    axis = int(np.argmax(spacing)) if np.ptp(spacing) > 1e-6 else 2
    drawn = np.moveaxis(labels, axis, 0).copy()  # slices first
    present = np.flatnonzero(drawn.reshape(len(drawn), -1).any(axis=1))
    if present.size == 0:
        return labels.copy()
    if style.slice_mm:
        drawn = _thick_slices(drawn, max(1, round(style.slice_mm / float(spacing[axis]))))
    for index in present:
        drawn[index] = _draw_slice(drawn[index], style, rng)
    drawn = _skip_and_double(drawn, present, style, rng)
    drawn = _specks_and_holes(drawn, style, rng)
    return np.ascontiguousarray(np.moveaxis(drawn, 0, axis)).astype(labels.dtype, copy=False)


def _thick_slices(slices: np.ndarray, every: int) -> np.ndarray:
    """Each run of ``every`` slices takes its middle slice's labels: what thick slices stair-step to."""
    out = slices.copy()
    for start in range(0, len(slices), every):
        out[start:start + every] = slices[min(start + every // 2, len(slices) - 1)]
    return out


def _draw_slice(slice_: np.ndarray, style: LabelStyle, rng: np.random.Generator) -> np.ndarray:
    """One slice's outline shifted in-plane, grown or shrunk by a voxel, and given rims in patches; what the
    outline gains takes the label of the nearest labelled voxel, so nested labels stay nested."""
    from scipy import ndimage

    out = slice_
    if style.jitter_voxels:
        shift = np.round(rng.normal(0.0, style.jitter_voxels, 2)).astype(int)
        out = ndimage.shift(out, shift, order=0, mode="constant", cval=0)
    inside = out > 0
    if not inside.any():
        return out
    if style.wobble and rng.random() < style.wobble:
        if rng.random() < 0.5:
            out = _grown(out, ndimage.binary_dilation(inside) & ~inside)
        else:
            out = np.where(ndimage.binary_erosion(inside), out, 0)
        inside = out > 0
    if style.rims and inside.any():
        edge = ndimage.binary_dilation(inside) & ~inside
        patches = ndimage.gaussian_filter(rng.random(out.shape), 2.0)
        out = _grown(out, edge & (patches > np.quantile(patches[edge], 1.0 - style.rims)))
    return out


def _grown(labels: np.ndarray, added: np.ndarray) -> np.ndarray:
    """``labels`` with the voxels ``added`` given the label of their nearest labelled voxel."""
    from scipy import ndimage

    if not added.any():
        return labels
    nearest = ndimage.distance_transform_edt(labels == 0, return_distances=False, return_indices=True)
    out = labels.copy()
    out[added] = labels[tuple(index[added] for index in nearest)]
    return out


def _skip_and_double(slices: np.ndarray, present: np.ndarray, style: LabelStyle,
                     rng: np.random.Generator) -> np.ndarray:
    """Some of the structure's slices left undrawn, some drawn as a copy of the one before."""
    out = slices.copy()
    inner = present[1:-1]  # never the first or last slice: a structure keeps its extent
    for index in inner:
        roll = rng.random()
        if roll < style.missing_slices:
            out[index] = 0
        elif roll < style.missing_slices + style.doubled_slices:
            out[index] = out[index - 1]
    return out


def _specks_and_holes(slices: np.ndarray, style: LabelStyle, rng: np.random.Generator) -> np.ndarray:
    """Specks of each label scattered near its structure, and small holes punched inside it."""
    out = slices.copy()
    shape = np.asarray(out.shape)
    for value in np.unique(slices[slices > 0]):
        where = np.argwhere(slices == value)
        low, high = where.min(axis=0), where.max(axis=0)
        margin = np.maximum((high - low) // 4, 3)
        for _ in range(style.specks):
            centre = rng.integers(np.maximum(low - margin, 0), np.minimum(high + margin, shape - 1) + 1)
            out[_blob(centre, rng, shape)] = value
        for _ in range(style.holes):
            centre = where[rng.integers(len(where))]
            patch = out[_blob(centre, rng, shape)]  # a view: emptied where it holds this label
            patch[patch == value] = 0
    return out


def _blob(centre: np.ndarray, rng: np.random.Generator, shape: np.ndarray) -> tuple[slice, ...]:
    """One to two voxels along each axis around ``centre``, inside the grid."""
    size = rng.integers(1, 3, 3)
    start = np.clip(centre, 0, shape - size)
    return tuple(slice(int(s), int(s + n)) for s, n in zip(start, size, strict=True))
