"""A float64 numpy re-implementation of shaders/latent_appearance.slang, the reference for its gradient checks:
written from the same definitions (mlp.slang's layout, tanh codes, the grid's vertex order and clamped
trilinear weights, sigmoid outputs), so a wrong derivative or forward pass on the device shows as a mismatch."""

from __future__ import annotations

import numpy as np
from field_reference import mlp

from NeuralRaycastLib.appearance.latent import GridLayout, LatentConfig


def encoder(config: LatentConfig, params: np.ndarray, inputs: np.ndarray) -> np.ndarray:
    """Codes (N, Z) of local inputs (N, A)."""
    return np.tanh(mlp(params, 0, inputs, config.widths()[0]))


def decoder(config: LatentConfig, params: np.ndarray, codes: np.ndarray, views: np.ndarray) -> np.ndarray:
    """Sigmoid outputs (N, K·(3+M)) of codes (N, Z) seen along views (N, 3)."""
    raw = mlp(params, config.decoder_offset, np.concatenate([codes, views], axis=1), config.widths()[1])
    return 1.0 / (1.0 + np.exp(-raw))


def lookup(grid: GridLayout, codes: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Trilinear codes (N, Z) at points x (N, 3) from vertex codes (vertices, Z), clamped to the edge vertices."""
    dims = np.asarray(grid.dims)
    g = np.clip((x - np.asarray(grid.origin)) / grid.cell_mm, 0.0, dims - 1)
    base = np.clip(np.floor(g).astype(np.int64), 0, dims - 2)
    f = g - base
    value = np.zeros((len(x), codes.shape[1]))
    for c in range(8):
        corner = np.array([c & 1, (c >> 1) & 1, (c >> 2) & 1])
        weight = np.prod(np.where(corner == 1, f, 1.0 - f), axis=1)
        v = base + corner
        value += weight[:, None] * codes[(v[:, 2] * dims[1] + v[:, 1]) * dims[0] + v[:, 0]]
    return value


def assert_gradient(function, values: np.ndarray, gradient: np.ndarray, step: float = 1e-5) -> None:
    """A device gradient of sum(function(values)) vs central differences of the float64 reference: along random
    directions, on the largest coordinates, and on coordinates the device left at zero."""
    rng = np.random.default_rng(5)
    scale = np.abs(gradient).max()
    assert scale > 0, "the gradient is identically zero"
    directions = rng.normal(size=(3, values.size))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    chosen = np.argsort(-np.abs(gradient))[:24]
    zeros = np.flatnonzero(gradient == 0)
    chosen = np.concatenate([chosen, rng.choice(zeros, size=min(8, zeros.size), replace=False)])
    directions = np.concatenate([directions, np.eye(values.size)[chosen]])
    numeric = np.array([(function(values + step * u) - function(values - step * u)) / (2 * step) for u in directions])
    np.testing.assert_allclose(directions[:3] @ gradient, numeric[:3], rtol=2e-3,
                               atol=2e-4 * scale * np.sqrt(values.size))
    np.testing.assert_allclose(gradient[chosen], numeric[3:], rtol=2e-3, atol=2e-4 * scale)


def assert_row_gradient(function, rows: np.ndarray, gradient: np.ndarray, step: float = 1e-5) -> None:
    """Per-row d/drow of a per-row function (N,) of rows (N, D) vs central differences."""
    numeric = np.stack([(function(rows + step * e) - function(rows - step * e)) / (2 * step)
                        for e in np.eye(rows.shape[1])], axis=1)
    scale = np.abs(numeric).max()
    assert scale > 0
    np.testing.assert_allclose(gradient, numeric, rtol=2e-3, atol=2e-4 * scale)
