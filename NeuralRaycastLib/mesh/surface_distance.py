"""Signed distances to the smoothed surface of a voxel mask, in numpy and scipy alone.

A mask's marching-cubes surface is terraced; a low-pass filter on the mesh (windowed sinc, after Taubin,
Zhang and Golub, "Optimal surface smoothing as filter design") removes the terraces without shrinking
what is smooth. The boundary maps are exact distances to that mesh near it (``preprocess.py``). Kept
free of VTK so studies can be prepared wherever numpy runs.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
from scipy import sparse
from scipy.sparse import csgraph
from scipy.spatial import cKDTree


def _neighbour_average(vertex_count: int, faces: np.ndarray) -> sparse.csr_matrix:
    """W: each vertex to the mean of its edge neighbours (the umbrella operator)."""
    first = np.concatenate([faces[:, 0], faces[:, 1], faces[:, 2]])
    second = np.concatenate([faces[:, 1], faces[:, 2], faces[:, 0]])
    rows, cols = np.concatenate([first, second]), np.concatenate([second, first])
    adjacency = sparse.coo_matrix((np.ones(len(rows)), (rows, cols)), shape=(vertex_count, vertex_count)).tocsr()
    adjacency.data[:] = 1.0  # an edge shared by two triangles counts once
    degree = np.asarray(adjacency.sum(axis=1)).ravel()
    return sparse.diags(1.0 / np.maximum(degree, 1.0)) @ adjacency


@lru_cache(maxsize=8)  # the same filter serves every structure of a study
def _sinc_coefficients(iterations: int, passband: float) -> np.ndarray:
    """Chebyshev coefficients of a Hamming-windowed sinc low-pass filter whose gain is 1 at ``passband``.

    The cut-off is moved by the smallest offset that makes the gain 1 at the pass band (what keeps
    smooth parts from shrinking); the offset is found by a scan and then bisection."""
    index = np.arange(iterations + 1)
    window = 0.54 + 0.46 * np.cos(index * np.pi / (iterations + 1))
    theta = float(np.arccos(1.0 - 0.5 * passband))

    def coefficients(offset: float) -> np.ndarray:
        c = np.empty(iterations + 1)
        c[0] = (theta + offset) / np.pi
        c[1:] = 2.0 * np.sin(index[1:] * (theta + offset)) / (index[1:] * np.pi)
        return c * window

    def gain(offset: float) -> float:
        return float((coefficients(offset) * np.cos(index * theta)).sum())

    # The scan's gains all at once: one at a time, in Python, they held the interpreter from the other maps' threads.
    scan = np.linspace(0.0, np.pi - theta, 2001)
    shifted = theta + scan[:, None]
    scanned = np.concatenate([shifted / np.pi, 2.0 * np.sin(index[1:] * shifted) / (index[1:] * np.pi)], axis=1)
    first = int(np.argmax((scanned * window * np.cos(index * theta)).sum(axis=1) >= 1.0))
    low, high = scan[max(first - 1, 0)], scan[first]
    for _ in range(60):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if gain(middle) < 1.0 else (low, middle)
    c = coefficients(0.5 * (low + high))
    # The window leaves the gain at zero frequency a little off 1 (0.1 % for 20 iterations), which would
    # scale the mesh about the origin; set it to exactly 1 so only the shape, never the place, changes.
    return c / c.sum()


def smooth_surface(vertices: np.ndarray, faces: np.ndarray, iterations: int = 20, passband: float = 0.01) -> np.ndarray:
    """Windowed-sinc smoothing of a closed triangle mesh: the new vertex positions.

    With K = I − W the filter is Σ c_i T_i(I − K/2) applied to the positions (T_i Chebyshev polynomials),
    evaluated by the three-term recurrence, one sparse product per iteration. The three coordinates go through
    each product together (the filter acts on them alike): one pass over the matrix instead of three, and each
    coordinate summed in the same order as alone."""
    if len(faces) == 0:
        return vertices.copy()
    average = _neighbour_average(len(vertices), faces)
    c = _sinc_coefficients(iterations, passband)

    def half_step(x: np.ndarray) -> np.ndarray:
        return 0.5 * (x + average @ x)

    previous = np.ascontiguousarray(vertices, np.float64)
    current = half_step(previous)
    result = c[0] * previous + c[1] * current
    for coefficient in c[2:]:
        previous, current = current, 2.0 * half_step(current) - previous
        result += coefficient * current
    return result


def vertex_normals(vertices: np.ndarray, faces: np.ndarray) -> np.ndarray:
    """Unit normals per vertex: the area-weighted mean of its faces' normals (outward for outward winding)."""
    a, b, c = vertices[faces[:, 0]], vertices[faces[:, 1]], vertices[faces[:, 2]]
    face_normals = np.cross(b - a, c - a)
    # Summed by bincount (np.add.at is far slower) over every face's first corner, then every second, then every
    # third: each vertex's sum is added up in the order the corner-by-corner loop of add.at took, so it is the same.
    corners = faces.T.ravel()
    normals = np.stack([np.bincount(corners, weights=np.tile(face_normals[:, axis], 3), minlength=len(vertices))
                        for axis in range(3)], axis=1)
    return normals / np.maximum(np.linalg.norm(normals, axis=1, keepdims=True), 1e-30)


