"""From a checked study to what the field is trained on.

- channels normalised robustly (percentiles inside the head/brain mask map to 0 and 1),
- the brain (or head) mask, given or found by thresholding, and from it the context structure ``brain``,
- boundary maps ``B_k(x)``: signed distance to structure k in millimetres, negative inside,
  anisotropic spacing respected,
- the tumour probability ``P(x)`` (given, or a smooth step across the whole-tumour boundary),
- an occupancy grid and a RAS bounding box of where anything is (for empty-space skipping).

The expensive part (distance transforms) is cached on disk, keyed by a hash of the inputs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..array_cache import read_entry, write_entry_behind
from ..grid import voxel_box
from ..paths import cache_folder
from ..progress import Progress
from .drawn_labels import (
    MIN_PIECE_ML,
    LabelNote,
    check_min_piece_ml,
    disagreement,
    is_drawn,
    smoothed_label,
    smoothing_mm,
    tidy_label,
)
from .order_statistics import percentile
from .pieces import fill_holes
from .slabs import in_slabs, slab_edges
from .structures import BRAIN, Structure, make_structures
from .study import Study, StudyError, map_in_threads

#: Bump when anything below changes what is cached.
PREPROCESS_VERSION = 9
#: Windowed-sinc smoothing of a mask's surface before distances are taken, with the iterations and pass
#: band of Slicer's closed-surface default (smoothing factor 0.5: 20 iterations, pass band 10⁻²).
SURFACE_SMOOTHING_ITERATIONS = 20
SURFACE_SMOOTHING_PASSBAND = 0.01
#: Boundary-map values within this many voxels of the surface are exact distances to the smoothed mesh.
EXACT_BAND_VOXELS = 3.0
#: Within this distance of a structure's voxels (and at least two voxels beyond the band) its boundary map is
#: exact; further out, where the geometry fit (truncated at 10 mm) only asks which side, it is a lower bound
#: of the distance, which the renderer may step by.
EXACT_REACH_MM = 20.0
NORMALISE_PERCENTILES = (0.5, 99.5)
OCCUPANCY_BLOCK = 8
#: Iterations of the face-connected closing that joins a thresholded head mask's pieces.
CLOSING_ITERATIONS = 2



@dataclass(frozen=True)
class StudyOutline:
    """What a prepared study's field is sized by, known long before its boundary maps: the study (as prepared:
    downsampled where asked), its structures and the box around its mask. :class:`PreparedStudy` answers the same
    names, so whatever takes an outline takes a prepared study too."""

    study: Study
    structures: list[Structure]
    bounds: np.ndarray  # (2, 3) RAS mm box around the mask

    @property
    def spacing(self) -> np.ndarray:
        return self.study.spacing

    @property
    def channel_names(self) -> list[str]:
        return self.study.channel_names


@dataclass
class PreparedStudy:
    """Everything derived from a study; arrays indexed ``[i, j, k]`` like the study's."""

    study: Study
    channels: np.ndarray  # (C, I, J, K) float32, normalised
    channel_names: list[str]
    structures: list[Structure]
    boundary: np.ndarray  # (S, I, J, K) float32, signed distance in mm, negative inside
    probability: np.ndarray  # (I, J, K) float32 in [0, 1]
    mask: np.ndarray  # (I, J, K) bool, brain (or head) mask
    occupancy: np.ndarray  # (ceil(I/b), ceil(J/b), ceil(K/b)) bool
    occupancy_block: int
    bounds: np.ndarray  # (2, 3) RAS mm box around the mask
    key: str = ""  # digest of the inputs it was prepared from ("" if unknown): names derived caches
    # per structure: small pieces left out or kept apart, holes filled, taken as drawn (drawn_labels.py)
    label_notes: dict[str, LabelNote] = field(default_factory=dict)
    min_piece_ml: float = MIN_PIECE_ML

    @property
    def affine(self) -> np.ndarray:
        return self.study.affine

    @property
    def spacing(self) -> np.ndarray:
        return self.study.spacing

    def structure_index(self, name: str) -> int:
        return [s.name for s in self.structures].index(name)


def import_map_libraries() -> None:
    """Import what the brain mask and the boundary maps compute with (scipy, scikit-image, edt, pykdtree, the
    surface distances): a second or more on a first run, which a caller can spend while it does something else
    (``fit`` imports them in a thread while it reads the study). scikit-image loads a submodule when one of its
    names is first read, so the names are read here: the brain mask's threshold would otherwise import its
    module on the maps' longest way."""
    import scipy.ndimage  # noqa: F401
    from skimage.filters import threshold_otsu  # noqa: F401
    from skimage.measure import marching_cubes  # noqa: F401

    from ..mesh import mesh, surface_distance  # noqa: F401

    with contextlib.suppress(ImportError):  # scipy's transform is the fallback (_distance_transform)
        import edt  # noqa: F401
    with contextlib.suppress(ImportError):  # scipy's tree is the fallback (surface_distance.nearest_neighbours)
        import pykdtree.kdtree  # noqa: F401


