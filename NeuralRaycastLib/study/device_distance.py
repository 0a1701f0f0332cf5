"""The boundary maps' distances on the device: the exact Euclidean distance transform of a voxel mask
(shaders/distance_transform.slang) and the distances to a smoothed surface's mesh near it (shaders/mesh_distance.slang).

The boundary maps wait for the brain's; where a device is open (``fit`` opens one before it prepares the study) the
transform's three separable passes run there, a thread per line, and the band's distances to the mesh a thread per
point, instead of on the processor's few cores. The values are the CPU's (``edt``, scipy, surface_distance.py) to
float32 rounding.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np

#: The axes of the passes, in order: the edt package's for a C-ordered grid (the last index first).
PASS_AXES = (2, 1, 0)
#: Device memory a voxel of the transform takes: its squared distance, its byte of the mask and three words of
#: the lines' scratch.
BYTES_PER_VOXEL = 17
#: Threads of the device share it one transform at a time (a device's calls are not made from two threads).
_LOCK = threading.Lock()


#: 1: ``fit`` (and what opens a run) takes the boundary maps' transforms on its device; 0: on the processor. Unset:
#: on a hardware GPU, where they shorten the maps (their longest steps, and they no longer hold the processor's
#: cores from the other structures' maps), not on a software device (lavapipe is the processor itself). The
#: processor's transforms are the reference either way.
MAPS_ON_DEVICE_VARIABLE = "NEURALRAYCAST_DEVICE_MAPS"


def maps_device(gpu: Any) -> Any:
    """The device a run's preparation should take its transforms on: ``gpu`` where $NEURALRAYCAST_DEVICE_MAPS is
    1, or unset and the device a hardware GPU; else None (the processor's)."""
    setting = os.environ.get(MAPS_ON_DEVICE_VARIABLE, "").strip()
    if setting in ("0", "1"):
        return gpu if setting == "1" else None
    report = getattr(gpu, "report", None)
    return gpu if report is not None and not report.software else None


def fits_device(gpu: Any, shape: tuple[int, ...]) -> bool:
    """Whether the transform of a grid of ``shape`` fits the device's GPU memory budget (gpu/memory_budget.py);
    where it does not (a large grid, a small budget), the processor's transform is taken instead."""
    from ..gpu.device import memory_budget

    return int(np.prod(shape, dtype=np.int64)) * BYTES_PER_VOXEL <= memory_budget(gpu).work_bytes


def _axis_lines(shape: tuple[int, int, int], axis: int) -> tuple[int, int, int]:
    """(lines, length, inner) of a pass along ``axis`` of a C-ordered grid: how many lines, the voxels along one,
    and the step between neighbours along it."""
    size = int(np.prod(shape))
    length = int(shape[axis])
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    return size // max(length, 1), length, inner


def _packed_mask(inside: np.ndarray) -> np.ndarray:
    """The mask as bytes (C order), four a 32-bit word, padded to a whole word."""
    flat = np.ascontiguousarray(inside, dtype=bool).reshape(-1).view(np.uint8)
    padded = np.zeros(-(-max(flat.size, 1) // 4) * 4, np.uint8)
    padded[:flat.size] = flat
    return padded.view(np.uint32)


def squared_distance_transform(gpu: Any, inside: np.ndarray, spacing: np.ndarray, root: bool = False) -> np.ndarray:
    """Squared distance in mm² (float32) from each voxel of the 3-D mask ``inside`` to the nearest voxel not in it
    (0 there, infinite everywhere where no voxel is outside), the spacing of each axis respected; with ``root``,
    the distance itself (mm), as ``edt.edt(inside, anisotropy=spacing, black_border=False)`` gives it."""
    import slangpy as spy

    inside = np.asarray(inside)
    if inside.ndim != 3:
        raise ValueError(f"a 3-D mask is needed, got shape {inside.shape}")
    shape = tuple(int(n) for n in inside.shape)
    size = int(np.prod(shape))
    if size == 0:
        return np.zeros(shape, np.float32)
    spacing = np.asarray(spacing, np.float64)
    with _LOCK:
        device = gpu.device
        module = gpu.load_module("distance_transform")
        values = spy.Tensor.empty(device, shape=(size,), dtype=float)
        mask = spy.Tensor.from_numpy(device, _packed_mask(inside))
        apex = spy.Tensor.empty(device, shape=(size,), dtype="int")
        apex_value = spy.Tensor.empty(device, shape=(size,), dtype=float)
        begins = spy.Tensor.empty(device, shape=(size,), dtype=float)
        for order, axis in enumerate(PASS_AXES):
            lines, length, inner = _axis_lines(shape, axis)
            step = np.float32(spacing[axis])
            module.distanceLine(spy.grid((lines,)), {
                "values": values.storage.device_address, "mask": mask.storage.device_address,
                "apex": apex.storage.device_address, "apexValue": apex_value.storage.device_address,
                "begins": begins.storage.device_address, "lines": lines, "length": length, "inner": inner,
                "spacing": float(step), "weight": float(step * step), "fromMask": int(order == 0),
                "root": int(root and order == len(PASS_AXES) - 1),
            })
        out = np.asarray(values.to_numpy(), np.float32).reshape(shape)
    return out


def distance_transform(gpu: Any, inside: np.ndarray, spacing: np.ndarray) -> np.ndarray:
    """Distance in mm (float32) from each voxel of ``inside`` to the nearest voxel not in it, on the device."""
    return squared_distance_transform(gpu, inside, spacing, root=True)


#: Devices that refused a transform (by id): said once, then not asked again.
_REFUSED: set[int] = set()


def mesh_distances(gpu: Any, vertices: np.ndarray, faces: np.ndarray, points: np.ndarray,
                   nearest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """surface_distance.mesh_distances on the device: the signed distances (negative inside, float64 of float32
    values) from ``points`` (N, 3) to the closed mesh, the nearest triangle sought among ``nearest`` (N, k), and
    that triangle per point."""
    import slangpy as spy

    count = len(points)
    if count == 0:
        return np.zeros(0), np.zeros(0, np.int64)
    origin = vertices.mean(axis=0)

    def upload(values: np.ndarray, dtype: type) -> Any:
        return spy.Tensor.from_numpy(gpu.device, np.ascontiguousarray(values, dtype).reshape(-1))

    with _LOCK:
        module = gpu.load_module("mesh_distance")
        inputs = {"vertices": upload(vertices - origin, np.float32), "faces": upload(faces, np.int32),
                  "points": upload(points - origin, np.float32), "candidates": upload(nearest, np.int32)}
        distances = spy.Tensor.empty(gpu.device, shape=(count,), dtype=float)
        chosen = spy.Tensor.empty(gpu.device, shape=(count,), dtype="int")
        module.meshDistance(spy.grid((count,)), {
            **{name: tensor.storage.device_address for name, tensor in inputs.items()},
            "distances": distances.storage.device_address, "nearest": chosen.storage.device_address,
            "count": count, "candidateCount": int(nearest.shape[1])})
        return (np.asarray(distances.to_numpy(), np.float64),
                np.asarray(chosen.to_numpy(), np.int64))


def mesh_distance_bytes(vertices: int, faces: int, points: int, candidates: int) -> int:
    """Device memory :func:`mesh_distances` takes: the mesh, the points, their candidates and the two results."""
    return 12 * (vertices + faces) + points * (12 + 4 * candidates + 8)


def _said_refused(gpu: Any, what: str, error: RuntimeError) -> None:
    """A device that failed the maps' work (a driver's error) is said once in the log and not asked again: the
    maps are the same either way, only slower."""
    _REFUSED.add(id(gpu))
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    logging.getLogger(__name__).warning("the boundary maps' %s run on the processor: the device could not take "
                                        "them (%s)", what, first[:200])


def device_distance_transform(gpu: Any, inside: np.ndarray, spacing: np.ndarray) -> np.ndarray | None:
    """:func:`distance_transform` where the grid fits the device's memory budget and the device takes it, else
    None (the caller takes the processor's transform)."""
    if id(gpu) in _REFUSED or not fits_device(gpu, inside.shape) or not gpu.use_on_this_thread():
        return None
    try:
        return distance_transform(gpu, inside, spacing)
    except RuntimeError as error:
        _said_refused(gpu, "distance transforms", error)
        return None


def device_mesh_distances(gpu: Any, vertices: np.ndarray, faces: np.ndarray, points: np.ndarray,
                          nearest: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`mesh_distances` where its buffers fit the device's memory budget and the device takes it, else None
    (the caller takes the processor's)."""
    from ..gpu.device import memory_budget

    needed = mesh_distance_bytes(len(vertices), len(faces), len(points), int(nearest.shape[1]))
    if (id(gpu) in _REFUSED or needed > memory_budget(gpu).work_bytes or not len(faces)
            or not gpu.use_on_this_thread()):
        return None
    try:
        return mesh_distances(gpu, vertices, faces, points, nearest)
    except RuntimeError as error:
        _said_refused(gpu, "distances to the surface", error)
        return None