def balanced_level(distances: np.ndarray, inside: np.ndarray, voxel: float, rounds: int = 5) -> float:
    """The level t where the labelled points within half a voxel of it balance: the inside ones lie on
    average as far below t as the outside ones above it.

    For a flat surface at any offset between voxel centres the points on either side are mirror images,
    so t = 0 when the surface is right whatever its offset; curvature biases it by a second-order amount.
    Kept within half a voxel (no smoothing moves a surface further), and 0 where either side is empty."""
    # a level within half a voxel of 0 has no point a voxel or more away within half a voxel of it
    within = np.abs(distances) < voxel
    distances, inside = distances[within], inside[within]
    level = 0.0
    for _ in range(rounds):
        near = np.abs(distances - level) < 0.5 * voxel
        below, above = distances[near & inside], distances[near & ~inside]
        if len(below) == 0 or len(above) == 0:
            return 0.0
        level = float(np.clip(0.5 * (below.mean() + above.mean()), -0.5 * voxel, 0.5 * voxel))
    return level


def mesh_pieces(vertex_count: int, faces: np.ndarray) -> np.ndarray:
    """The closed piece (connected component) each vertex belongs to, numbered from 0 in the order of the
    vertices. Two edges of each triangle join all three of its corners."""
    rows, cols = np.concatenate([faces[:, 0], faces[:, 1]]), np.concatenate([faces[:, 1], faces[:, 2]])
    graph = sparse.csr_matrix((np.ones(len(rows), np.int8), (rows, cols)), shape=(vertex_count, vertex_count))
    return csgraph.connected_components(graph, directed=False)[1]


def agree_with_labels(vertices: np.ndarray, faces: np.ndarray, points: np.ndarray, inside: np.ndarray,
                      distances: np.ndarray, voxel: float, nearest_vertices: np.ndarray | None = None,
                      pieces: np.ndarray | None = None) -> np.ndarray:
    """Vertices of a smoothed mesh, each closed piece moved along its normals to its ``balanced_level``
    among the labelled points nearest it (``inside``, with signed ``distances`` to the mesh; the piece of each
    point is that of ``nearest_vertices``, a vertex of its nearest triangle, or else of its nearest vertex;
    ``pieces``: :func:`mesh_pieces`, if known).

    A low-pass filter shrinks what is small against its pass band (a cavity 3.5 voxels in radius closes by
    about half a millimetre at 2 mm voxels), which the labels the mesh came from rule out."""
    if pieces is None:
        pieces = mesh_pieces(len(vertices), faces)
    if nearest_vertices is None:
        nearest_vertices = cKDTree(vertices).query(points, workers=-1)[1]
    owner = pieces[nearest_vertices]
    normals = vertex_normals(vertices, faces)
    moved = vertices.astype(np.float64)
    for piece in np.unique(owner):
        near = owner == piece
        level = balanced_level(distances[near], inside[near], voxel)
        if level != 0.0:  # {distance < level} is inside: the surface moves out by ``level``
            moved[pieces == piece] += level * normals[pieces == piece]
    return moved