def channel_range(image: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    """The 0.5th and 99.5th percentiles of a channel inside ``mask`` (outliers do not move them), the values
    :func:`normalise_channel` maps to 0 and 1; a flat channel gets a range of 1."""
    values = image[mask] if mask.any() else image.ravel()
    low, high = (float(percentile(values, q)) for q in NORMALISE_PERCENTILES)
    if high - low <= 1e-12 * max(1.0, abs(high)):
        high = low + 1.0
    return low, high


def normalise_channel(image: np.ndarray, mask: np.ndarray, out: np.ndarray | None = None,
                      value_range: tuple[float, float] | None = None) -> np.ndarray:
    """Map the channel's :func:`channel_range` (or ``value_range``, computed before) to 0 and 1; float32,
    written into ``out`` if given (a slice of the stacked channels: no extra copy)."""
    low, high = value_range or channel_range(image, mask)
    scaled = np.empty(image.shape, np.float32) if out is None else out
    np.subtract(image, low, out=scaled, casting="unsafe")  # float32 from here: half the traffic of float64
    scaled *= 1.0 / (high - low)
    return scaled


def head_mask(channels: dict[str, np.ndarray], labels: np.ndarray | None = None) -> np.ndarray:
    """The brain (skull-stripped data) or head: Otsu threshold, closed, holes filled, largest component; with
    ``labels``, their voxels added."""
    mask = _thresholded_head(channels)
    if labels is not None:
        mask |= labels > 0
    return mask


def _thresholded_head(channels: dict[str, np.ndarray]) -> np.ndarray:
    """:func:`head_mask` without the labels: one face-connected piece without holes (or nothing), as
    :func:`~.drawn_labels.tidy_label` would leave it (see :func:`_brain_mask_and_tidiness`)."""
    from scipy import ndimage

    images = list(channels.values())
    scales = map_in_threads(lambda image: float(percentile(image, 99.0)) or float(image.max()) or 1.0, images)
    combined = _scaled_maximum(images, scales)
    mask = combined > _otsu_threshold(combined)
    if mask.any():
        # Closed, filled and chosen on the box around what is above the threshold and a few voxels more: the
        # closing reaches CLOSING_ITERATIONS voxels, so all beyond stays outside, as on the whole grid. The
        # closing's dilations and erosions reach that far each, so its slabs take twice that on either side.
        box = _widened_box(mask, CLOSING_ITERATIONS + 1)
        face = ndimage.generate_binary_structure(3, 1)
        inner = in_slabs(lambda slab: ndimage.binary_closing(slab, structure=face, iterations=CLOSING_ITERATIONS),
                         mask[box], 2 * CLOSING_ITERATIONS, bool)
        inner = fill_holes(inner)
        components, count = ndimage.label(inner)
        if count > 1:
            sizes = np.bincount(components.ravel())
            sizes[0] = 0
            inner = components == int(np.argmax(sizes))
        mask = np.zeros(mask.shape, bool)
        mask[box] = inner
    return mask


def _otsu_threshold(values: np.ndarray, bins: int = 256) -> float:
    """scikit-image's ``threshold_otsu(values)``, its histogram counted in slabs in threads (a histogram's
    threshold: neither the shape nor the order matters, so a NIfTI's data is not copied into C order)."""
    from skimage.filters import threshold_otsu

    flat = values.ravel(order="K")
    low, high = (flat.min(), flat.max())
    if low == high:  # one value: threshold_otsu gives it
        return low
    # the counts of np.histogram over the whole, whose range is (min, max) and whose edges are the same
    edges = np.histogram(flat[:1], bins=bins, range=(low, high))[1]
    parts = np.linspace(0, flat.size, min(os.cpu_count() or 1, 64) + 1).astype(int)
    counts = sum(map_in_threads(lambda part: np.histogram(flat[parts[part]:parts[part + 1]], bins=bins,
                                                          range=(low, high))[0], range(len(parts) - 1)))
    return threshold_otsu(hist=(counts, (edges[:-1] + edges[1:]) / 2.0))


def _scaled_maximum(images: list[np.ndarray], scales: list[float]) -> np.ndarray:
    """The largest of ``image / scale`` over the channels, voxel by voxel, in the type and memory order the
    division gives, computed in slabs (along the axis that keeps each slab contiguous) in threads: the brain mask
    waits for it, and the boundary maps for the mask."""
    dtype = np.result_type(*(np.asarray(image.flat[0]) / scale for image, scale in zip(images, scales, strict=True)))
    fortran = images[0].flags.f_contiguous and not images[0].flags.c_contiguous
    combined = np.empty(images[0].shape, dtype, order="F" if fortran else "C")
    axis = len(combined.shape) - 1 if fortran else 0
    edges = np.linspace(0, combined.shape[axis], min(os.cpu_count() or 1, combined.shape[axis]) + 1).astype(int)

    def slab(part: int) -> None:
        where = (slice(None),) * axis + (slice(int(edges[part]), int(edges[part + 1])),)
        out = combined[where]
        np.divide(images[0][where], scales[0], out=out)
        for image, scale in zip(images[1:], scales[1:], strict=True):
            np.maximum(out, image[where] / scale, out=out)

    map_in_threads(slab, range(len(edges) - 1))
    return combined


def _widened_box(mask: np.ndarray, margin: int) -> tuple[slice, ...]:
    """A non-empty mask's bounding box widened by ``margin`` voxels each way, within the grid."""
    low, high = voxel_box(mask)
    return tuple(slice(max(int(lo) - margin, 0), min(int(hi) + margin + 1, n))
                 for lo, hi, n in zip(low, high, mask.shape, strict=True))


def signed_distance(inside: np.ndarray, spacing: np.ndarray, smooth_surface: bool = True,
                    name: str = "a mask", note: LabelNote | None = None, detect_drawn: bool = True,
                    gpu: Any = None) -> np.ndarray:
    """Signed distance in mm to the boundary of a voxel mask; negative inside (``name``: what the mask is,
    for the error a mask without a boundary raises).

    A voxel mask only says which voxel centres are inside, so its surface is terraced. The boundary
    taken here is the mask's marching-cubes surface after a windowed-sinc low-pass filter, the kind
    Slicer's closed-surface conversion applies (the terraces go, smooth surfaces do not shrink), each
    closed piece then moved to agree with the mask (the filter closes small cavities). Within
    ``EXACT_BAND_VOXELS`` of it the distance is the exact distance to that smoothed mesh; further out,
    where nothing is fitted closely, the Euclidean distance transform of the mask (shortened by half a
    voxel, since the boundary lies halfway between inside and outside voxel centres) stands in for it.
    The transform is taken only over the mask's box widened by ``EXACT_REACH_MM``: every voxel that near
    the mask gets it exactly; beyond, where the fit only asks which side and the renderer how far it may
    step, a lower bound of it (see :func:`_far_field`).

    A Gaussian on the distance map, the obvious alternative, also removes the terraces but moves every
    curved surface inwards by about σ²/R (on the phantom at 2 mm: 0.2 mm for the whole tumour, 0.25 mm
    for the core). ``smooth_surface=False`` gives the unsmoothed transform.

    A drawn label (ragged, stair-stepped; see :mod:`.drawn_labels`) is not followed voxel by voxel: its
    surface is the zero level of its smoothed, volume-kept distance, and the mask its voxels below it. ``note``
    is told whether the label was taken as drawn; ``detect_drawn=False`` follows every label as it is.

    ``gpu``: an open device (gpu/device.py's GpuContext) to take the distance transforms on, or None for the
    processor's (see :func:`_distance_transform`).
    """
    spacing = np.asarray(spacing, dtype=np.float64)
    if not inside.any() or inside.all():
        state = "is empty (no voxel inside)" if not inside.any() else "fills the whole volume (no voxel outside)"
        raise StudyError(f"cannot compute a signed distance for {name}: the mask {state} on the "
                         f"{'×'.join(map(str, inside.shape))} grid, so it has no surface")
    low, high = voxel_box(inside)
    reach = max(EXACT_REACH_MM, (EXACT_BAND_VOXELS + 2.0) * float(spacing.max()))
    margin = np.ceil(reach / spacing).astype(int)
    crop = tuple(slice(max(lo - m, 0), min(hi + m + 1, n))
                 for lo, hi, m, n in zip(low, high, margin, inside.shape, strict=True))
    box = inside[crop]
    origin = np.array([c.start for c in crop])
    # The label's own surface is smoothed while the transforms run. A drawn label's is not used; its smoothed
    # surface then takes the second worker instead of waiting for the first.
    with ThreadPoolExecutor(2) as pool:
        surface = pool.submit(_smoothed_surface, box, spacing, origin) if smooth_surface else None
        sdf = _voxel_signed_distance(box, spacing, low - origin, high - origin, gpu)
        if surface is not None and detect_drawn:
            share = disagreement(sdf, box)
            drawn = is_drawn(share, spacing)
            if note is not None:
                note.disagreement, note.drawn = share, drawn
            if drawn:  # its smoothed surface, and the voxels inside that
                surface.cancel()
                smoothed = smoothed_label(sdf, box, smoothing_mm(spacing) / spacing)
                box = smoothed < 0
                low, high = (corner + origin for corner in voxel_box(box))
                sdf = _voxel_signed_distance(box, spacing, low - origin, high - origin, gpu)
                surface = pool.submit(_contour_surface, smoothed, spacing, origin)
        if surface is not None:
            _smooth_near_surface(sdf, box, spacing, origin, *surface.result(), gpu=gpu)
    out = np.empty(inside.shape, np.float32)
    out[crop] = sdf
    _far_field(out, crop, low, high, spacing)
    return out


def _distance_transform(outside: np.ndarray, spacing: np.ndarray, gpu: Any = None) -> np.ndarray:
    """Euclidean distance in mm (float32) from each voxel of ``outside`` to the nearest voxel that is not in it
    (0 there): with ``gpu``, the exact transform on the device (study/device_distance.py), the same values to
    float32 rounding, where it fits the device's memory budget and the device takes it (a device that refuses
    it is said once, and the maps are made here); else the exact transform of the ``edt`` package on all cores,
    anisotropic spacing respected, or, where that package is not installed (a Slicer that could not reach the
    package index), scipy's exact transform of the same values on one core."""
    if gpu is not None:
        from .device_distance import device_distance_transform

        distance = device_distance_transform(gpu, outside, spacing)
        if distance is not None:
            return distance
    try:
        import edt
    except ImportError:
        return _scipy_distance_transform(outside, spacing)
    distance = edt.edt(np.ascontiguousarray(outside), anisotropy=tuple(float(s) for s in spacing),
                       black_border=False, parallel=os.cpu_count() or 1)
    return distance.astype(np.float32, copy=False)


def _scipy_distance_transform(outside: np.ndarray, spacing: np.ndarray) -> np.ndarray:
    """:func:`_distance_transform` by scipy: its feature transform, measured in float32 (its own distances
    would take a (3, I, J, K) float64 array)."""
    from scipy import ndimage

    features = ndimage.distance_transform_edt(outside, sampling=spacing, return_distances=False,
                                              return_indices=True)
    return _feature_distance(features, spacing)


def _feature_distance(features: np.ndarray, spacing: np.ndarray) -> np.ndarray:
    """Length in mm (float32) from each voxel to the voxel its feature transform (3, I, J, K) names, one
    axis at a time (no (3, I, J, K) array of coordinates, no float64)."""
    total = np.zeros(features.shape[1:], np.float32)
    step = np.empty(features.shape[1:], np.float32)
    for axis in range(3):
        index = np.arange(features.shape[axis + 1], dtype=np.int32).reshape([-1 if a == axis else 1 for a in range(3)])
        np.subtract(features[axis], index, out=step, casting="unsafe")
        step *= np.float32(spacing[axis])
        step *= step
        total += step
    return np.sqrt(total, out=total)


def _voxel_signed_distance(box: np.ndarray, spacing: np.ndarray, low: np.ndarray, high: np.ndarray,
                           gpu: Any = None) -> np.ndarray:
    """The mask's Euclidean distance transform both ways, shortened by half a voxel, negative inside, exact
    over the box: it holds every inside voxel (``low``..``high``), the nearest one of each outside voxel, and
    the inside transform is taken over those and one voxel beyond, where the nearest outside voxel of each
    inside one lies. The two transforms run in threads, on ``gpu`` where given (the ``edt`` package holds the
    interpreter while it runs, so there its two follow each other, each on all cores)."""
    half = np.float32(0.5 * float(spacing.min()))
    near = tuple(slice(max(lo - 1, 0), min(hi + 2, n)) for lo, hi, n in zip(low, high, box.shape, strict=True))
    sdf, inside_distance = map_in_threads(lambda outside: _distance_transform(outside, spacing, gpu),
                                           [~box, box[near]])
    sdf -= half
    sdf[near] = np.where(box[near], half - inside_distance, sdf[near])
    return sdf


def _smoothed_surface(inside: np.ndarray, spacing: np.ndarray, origin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mask's marching-cubes surface after the windowed-sinc filter, in mm from the grid's first voxel
    (``inside``'s first voxel is ``origin`` of the grid): (vertices, faces)."""
    return _contour_surface(0.5 - inside.astype(np.float32), spacing, origin)


def _contour_surface(volume: np.ndarray, spacing: np.ndarray, origin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The zero level of ``volume`` (marching cubes) after the windowed-sinc filter, in mm from the grid's
    first voxel (``volume``'s first voxel is ``origin`` of the grid): (vertices, faces)."""
    from ..mesh.mesh import extract_surface
    from ..mesh.surface_distance import smooth_surface

    scaled = np.diag([*spacing, 1.0])  # distances do not depend on the grid's orientation or origin
    scaled[:3, 3] = origin * spacing
    vertices, faces = extract_surface(volume, scaled)
    return smooth_surface(vertices, faces, SURFACE_SMOOTHING_ITERATIONS, SURFACE_SMOOTHING_PASSBAND), faces


def _smooth_near_surface(sdf: np.ndarray, inside: np.ndarray, spacing: np.ndarray, origin: np.ndarray,
                         vertices: np.ndarray, faces: np.ndarray, gpu: Any = None) -> None:
    """Within ``EXACT_BAND_VOXELS`` of the surface, replace ``sdf`` (of the mask ``inside``, whose first voxel
    is ``origin`` of the grid) by the exact distance to the mask's smoothed surface (``vertices``, ``faces``;
    see :func:`signed_distance`); the distances to the mesh on ``gpu`` where given (study/device_distance.py)."""
    from ..mesh.surface_distance import (
        agree_with_labels,
        candidate_search,
        candidates_after_move,
        mesh_distance_floor,
        mesh_pieces,
    )

    def mesh_distances(vertices: np.ndarray, faces: np.ndarray, points: np.ndarray,
                       nearest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        from ..mesh import surface_distance

        if gpu is not None:
            from .device_distance import device_mesh_distances

            found = device_mesh_distances(gpu, vertices, faces, points, nearest)
            if found is not None:
                return found
        return surface_distance.mesh_distances(vertices, faces, points, nearest)

    voxel = float(spacing.min())
    with ThreadPoolExecutor(1) as pool:  # the mesh's pieces are found while the searches run on every core
        found = pool.submit(mesh_pieces, len(vertices), faces)
        band = np.abs(sdf) <= EXACT_BAND_VOXELS * float(spacing.max())
        points = (_voxels_of(band) + origin) * spacing
        nearest, centroid_distances = candidate_search(vertices, faces, points)
        # Where the pieces move is decided by the points within a voxel of them (balanced_level leaves out the
        # rest), so only the points the mesh may come that near are measured first (the margin: rounding).
        deciding = np.flatnonzero(mesh_distance_floor(vertices, faces, centroid_distances[:, 0])
                                  < voxel * (1.0 + 1e-9))
        near_exact, closest = mesh_distances(vertices, faces, points[deciding], nearest[deciding])
        pieces = found.result()
    moved = agree_with_labels(vertices, faces, points[deciding], _in_band(inside, band)[deciding], near_exact, voxel,
                              faces[closest, 0], pieces)
    if not np.array_equal(moved, vertices):
        # One piece moves as a whole, keeping which triangles are near a point; pieces moved by different
        # amounts may change which piece is nearest, so the candidates of the points near two are searched again.
        if pieces.max() > 0:
            nearest = candidates_after_move(vertices, moved, faces, points, nearest, centroid_distances[:, -1],
                                            pieces)
        exact = mesh_distances(moved, faces, points, nearest)[0]
    else:  # nothing moved: the other points are measured to the same mesh
        exact = np.empty(len(points), np.float64)
        exact[deciding] = near_exact
        others = np.ones(len(points), bool)
        others[deciding] = False
        exact[others] = mesh_distances(vertices, faces, points[others], nearest[others])[0]
    # The smoothed surface stays within a voxel of the terraced one: a sign that disagrees with
    # the mask further in than that would be a fault of the sign test, never of the surface.
    voxel = _in_band(sdf, band)
    trusted = (np.sign(exact) == np.sign(voxel)) | (np.abs(voxel) < float(spacing.max()))
    _set_in_band(sdf, band, np.where(trusted, exact, voxel))


def _voxels_of(mask: np.ndarray) -> np.ndarray:
    """``np.argwhere(mask)`` (the same rows in the same order), slab by slab in threads."""
    edges = slab_edges(len(mask), 0)
    if len(edges) == 2:
        return np.argwhere(mask)
    parts = map_in_threads(lambda part: np.argwhere(mask[edges[part]:edges[part + 1]]), range(len(edges) - 1))
    for part, start in zip(parts, edges, strict=False):
        part[:, 0] += start
    return np.concatenate(parts)


def _band_slabs(band: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The slabs of ``band`` (:func:`~.slabs.slab_edges`) and where each one's voxels begin among all of its."""
    edges = slab_edges(len(band), 0)
    counts = map_in_threads(lambda part: np.count_nonzero(band[edges[part]:edges[part + 1]]), range(len(edges) - 1))
    return edges, np.concatenate([[0], np.cumsum(counts)]).astype(int)


def _in_band(volume: np.ndarray, band: np.ndarray) -> np.ndarray:
    """``volume[band]``, slab by slab in threads."""
    edges, offsets = _band_slabs(band)
    out = np.empty(int(offsets[-1]), volume.dtype)

    def gather(part: int) -> None:
        planes = slice(int(edges[part]), int(edges[part + 1]))
        out[offsets[part]:offsets[part + 1]] = volume[planes][band[planes]]

    map_in_threads(gather, range(len(edges) - 1))
    return out


def _set_in_band(volume: np.ndarray, band: np.ndarray, values: np.ndarray) -> None:
    """``volume[band] = values``, slab by slab in threads."""
    edges, offsets = _band_slabs(band)

    def scatter(part: int) -> None:
        planes = slice(int(edges[part]), int(edges[part + 1]))
        volume[planes][band[planes]] = values[offsets[part]:offsets[part + 1]]

    map_in_threads(scatter, range(len(edges) - 1))


def _far_field(out: np.ndarray, crop: tuple[slice, ...], low: np.ndarray, high: np.ndarray,
               spacing: np.ndarray) -> None:
    """Fill ``out`` outside ``crop`` (where nothing is inside) with a lower bound of the distance transform:
    the larger of the distance to the box of inside voxels (``low``..``high``) and the crop's value at the
    nearest crop voxel less the way there. Both never exceed the transform (the second by the triangle
    inequality), and the second meets the crop's values at its faces; the half voxel is taken off as there."""
    half = np.float32(0.5 * float(spacing.min()))
    inner = out[crop]
    axes = []
    for axis, (c, lo, hi, n) in enumerate(zip(crop, low, high, out.shape, strict=True)):
        index = np.arange(n)
        to_box = (np.maximum(lo - index, 0) + np.maximum(index - hi, 0)) * spacing[axis]
        nearest = np.clip(index, c.start, c.stop - 1)
        to_crop = np.abs(index - nearest) * spacing[axis]
        axes.append((to_box.astype(np.float32) ** 2, to_crop.astype(np.float32) ** 2, nearest - c.start))
    for region in _outside_crop(crop, out.shape):
        (bx, cx), (by, cy), (bz, cz) = (
            (b[r][shape], c[r][shape])
            for (b, c, _), r, shape in zip(axes, region, (np.s_[:, None, None], np.s_[None, :, None],
                                                          np.s_[None, None, :]), strict=True))
        # written in place: one temporary of the region's size instead of five
        to_box = out[region]
        np.add(bx + by, bz, out=to_box)
        np.sqrt(to_box, out=to_box)
        to_box -= half
        nearest = _nearest_crop_values(inner, [index[r] for (_, _, index), r in zip(axes, region, strict=True)])
        through_crop = cx + cy + cz
        np.sqrt(through_crop, out=through_crop)
        np.subtract(nearest, through_crop, out=through_crop)
        np.maximum(to_box, through_crop, out=to_box)


def _nearest_crop_values(inner: np.ndarray, indices: list[np.ndarray]) -> np.ndarray:
    """``inner`` at the outer product of ``indices`` (one per axis), an axis whose index is one value throughout
    (the one the region lies beyond) kept at length 1, to be broadcast: gathered an axis at a time, those first,
    instead of a voxel at a time over the whole region."""
    constant = [len(index) > 0 and bool((index == index[0]).all()) for index in indices]
    values = inner
    for axis in sorted(range(len(indices)), key=lambda axis: not constant[axis]):
        values = np.take(values, indices[axis][:1] if constant[axis] else indices[axis], axis=axis)
    return values


def _outside_crop(crop: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """The grid outside ``crop`` as at most six disjoint boxes."""
    regions = []
    for axis in range(3):
        before = tuple(crop[:axis]) + (slice(0, crop[axis].start),) + (slice(None),) * (2 - axis)
        after = tuple(crop[:axis]) + (slice(crop[axis].stop, shape[axis]),) + (slice(None),) * (2 - axis)
        regions += [r for r in (before, after) if r[axis].stop > r[axis].start]
    return regions


def structure_mask(structure: Structure, labels: np.ndarray | None, brain: np.ndarray | None) -> np.ndarray:
    if structure.from_mask:
        assert brain is not None
        return brain
    assert labels is not None
    return np.isin(labels, structure.labels)


def derived_probability(boundary_whole_tumor: np.ndarray, width_mm: float) -> np.ndarray:
    """A smooth P(x) from labels: a logistic step of ``width_mm`` across the whole-tumour surface."""
    return (1.0 / (1.0 + np.exp(np.clip(boundary_whole_tumor / width_mm, -50, 50)))).astype(np.float32)


def occupancy_grid(mask: np.ndarray, block: int = OCCUPANCY_BLOCK) -> np.ndarray:
    """Blocks of ``block``³ voxels that touch the (one-voxel dilated) mask. The dilation is taken on the mask's
    box widened by a voxel: nothing beyond it changes."""
    from scipy import ndimage

    dilated = np.zeros(mask.shape, bool)
    if mask.any():
        box = _widened_box(mask, 1)
        dilated[box] = ndimage.binary_dilation(mask[box], iterations=1)
    pad = [(0, (-n) % block) for n in dilated.shape]
    padded = np.pad(dilated, pad)
    i, j, k = (n // block for n in padded.shape)
    return padded.reshape(i, block, j, block, k, block).any(axis=(1, 3, 5))


def mask_bounds(mask: np.ndarray, affine: np.ndarray, margin_mm: float = 2.0) -> np.ndarray:
    """RAS box around the mask's voxels, widened by half a voxel and ``margin_mm``."""
    first, last = voxel_box(mask)
    low, high = first - 0.5, last + 0.5
    corners = np.array([[*corner, 1.0] for corner in itertools.product(*zip(low, high, strict=True))])
    ras = (corners @ np.asarray(affine).T)[:, :3]
    return np.stack([ras.min(axis=0) - margin_mm, ras.max(axis=0) + margin_mm])


def _array_digest(array: np.ndarray | None) -> bytes:
    """SHA-256 of an array's type, shape and voxels, without copying it (NIfTI data is usually in Fortran
    order, whose transpose is C-contiguous); of "-" for a missing one."""
    if array is None:
        return hashlib.sha256(b"-").digest()
    digest = hashlib.sha256()
    if array.flags.f_contiguous and not array.flags.c_contiguous:
        array = array.T
        digest.update(b"F")
    array = np.ascontiguousarray(array)
    digest.update(f"{array.dtype.str}{array.shape}".encode())
    digest.update(memoryview(array).cast("B"))
    return digest.digest()


def _cache_keys(study: Study, structures: list[Structure], pieces: tuple[float, bool]) -> tuple[str, str]:
    """Digests of everything preparing reads (``pieces``: its minimum piece size and whether small pieces are
    kept apart), the arrays hashed in threads, one each: (maps of the processor's distance transforms, maps of
    the device's). The device's transform rounds differently in float32's last place, so a fresh run's maps can
    differ from the processor's by a float16 step in a few voxels: their entries are kept apart."""
    arrays = [np.asarray(study.affine, np.float64), *study.channels.values()]
    arrays += [study.labels, study.probability, study.brain_mask]
    digest = hashlib.sha256(f"v{PREPROCESS_VERSION}".encode())
    digest.update(repr(list(study.channels)).encode())
    for part in map_in_threads(_array_digest, arrays):
        digest.update(part)
    digest.update(repr([(s.name, s.labels) for s in structures]).encode())
    digest.update(repr(pieces).encode())
    device = digest.copy()
    device.update(b"device distance transform")
    return digest.hexdigest()[:32], device.hexdigest()[:32]


CACHED_ARRAYS = ("boundary", "mask", "probability", "occupancy", "bounds")


#: Prepared studies kept in the cache (the sample at 1 mm takes about 115 MB).
CACHE_ENTRIES = 8


def _load_cached(path: Path, shape: tuple[int, ...], count: int) -> tuple[dict[str, np.ndarray], dict] | None:
    entry = read_entry(path)
    if entry is None:
        return None
    cached, meta = entry
    if any(key not in cached for key in CACHED_ARRAYS):
        return None
    if cached["boundary"].shape != (count, *shape) or cached["mask"].shape != shape:
        return None
    return cached, meta


def _cached_ranges(meta: dict, channels: int) -> list[tuple[float, float]] | None:
    """The channels' normalisation ranges kept with a cache entry (their percentiles over the brain are slow
    to compute at full resolution), or None where the entry has none."""
    ranges = meta.get("channel_ranges")
    try:
        pairs = [(float(low), float(high)) for low, high in ranges]
    except (TypeError, ValueError):
        return None
    return pairs if len(pairs) == channels and all(high > low for low, high in pairs) else None


def _float32_in_threads(stack: np.ndarray) -> np.ndarray:
    """A float32 copy of a (S, ...) stack, one slice per thread (the float16 boundary maps of the cache)."""
    out = np.empty(stack.shape, np.float32)

    def convert(index: int) -> None:
        out[index] = stack[index]

    map_in_threads(convert, range(len(stack)))
    return out


def _store_as_float16(out: np.ndarray, values: np.ndarray) -> None:
    """``out[...] = values.astype(np.float16)``, slab by slab in threads: the brain's map, the last of the longest
    way, is rounded on all cores."""
    edges = slab_edges(len(values), 0)

    def store(part: int) -> None:
        planes = slice(int(edges[part]), int(edges[part + 1]))
        out[planes] = values[planes].astype(np.float16)

    map_in_threads(store, range(len(edges) - 1))


def _normalise_channels(study: Study, mask: np.ndarray, ranges: list[tuple[float, float]] | None,
                        channels: np.ndarray) -> None:
    """Each channel normalised (:func:`normalise_channel`) into its slice of ``channels``, in threads; ``ranges``:
    their ranges computed before, or None."""
    images = list(study.channels.values())
    map_in_threads(lambda index: normalise_channel(images[index], mask, out=channels[index],
                                                   value_range=ranges[index] if ranges else None),
                   range(len(images)))


def prepare(
    study: Study,
    use_cache: bool = True,
    cache_root: Path | None = None,
    progress: Progress | None = None,
    min_piece_ml: float = MIN_PIECE_ML,
    keep_small_pieces: bool = False,
    gpu: Any = None,
    with_outline: Callable[[StudyOutline], object] | None = None,
    before_maps: Callable[[], object] | None = None,
) -> PreparedStudy:
    """Derive everything the field needs from a study (see the module docstring). Pieces of a label smaller
    than ``min_piece_ml`` are left out of its surface (``keep_small_pieces``: kept as surfaces of their own);
    either way they are listed in ``label_notes``.

    ``with_outline`` is called with the study's :class:`StudyOutline` as soon as its mask's box is known (from
    a worker thread where the maps are computed), so a caller can size its work while the maps are still made;
    it should only hand that work on, and return at once. ``before_maps`` is called likewise, from this thread, just
    before the maps are computed (not where the cache holds them): a caller can ready what they take.

    ``gpu``: an open device to take the distance transforms on (the boundary maps' longest part), else the
    processor. A cache entry made either way is used by both (they agree within float32 rounding), the one made
    the same way first, so a run reopened without a device gets the maps it was trained on."""
    check_min_piece_ml(min_piece_ml)
    report = progress or (lambda message, fraction: None)
    structures = make_structures(study.structures, include_brain=True, colors=study.colors)
    keys = _cache_keys(study, structures, (float(min_piece_ml), bool(keep_small_pieces)))
    if gpu is not None:
        keys = keys[::-1]
    root = cache_root or cache_folder("prepared")
    key, entry = keys[0], None
    for candidate in keys if use_cache else ():
        entry = _load_cached(root / candidate, study.shape, len(structures))
        if entry is not None:
            key = candidate
            break
    path = root / key

    channels = np.empty((len(study.channels), *study.shape), np.float32)
    if entry is not None:
        cached, meta = entry
        report("boundary maps loaded from cache", 1.0)
        if with_outline is not None:
            with_outline(StudyOutline(study, structures, cached["bounds"]))
        notes = {name: LabelNote.from_dict(note) for name, note in meta.get("label_notes", {}).items()}
        boundary = _float32_in_threads(cached["boundary"])
        mask = cached["mask"].astype(bool)
        probability = cached["probability"].astype(np.float32)
        occupancy, bounds = cached["occupancy"].astype(bool), cached["bounds"]
        _normalise_channels(study, mask, _cached_ranges(meta, len(study.channels)), channels)
    else:
        if before_maps is not None:
            before_maps()
        derived: dict = {}

        def with_mask(brain: np.ndarray) -> None:  # the channels are normalised while the maps are made
            derived.update(_derived_from_mask(study, brain))
            if with_outline is not None:
                with_outline(StudyOutline(study, structures, derived["bounds"]))
            _normalise_channels(study, brain, derived["ranges"], channels)

        mask, boundary, notes = mask_and_boundary_maps(
            study, structures, report, min_piece_ml, keep_small_pieces, gpu=gpu, with_mask=with_mask,
            with_label_maps=lambda maps: derived.update(probability=_rounded_probability(study, structures, maps)))
        probability, occupancy, bounds = derived["probability"], derived["occupancy"], derived["bounds"]
        if use_cache:
            # Written behind, while the run goes on (nothing changes the maps once prepared): float16 halves the
            # entry, its copies made there, in that thread alone (a process ending at once finishes the entry
            # when no new threads may be asked for).
            write_entry_behind(path, lambda: {"boundary": boundary.astype(np.float16), "mask": mask,
                                              "probability": as_float16(probability), "occupancy": occupancy,
                                              "bounds": bounds},
                               {"channel_ranges": derived["ranges"],
                                "label_notes": {name: note.as_dict() for name, note in notes.items()}},
                               keep=CACHE_ENTRIES)
        report("boundary maps ready", 1.0)

    return PreparedStudy(
        study=study,
        channels=channels,
        channel_names=study.channel_names,
        structures=structures,
        boundary=boundary,
        probability=probability,
        mask=mask,
        occupancy=occupancy,
        occupancy_block=OCCUPANCY_BLOCK,
        bounds=bounds,
        key=key,
        label_notes=notes,
        min_piece_ml=float(min_piece_ml),
    )


def _derived_from_mask(study: Study, mask: np.ndarray) -> dict:
    """The occupancy grid, the RAS bounds and each channel's :func:`channel_range`: what needs the mask alone, so
    it runs while the boundary maps are still being made; one pass over the grid each, all at once in threads."""
    images = list(study.channels.values())
    jobs: list[Callable[[], object]] = [
        lambda: occupancy_grid(mask),
        lambda: mask_bounds(mask, study.affine),
        *(functools.partial(channel_range, image, mask) for image in images),
    ]
    occupancy, bounds, *ranges = map_in_threads(lambda job: job(), jobs)
    return {"occupancy": occupancy, "bounds": bounds, "ranges": ranges}


def _rounded_probability(study: Study, structures: list[Structure], boundary: np.ndarray) -> np.ndarray:
    """P(x) rounded to float16 as the cache keeps it, so cached and fresh runs agree (it reads the maps of the
    structures drawn in the labels only). A derived P(x) is computed only within :data:`_ROUNDS_TO_ZERO_WIDTHS`
    widths of the lesion: beyond, it rounds to 0."""
    lesion = _lesion_boundary(structures, boundary) if study.probability is None else None
    if lesion is None:
        return as_float16(_probability(study, structures, boundary)).astype(np.float32)
    width = float(study.spacing.mean())
    rounded = np.zeros(lesion.shape, np.float32)
    near = lesion / width < _ROUNDS_TO_ZERO_WIDTHS  # the same quotient derived_probability takes
    rounded[near] = as_float16(derived_probability(lesion[near], width)).astype(np.float32)
    return rounded


#: Widths of the smooth step beyond the lesion's surface where P(x) (below 1/(1 + e²⁰) there, 2·10⁻⁹) rounds to 0
#: in float16, whose smallest step is 2⁻²⁴ (6·10⁻⁸).
_ROUNDS_TO_ZERO_WIDTHS = np.float32(20.0)


#: The smallest normal float16 (2⁻¹⁴) and the step of the subnormal ones below it (2⁻²⁴).
_FLOAT16_NORMAL = np.float32(2.0**-14)
_FLOAT16_STEP = np.float32(2.0**-24)


def as_float16(values: np.ndarray) -> np.ndarray:
    """``values.astype(np.float16)`` (float32 values), bit for bit, in a fraction of the time where many lie below
    float16's normal range, as P(x) does away from the tumour: numpy casts those one by one on a slow path. Here
    they are rounded onto the subnormal step, half to even as the cast rounds, and their bits set directly."""
    values = np.asarray(values, np.float32)
    magnitude = np.abs(values)
    small = magnitude < _FLOAT16_NORMAL
    out = np.where(small, np.float32(1.0), values).astype(np.float16)
    # fmin: a NaN is not small, and must not reach the integer cast
    steps = np.rint(np.fmin(magnitude, _FLOAT16_NORMAL) / _FLOAT16_STEP).astype(np.uint16)
    steps |= np.signbit(values).astype(np.uint16) << np.uint16(15)
    np.copyto(out.view(np.uint16), steps, where=small)
    return out


def _brain_mask(study: Study) -> np.ndarray:
    """The study's brain mask, or the head found by thresholding where it has none."""
    return _brain_mask_and_tidiness(study)[0]


def _brain_mask_and_tidiness(study: Study) -> tuple[np.ndarray, bool]:
    """:func:`_brain_mask`, and whether it is known to be tidy: what :func:`~.drawn_labels.tidy_label` leaves as it
    is, listing nothing. The thresholded head is one face-connected piece (so one piece of any connectivity)
    without holes: holes were filled before the largest piece was chosen, and each piece left out touches what
    is outside it, so leaving it out encloses nothing. Labels that add voxels to it may change that."""
    if study.brain_mask is None:
        mask = _thresholded_head(study.channels)
        if study.labels is None:
            return mask, bool(mask.any())
        labelled = study.labels > 0
        tidy = bool(mask.any()) and not (labelled & ~mask).any()
        mask |= labelled
        return mask, tidy
    # given (skull stripping); the labelled structures lie in the brain whatever it says
    mask = study.brain_mask | (study.labels > 0) if study.labels is not None else study.brain_mask.copy()
    return mask, False


def mask_and_boundary_maps(study: Study, structures: list[Structure], report: Progress,
                            min_piece_ml: float = MIN_PIECE_ML, keep_small_pieces: bool = False, *,
                            gpu: Any = None, with_mask: Callable[[np.ndarray], object] | None = None,
                            with_label_maps: Callable[[np.ndarray], object] | None = None,
                            ) -> tuple[np.ndarray, np.ndarray, dict[str, LabelNote]]:
    """The brain mask, every structure's signed distance (S, I, J, K), rounded to float16 as the cache keeps
    them (cached and fresh runs agree), and each structure's :class:`LabelNote` (see :func:`prepare` for the
    pieces). The structures run in threads, those drawn in the labels from the start, while the mask is found:
    the brain's, the largest surface, waits for the mask and is the longest way through, so it should meet as
    little of the others' work as can be (the ``edt`` transform and marching cubes hold the interpreter while
    they run). Progress is reported from this thread, and the first error in structure order is raised.

    What needs only part of this work runs beside the rest, off that longest way: ``with_mask`` (given the
    mask) as soon as the mask is found, ``with_label_maps`` (given the maps) once the maps of every structure
    but the brain are done; their errors are raised after the structures'. ``gpu``: where the distance
    transforms are taken (see :func:`signed_distance`)."""
    boundary = np.empty((len(structures), *study.shape), dtype=np.float32)
    notes: dict[str, LabelNote] = {}

    def compute(index: int, brain: np.ndarray | None, tidy: bool = False) -> None:
        structure = structures[index]
        name = _structure_name(study, structure)
        if tidy:  # nothing to leave out or fill (see _brain_mask_and_tidiness)
            mask, apart, note = structure_mask(structure, study.labels, brain), None, LabelNote()
        else:
            mask, apart, note = tidy_label(structure_mask(structure, study.labels, brain), study.affine,
                                           min_piece_ml, keep_small_pieces)
        distance = signed_distance(mask, study.spacing, name=name, note=note, gpu=gpu)
        if apart is not None:  # small pieces as drawn, each a surface of its own
            np.minimum(distance, signed_distance(apart, study.spacing, name=name, detect_drawn=False, gpu=gpu),
                       out=distance)
        _store_as_float16(boundary[index], distance)
        notes[structure.name] = note

    report("brain mask", 0.0)
    futures: dict[int, Future] = {}
    beside: list[Future] = []
    # a thread for each job: the brain's, submitted last, must not wait in the queue behind the others
    workers = len(structures) + (with_mask is not None) + (with_label_maps is not None)
    with ThreadPoolExecutor(workers) as pool:
        try:
            for index, structure in enumerate(structures):
                if not structure.from_mask:
                    futures[index] = pool.submit(compute, index, None)
            mask, tidy = _brain_mask_and_tidiness(study)
            for index, structure in enumerate(structures):
                if structure.from_mask:
                    futures[index] = pool.submit(compute, index, mask, tidy)
            if with_mask is not None:
                beside.append(pool.submit(with_mask, mask))
            report(f"signed distances: {', '.join(s.name for s in structures)}", 1.0 / (len(structures) + 1))
            labelled = {futures[i] for i, s in enumerate(structures) if s.name != BRAIN}  # what P(x) reads
            if with_label_maps is not None and not labelled:
                beside.append(pool.submit(with_label_maps, boundary))
            pending, count = set(futures.values()), 0
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for _ in done:
                    count += 1
                    report(f"signed distances: {count} of {len(structures)} structures",
                           (count + 1) / (len(structures) + 1))
                if with_label_maps is not None and labelled and all(future.done() for future in labelled):
                    if all(future.exception() is None for future in labelled):  # else its error is raised below
                        beside.append(pool.submit(with_label_maps, boundary))
                    labelled = set()
            wait(beside)
        except BaseException:  # a stop, or no mask: start no more of them
            for future in [*futures.values(), *beside]:
                future.cancel()
            raise
    for index in sorted(futures):
        futures[index].result()
    for future in beside:
        future.result()
    return mask, boundary, {s.name: notes[s.name] for s in structures}


def _structure_name(study: Study, structure: Structure) -> str:
    """A structure as an error names it: its label values and file, or where its brain mask came from."""
    if structure.from_mask:
        where = study.sources.get("brain mask") if study.brain_mask is not None else None
        return f"structure '{structure.name}' ({where or 'the brain mask found by thresholding the images'})"
    return f"structure '{structure.name}' (labels {list(structure.labels)} of {study.sources.get('labels', 'labels')})"


def _probability(study: Study, structures: list[Structure], boundary: np.ndarray) -> np.ndarray:
    if study.probability is not None:
        return study.probability.astype(np.float32)
    lesion = _lesion_boundary(structures, boundary)
    if lesion is None:
        return np.zeros(study.shape, dtype=np.float32)
    return derived_probability(lesion, float(study.spacing.mean()))


def _lesion_boundary(structures: list[Structure], boundary: np.ndarray) -> np.ndarray | None:
    """The boundary map a derived P(x) steps across: the whole tumour's, or for custom structures the union of all
    of them ("the lesion"); None where there are none."""
    names = [s.name for s in structures]
    if "whole_tumor" in names:
        return boundary[names.index("whole_tumor")]
    label_structures = [i for i, s in enumerate(structures) if s.name != BRAIN]
    return boundary[label_structures].min(axis=0) if label_structures else None
