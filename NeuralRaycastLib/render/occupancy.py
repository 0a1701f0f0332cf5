"""The occupancy grid: cells of the study's box where some surface may be; rays are sampled only there."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..gpu.device import GpuContext
from ..grid import least_corner

#: How far beyond the band, in cells, a segment is still sampled where its middle's distance is interpolated
#: from the cells' corners (:class:`Occupancy`): room for the interpolation's error on a smooth field.
INTERPOLATION_MARGIN_CELLS = 0.25


@dataclass
class Occupancy:
    """Cells of an axis-aligned RAS grid where some surface may be; elsewhere rays are not sampled.

    With ``nearest`` (min_k |d_k| at the cells' corners) a segment of an occupied cell is sampled only where
    that distance, interpolated trilinearly at its middle, is within ``reach_mm``. Cells tested at their worst
    point instead keep samples up to the band plus a margin of their half-diagonal from every surface, where
    the smooth step adds nothing (on a 1 mm grid of the sample, about a quarter of the samples)."""

    cells: np.ndarray  # (Z, Y, X) bool
    origin: np.ndarray  # (3,) RAS mm of the corner of cell (0, 0, 0)
    cell_mm: float
    nearest: np.ndarray | None = None  # (Z + 1, Y + 1, X + 1) min_k |d_k| (mm) at the cells' corners
    reach_mm: float = float("inf")

    @classmethod
    def from_distances(
        cls,
        distances: Callable[[np.ndarray], np.ndarray],
        box: np.ndarray,
        cell_mm: float,
        band_mm: float,
        lipschitz: float = 1.0,
    ) -> Occupancy:
        """Sampled where min_k |d_k|, interpolated from the cells' corners, is within ``band_mm`` (where the
        smooth step is not flat) plus :data:`INTERPOLATION_MARGIN_CELLS`, and at least the cell's half-diagonal
        times the distances' Lipschitz bound (so a cell a surface crosses is sampled there: its corners' values
        are at most that); occupied where some corner's value is (the interpolation never goes below its
        corners' least)."""
        box = np.asarray(box, np.float64)
        dims = cls.grid_cells(box, cell_mm)
        axes = [box[0, a] + np.arange(dims[a] + 1) * cell_mm for a in range(3)]
        z, y, x = np.meshgrid(axes[2], axes[1], axes[0], indexing="ij")
        corners = np.stack([x, y, z], axis=-1).reshape(-1, 3)
        nearest = np.min(np.abs(distances(corners)), axis=1).reshape(dims[2] + 1, dims[1] + 1, dims[0] + 1)
        return cls.from_nearest(nearest, box, cell_mm, band_mm, lipschitz)

    @staticmethod
    def grid_cells(box: np.ndarray, cell_mm: float) -> np.ndarray:
        """Cells (x, y, z) of ``cell_mm`` covering ``box`` (their corners are one more a side)."""
        box = np.asarray(box, np.float64)
        return np.maximum(np.ceil((box[1] - box[0]) / cell_mm).astype(int), 1)

    @classmethod
    def from_nearest(cls, nearest: np.ndarray, box: np.ndarray, cell_mm: float, band_mm: float,
                     lipschitz: float = 1.0) -> Occupancy:
        """As :meth:`from_distances`, given min_k |d_k| at the corners of :meth:`grid_cells` (z, y, x)."""
        box = np.asarray(box, np.float64)
        dims = cls.grid_cells(box, cell_mm)
        expected = (dims[2] + 1, dims[1] + 1, dims[0] + 1)
        if nearest.shape != expected:
            raise ValueError(f"corner values of shape {nearest.shape}, expected {expected}")
        lowest = least_corner(nearest)
        reach = max(band_mm + INTERPOLATION_MARGIN_CELLS * cell_mm, lipschitz * 0.5 * np.sqrt(3.0) * cell_mm)
        return cls(lowest <= reach, box[0].copy(), float(cell_mm), nearest.astype(np.float32), float(reach))

    def copy(self) -> Occupancy:
        nearest = None if self.nearest is None else self.nearest.copy()
        return Occupancy(self.cells.copy(), self.origin.copy(), self.cell_mm, nearest, self.reach_mm)

    @property
    def fraction(self) -> float:
        return float(self.cells.mean())

    def upload(self, gpu: GpuContext) -> tuple[Any, dict]:
        """The device's copy (shaders/ray_samples.slang's Occupancy): the tensors to keep alive, the struct."""
        import slangpy as spy

        tensor = spy.Tensor.from_numpy(gpu.device, np.ascontiguousarray(self.cells.astype(np.int32).reshape(-1)))
        tensors = [tensor]
        if self.nearest is not None:
            tensors.append(spy.Tensor.from_numpy(gpu.device, np.ascontiguousarray(self.nearest.reshape(-1),
                                                                                  np.float32)))
        z, y, x = self.cells.shape
        struct = {
            "cells": tensor.storage.device_address,
            "dims": spy.int3(x, y, z),
            "origin": spy.float3(*map(float, self.origin)),
            "cellInv": 1.0 / self.cell_mm,
            "nearest": tensors[1].storage.device_address if self.nearest is not None else 0,
            "reach": float(min(self.reach_mm, 3.0e38)),
        }
        return tensors, struct