def _closest_on_segments(p: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ab = b - a
    t = np.clip(((p - a) * ab).sum(-1) / np.maximum((ab * ab).sum(-1), 1e-30), 0.0, 1.0)
    return a + t[..., None] * ab


def closest_on_triangles(p: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray):
    """Closest points of triangles (a, b, c) to points p (broadcast over leading axes):
    (closest points, squared distances, unnormalised triangle normals)."""
    normal = np.cross(b - a, c - a)
    norm2 = np.maximum((normal * normal).sum(-1), 1e-30)
    projected = p - (((p - a) * normal).sum(-1) / norm2)[..., None] * normal
    inside = np.ones(projected.shape[:-1], bool)
    for u, v in ((a, b), (b, c), (c, a)):
        inside &= (np.cross(v - u, projected - u) * normal).sum(-1) >= 0.0
    closest = projected
    distance2 = np.where(inside, ((p - projected) ** 2).sum(-1), np.inf)
    for u, v in ((a, b), (b, c), (c, a)):  # outside the triangle: the nearest point of an edge
        on_edge = _closest_on_segments(p, u, v)
        d2 = ((p - on_edge) ** 2).sum(-1)
        nearer = d2 < distance2
        closest = np.where(nearer[..., None], on_edge, closest)
        distance2 = np.where(nearer, d2, distance2)
    return closest, distance2, normal


def candidate_triangles(vertices: np.ndarray, faces: np.ndarray, points: np.ndarray,
                        candidates: int = 12) -> np.ndarray:
    """For each of ``points`` (N, 3), the ``candidates`` triangles whose centroids are nearest (N, k): enough
    to hold the nearest triangle for the near-uniform triangles of marching cubes, before or after the mesh is
    moved by less than a triangle's size (so one search serves both)."""
    return candidate_triangles_and_reach(vertices, faces, points, candidates)[0]


def candidate_triangles_and_reach(vertices: np.ndarray, faces: np.ndarray, points: np.ndarray,
                                  candidates: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """:func:`candidate_triangles`, and the distance from each point to the farthest of its candidates'
    centroids (N,): how far another triangle may lie before it would have been a candidate."""
    nearest, centroid_distances = candidate_search(vertices, faces, points, candidates)
    return nearest, centroid_distances[:, -1]


def candidate_search(vertices: np.ndarray, faces: np.ndarray, points: np.ndarray,
                     candidates: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """:func:`candidate_triangles` (N, k), and the distances from each point to those triangles' centroids
    (N, k), nearest first."""
    k = min(candidates, len(faces))
    distances, nearest = nearest_neighbours(vertices[faces].mean(axis=1), points, k)
    return nearest, distances


def nearest_neighbours(data: np.ndarray, points: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` points of ``data`` nearest each of ``points``, nearest first: (distances (N, k) float64,
    indices (N, k) int64). By the ``pykdtree`` package where it is installed (its queries take less processor
    time, which the boundary maps wait for on few cores), else by scipy's ``cKDTree``; both are exact and
    measure the same float64 distances, so they give the same neighbours (points at exactly equal distances
    aside, whose order either may choose)."""
    data, points = (np.ascontiguousarray(array, np.float64) for array in (data, points))
    if len(points) == 0 or k == 0:
        return np.zeros((len(points), k)), np.zeros((len(points), k), np.int64)
    try:
        from pykdtree.kdtree import KDTree
    except ImportError:
        distances, indices = cKDTree(data).query(points, k=k, workers=-1)
    else:
        distances, indices = KDTree(data).query(points, k=k)
    shape = (len(points), k)
    return np.asarray(distances, np.float64).reshape(shape), np.asarray(indices, np.int64).reshape(shape)


def mesh_distance_floor(vertices: np.ndarray, faces: np.ndarray, nearest_centroid: np.ndarray) -> np.ndarray:
    """A lower bound of each point's distance to the mesh, from its distance to the nearest triangle centroid
    (:func:`candidate_search`'s first column): every point of a triangle lies within the triangle's spread (the
    largest distance from its centroid to a corner) of its centroid, so no triangle comes nearer than the nearest
    centroid less the largest spread of the mesh."""
    distances = np.asarray(nearest_centroid, np.float64)
    if len(faces) == 0:
        return distances.copy()
    corners = vertices[faces].astype(np.float64)
    spread = float(np.sqrt(((corners - corners.mean(axis=1, keepdims=True)) ** 2).sum(-1)).max())
    return distances - spread


def candidates_after_move(vertices: np.ndarray, moved: np.ndarray, faces: np.ndarray, points: np.ndarray,
                          nearest: np.ndarray, reach: np.ndarray, pieces: np.ndarray) -> np.ndarray:
    """The candidates (:func:`candidate_triangles_and_reach`: ``nearest``, ``reach``) of ``points`` once the
    closed pieces of the mesh (``pieces``: :func:`mesh_pieces`) have moved from ``vertices`` to ``moved``, each
    as a whole. A piece moved as a whole keeps which of its triangles are near a point, so only the points
    another piece may now be nearest to are searched again: those with a candidate off the largest piece, and
    those another piece's centroid came within reach of (each centroid moved at most as far as a vertex did)."""
    triangle_piece = pieces[faces[:, 0]]
    largest = int(np.argmax(np.bincount(triangle_piece)))
    off_largest = (triangle_piece[nearest] != largest).any(axis=1)
    others = triangle_piece != largest
    shift = float(np.sqrt(((moved - vertices) ** 2).sum(axis=1).max())) if len(vertices) else 0.0
    on_largest = np.flatnonzero(~off_largest)
    if others.any() and len(on_largest):
        centroids = vertices[faces[others]].mean(axis=1)
        bound = reach[on_largest] + 2.0 * shift
        distance, _ = cKDTree(centroids).query(points[on_largest], k=1, workers=-1,
                                               distance_upper_bound=float(bound.max()) * (1.0 + 1e-9))
        off_largest[on_largest[distance <= bound]] = True
    again = np.flatnonzero(off_largest)
    nearest = nearest.copy()
    if len(again):
        nearest[again] = candidate_triangles(moved, faces, points[again], nearest.shape[1])
    return nearest


def _triangle_table(vertices: np.ndarray, faces: np.ndarray, origin: np.ndarray, chunk: int = 1 << 15
                    ) -> np.ndarray:
    """Per triangle (18, F): corner a (less ``origin``), edges e0 = b − a and e1 = c − a, the normal n = e0 × e1,
    and the dot products e0·e0, e0·e1, e1·e1, |c − b|², the Gram determinant and n·n: what the squared
    distance of a point needs. Filled in chunks of triangles, in threads."""
    table = np.empty((18, len(faces)), np.float64)

    def fill(start: int) -> None:
        rows = slice(start, start + chunk)
        a, b, c = (vertices[faces[rows, corner]].astype(np.float64) for corner in range(3))
        e0, e1 = b - a, c - a
        normal = np.cross(e0, e1)
        a00, a01, a11 = (e0 * e0).sum(1), (e0 * e1).sum(1), (e1 * e1).sum(1)
        a22 = ((c - b) ** 2).sum(1)
        det = np.maximum(a00 * a11 - a01 * a01, 1e-300)
        nn = np.maximum((normal * normal).sum(1), 1e-300)
        table[:, rows] = np.vstack([(a - origin).T, e0.T, e1.T, normal.T, a00, a01, a11, a22, det, nn])

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(fill, range(0, len(faces), chunk)))
    return table


def _squared_distances(table: np.ndarray, p: np.ndarray, nearest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Squared distances (n, k) from points p (n, 3; less the table's origin) to the triangles ``nearest``
    (n, k), and the points' heights above the triangles' planes along n (whose sign is the side): the
    plane's distance where the projection falls inside the triangle, else the nearest edge's, all from
    scalars (no 3-vectors per pair), in the table's precision."""
    ax, ay, az, e0x, e0y, e0z, e1x, e1y, e1z, nx, ny, nz, a00, a01, a11, a22, det, nn = (row[nearest] for row in table)
    px, py, pz = (p[:, axis : axis + 1] - corner for axis, corner in enumerate((ax, ay, az)))
    d0 = e0x * px + e0y * py + e0z * pz  # e0·(p − a)
    d1 = e1x * px + e1y * py + e1z * pz  # e1·(p − a)
    height = nx * px + ny * py + nz * pz  # n·(p − a)
    pp = px * px + py * py + pz * pz
    s = a11 * d0 - a01 * d1  # barycentric coordinates of the projection, times det
    t = a00 * d1 - a01 * d0
    inside = (s >= 0.0) & (t >= 0.0) & (s + t <= det)
    best = np.where(inside, height * height / nn, np.inf)
    for dot, length2 in ((d0, a00), (d1, a11)):  # the edges from a: to b, to c
        u = np.clip(dot / length2, 0.0, 1.0)
        np.minimum(best, pp - u * (2.0 * dot - u * length2), out=best)
    dot = d1 - d0 - a01 + a00  # the edge from b to c: (c − b)·(p − b)
    u = np.clip(dot / a22, 0.0, 1.0)
    np.minimum(best, pp - 2.0 * d0 + a00 - u * (2.0 * dot - u * a22), out=best)
    return np.maximum(best, 0.0, out=best), height


def mesh_distances(vertices: np.ndarray, faces: np.ndarray, points: np.ndarray, nearest: np.ndarray,
                   chunk: int = 1 << 13) -> tuple[np.ndarray, np.ndarray]:
    """Signed distances (negative inside) from ``points`` (N, 3) to a closed, outward-wound mesh, the nearest
    triangle sought among ``nearest`` (N, k; :func:`candidate_triangles`): (distances, nearest triangles).

    The sign is the side of the nearest triangle's plane the point is on, which is right for a smooth mesh
    even where the closest point lies on an edge. The nearest triangle is chosen in single precision (near
    the mesh's centre, so only triangles within micrometres of each other's distance may be confused), then
    the distance to it in double precision, in chunks, in threads."""
    origin = vertices.mean(axis=0) if len(vertices) else np.zeros(3)
    table = _triangle_table(vertices, faces, origin)
    single = table.astype(np.float32)
    best = np.empty(len(points), np.int64)
    distances = np.empty(len(points), np.float64)

    def measure(start: int) -> None:
        rows = slice(start, start + chunk)
        p, candidates = np.asarray(points[rows], np.float64) - origin, nearest[rows]
        distance2 = _squared_distances(single, p.astype(np.float32), candidates)[0]
        best[rows] = chosen = candidates[np.arange(len(p)), np.argmin(distance2, axis=1)]
        distance2, height = _squared_distances(table, p, chosen[:, None])
        distances[rows] = np.sqrt(distance2[:, 0]) * np.where(height[:, 0] < 0.0, -1.0, 1.0)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(measure, range(0, len(points), chunk)))
    return distances, best


def signed_distance_to_mesh(vertices: np.ndarray, faces: np.ndarray, points: np.ndarray, candidates: int = 12,
                            chunk: int = 1 << 13) -> np.ndarray:
    """Signed distance (negative inside) from ``points`` (N, 3) to a closed, outward-wound mesh.

    The nearest triangle is sought among the ``candidates`` whose centroids are nearest (enough for the
    near-uniform triangles of marching cubes); see :func:`mesh_distances`."""
    nearest = candidate_triangles(vertices, faces, points, candidates)
    return mesh_distances(vertices, faces, points, nearest, chunk)[0]
