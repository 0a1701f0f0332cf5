"""A bounding volume hierarchy over triangle meshes, built on the CPU and traced on the GPU.

Secondary rays (shadows towards the key light, ambient occlusion) are traced against the meshes of
the structures rather than marched through the field; a BVH makes each ray cost O(log n) triangles.

Construction is a linear BVH (Lauterbach et al. 2009, Karras 2012): triangles are sorted by the 30-bit
Morton code of their centroid, and each node's sorted range is split where the highest differing bit
of its codes flips (in the middle where all codes are equal). This is the radix tree of Karras built top
down, one whole tree level at a time with numpy, so a mesh of a million triangles builds in seconds.
Every node covers a contiguous range of the sorted triangles; ranges of at most ``leaf_size`` are
leaves. The GPU layout (shaders/bvh.slang) is flat arrays: node boxes, node links, triangle corners.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .mesh import Mesh

MORTON_BITS = 10  # per axis: 30-bit codes
MAX_DEPTH = 60  # levels; the traversal stack in shaders/bvh.slang holds 64 nodes
MAX_MESHES = 8  # per-mesh factors in shaders/bvh.slang (one per structure)


@dataclass
class Bvh:
    """A flattened BVH. Node 0 is the root; a child always has a larger index than its parent.

    ``links[n]`` is (left child, right child) for an interior node and (first triangle, -count) for a
    leaf, indexing the triangles in leaf order (``corners``, ``triangle_ids``, ``triangle_meshes``).
    """

    box_min: np.ndarray  # (N, 3) float32
    box_max: np.ndarray  # (N, 3) float32
    links: np.ndarray  # (N, 2) int32
    corners: np.ndarray  # (T, 3, 3) float32: v0, v1, v2 of each triangle, in leaf order
    triangle_ids: np.ndarray  # (T,) int32: index of the triangle in the input (concatenated meshes)
    triangle_meshes: np.ndarray  # (T,) int32: which input mesh the triangle came from
    depth: int

    @property
    def node_count(self) -> int:
        return len(self.links)

    @property
    def triangle_count(self) -> int:
        return len(self.corners)

    def is_leaf(self) -> np.ndarray:
        return self.links[:, 1] < 0


def morton_codes(points: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """30-bit Morton codes (x, y, z bits interleaved, x highest) of points quantised in the box."""
    scale = (1 << MORTON_BITS) - 1
    unit = (points - low) / np.maximum(high - low, 1e-30)
    cells = np.clip(np.floor(unit * scale + 0.5), 0, scale).astype(np.uint32)

    def spread(v: np.ndarray) -> np.ndarray:  # insert two zero bits between the 10 bits of v
        v = (v | (v << 16)) & 0x030000FF
        v = (v | (v << 8)) & 0x0300F00F
        v = (v | (v << 4)) & 0x030C30C3
        return (v | (v << 2)) & 0x09249249

    return (spread(cells[:, 0]) << 2) | (spread(cells[:, 1]) << 1) | spread(cells[:, 2])


def _split_positions(codes: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Where each sorted range [lo, hi) splits: the first code with the highest differing bit set."""
    first, last = codes[lo], codes[hi - 1]
    differ = first ^ last
    bit = np.maximum(np.frexp(differ.astype(np.float64))[1] - 1, 0)  # index of the highest set bit (exact)
    boundary = ((first >> bit) | 1) << bit  # the common prefix followed by a 1 at the differing bit
    split = np.searchsorted(codes, boundary, side="left")
    return np.where(differ > 0, split, (lo + hi) // 2)


def _over_corners(ufunc: np.ufunc, corners: np.ndarray, dtype: type = np.float32) -> np.ndarray:
    """``ufunc`` over each triangle's three corners (F, 3, 3) -> (F, 3), written out: numpy's own reduction
    over an axis of length 3 is slow enough to dominate a BVH's build."""
    return ufunc(ufunc(corners[:, 0].astype(dtype, copy=False), corners[:, 1]), corners[:, 2])


def build_bvh(meshes: Sequence[Mesh] | Mesh, leaf_size: int = 4) -> Bvh:
    """A BVH over all triangles of one or several meshes (their indices are kept per triangle)."""
    meshes = [meshes] if isinstance(meshes, Mesh) else list(meshes)
    if len(meshes) > MAX_MESHES:
        raise ValueError(f"a BVH holds at most {MAX_MESHES} meshes (got {len(meshes)})")
    if sum(len(m.faces) for m in meshes) == 0:
        raise ValueError("cannot build a BVH without triangles")
    corners = np.concatenate([m.vertices[m.faces] for m in meshes]).astype(np.float32)
    mesh_of = np.concatenate([np.full(len(m.faces), i, np.int32) for i, m in enumerate(meshes)])

    centroids = _over_corners(np.add, corners, np.float64) / 3.0
    codes = morton_codes(centroids, centroids.min(axis=0), centroids.max(axis=0))
    order = np.argsort(codes, kind="stable")
    codes, corners, mesh_of = codes[order].astype(np.int64), corners[order], mesh_of[order]

    # Top down, one level at a time: every node is a range [lo, hi) of the sorted triangles.
    node_lo, links, levels = [np.array([0])], [], []
    frontier_lo, frontier_hi, next_id = np.array([0]), np.array([len(codes)]), 1
    while len(frontier_lo):
        levels.append(next_id - len(frontier_lo) + np.arange(len(frontier_lo)))
        leaf = frontier_hi - frontier_lo <= leaf_size
        split = _split_positions(codes, frontier_lo, frontier_hi)
        inner = np.flatnonzero(~leaf)
        left = next_id + 2 * np.arange(len(inner))
        link = np.stack([frontier_lo, frontier_lo - frontier_hi], axis=1)  # leaves: (first, -count)
        link[inner] = np.stack([left, left + 1], axis=1)
        links.append(link)
        child_lo = np.stack([frontier_lo[inner], split[inner]], axis=1).reshape(-1)
        child_hi = np.stack([split[inner], frontier_hi[inner]], axis=1).reshape(-1)
        next_id += len(child_lo)
        node_lo.append(child_lo)
        frontier_lo, frontier_hi = child_lo, child_hi
    links = np.concatenate(links).astype(np.int32)
    lo = np.concatenate(node_lo)
    if len(levels) > MAX_DEPTH:
        raise ValueError(f"BVH depth {len(levels)} exceeds the traversal stack ({MAX_DEPTH})")

    # Boxes: leaves reduce their triangle ranges (which tile the sorted triangles); parents merge children.
    box_min = np.empty((len(links), 3), np.float32)
    box_max = np.empty((len(links), 3), np.float32)
    leaves = np.flatnonzero(links[:, 1] < 0)
    leaves = leaves[np.argsort(lo[leaves])]
    box_min[leaves] = np.minimum.reduceat(_over_corners(np.minimum, corners), lo[leaves])
    box_max[leaves] = np.maximum.reduceat(_over_corners(np.maximum, corners), lo[leaves])
    for level in reversed(levels):
        inner = level[links[level, 1] >= 0]
        left, right = links[inner, 0], links[inner, 1]
        box_min[inner] = np.minimum(box_min[left], box_min[right])
        box_max[inner] = np.maximum(box_max[left], box_max[right])

    return Bvh(box_min, box_max, links, corners, order.astype(np.int32), mesh_of, len(levels))


def shader_struct(gpu, bvh: Bvh) -> tuple[list, dict]:
    """Upload a BVH: (the tensors, which must stay alive while it is used; the ``Bvh`` shader struct)."""
    import slangpy as spy

    boxes = np.concatenate([bvh.box_min, bvh.box_max], axis=1)
    arrays = [boxes, bvh.links, bvh.corners, bvh.triangle_meshes]
    dtypes = [np.float32, np.int32, np.float32, np.int32]
    tensors = [
        spy.Tensor.from_numpy(gpu.device, np.ascontiguousarray(a, dtype=t).reshape(-1))
        for a, t in zip(arrays, dtypes, strict=True)
    ]
    struct = {
        "boxes": tensors[0].storage.device_address,
        "links": tensors[1].storage.device_address,
        "corners": tensors[2].storage.device_address,
        "meshes": tensors[3].storage.device_address,
    }
    return tensors, struct


@dataclass
class RayHits:
    """Closest hits of a batch of rays; ``triangle`` indexes the input triangles (-1 where missed)."""

    t: np.ndarray  # (N,) float32, tMax where missed
    triangle: np.ndarray  # (N,) int32
    mesh: np.ndarray  # (N,) int32, -1 where missed
    barycentric: np.ndarray  # (N, 2) float32: u, v of v1 and v2

    @property
    def hit(self) -> np.ndarray:
        return self.triangle >= 0


class BvhTracer:
    """A BVH on the device, traced by batches of rays (shaders/bvh.slang)."""

    def __init__(self, gpu, bvh: Bvh) -> None:
        self.gpu, self.bvh = gpu, bvh
        self._tensors, self.struct = shader_struct(gpu, bvh)
        self.module = gpu.load_module("bvh")

    @staticmethod
    def _rays(origins: np.ndarray, directions: np.ndarray, t_max) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Origins, directions (N, 3) and t_max (N,) broadcast against each other, as float32.

        Fresh arrays: slangpy refuses read-only views such as those np.broadcast_to returns.
        """
        origins, directions = np.asarray(origins, np.float32), np.asarray(directions, np.float32)
        shape = np.broadcast_shapes(origins.shape, directions.shape)
        origins = np.array(np.broadcast_to(origins, shape), np.float32, order="C").reshape(-1, 3)
        directions = np.array(np.broadcast_to(directions, shape), np.float32, order="C").reshape(-1, 3)
        t_max = np.array(np.broadcast_to(np.minimum(t_max, 3e38), origins.shape[:1]), np.float32, order="C")
        return origins, directions, t_max

    def closest(self, origins: np.ndarray, directions: np.ndarray, t_max=np.inf) -> RayHits:
        """The nearest triangle along each ray in (0, t_max)."""
        origins, directions, t_max = self._rays(origins, directions, t_max)
        result = self.module.traceClosest(origins, directions, t_max, self.struct, _result="tensor")
        raw = np.ascontiguousarray(result.to_numpy()).view(np.float32).reshape(-1, 4)
        leaf = raw[:, 1].view(np.int32)
        hit = leaf >= 0
        triangle = np.where(hit, self.bvh.triangle_ids[np.maximum(leaf, 0)], -1).astype(np.int32)
        mesh = np.where(hit, self.bvh.triangle_meshes[np.maximum(leaf, 0)], -1).astype(np.int32)
        return RayHits(raw[:, 0].copy(), triangle, mesh, raw[:, 2:4].copy())

    def occluded(self, origins: np.ndarray, directions: np.ndarray, t_max=np.inf) -> np.ndarray:
        """Whether anything lies on each ray in (0, t_max): (N,) bool."""
        origins, directions, t_max = self._rays(origins, directions, t_max)
        return np.asarray(self.module.occluded(origins, directions, t_max, self.struct, _result="numpy")) != 0
