"""A float64 numpy re-implementation of the field's Slang code, the reference for the gradient checks.

Written independently from the shaders, following the same definitions (parameter layout, hash,
trilinear weights, ReLU networks, truncated L1 and Eikonal terms), so a wrong derivative or a wrong
forward pass on the device shows up as a mismatch.
"""

from __future__ import annotations

import numpy as np

from NeuralRaycastLib.field.field import FieldLayout

PRIME_Y, PRIME_Z = np.uint64(2654435761), np.uint64(805459861)


def encode(layout: FieldLayout, params: np.ndarray, x: np.ndarray, active: int | None = None) -> np.ndarray:
    """Hash-grid features (N, L·F) at points x (N, 3)."""
    features = layout.config.encoding.features
    origin = np.asarray(layout.origin)
    columns = []
    for index, level in enumerate(layout.levels):
        if active is not None and index >= active:
            columns.append(np.zeros((len(x), features)))
            continue
        dims = np.asarray(level.dims)
        g = np.clip((x - origin) / level.cell_mm, 0.0, dims - 1)
        base = np.clip(np.floor(g).astype(np.int64), 0, dims - 2)
        f = g - base
        value = np.zeros((len(x), features))
        for c in range(8):
            corner = np.array([c & 1, (c >> 1) & 1, (c >> 2) & 1])
            weight = np.prod(np.where(corner == 1, f, 1.0 - f), axis=1)
            v = (base + corner).astype(np.uint64)
            if level.dense:
                entry = (v[:, 2] * dims[1] + v[:, 1]) * dims[0] + v[:, 0]
            else:
                mask = np.uint64(0xFFFFFFFF)
                yz = ((v[:, 1] * PRIME_Y) & mask) ^ ((v[:, 2] * PRIME_Z) & mask)
                h = v[:, 0] ^ yz if layout.config.encoding.hash == "xor" else (v[:, 0] + yz) & mask
                entry = h & np.uint64(level.size - 1)
            rows = level.offset + entry.astype(np.int64)[:, None] * features + np.arange(features)
            value += weight[:, None] * params[rows]
        columns.append(value)
    return np.concatenate(columns, axis=1)


def mlp(params: np.ndarray, offset: int, x: np.ndarray, widths: list[int]) -> np.ndarray:
    """ReLU hidden layers, linear output; weights row-major [out][in], then biases."""
    h = x
    for index, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        weights = params[offset : offset + fan_in * fan_out].reshape(fan_out, fan_in)
        bias = params[offset + fan_in * fan_out : offset + fan_in * fan_out + fan_out]
        offset += fan_in * fan_out + fan_out
        h = h @ weights.T + bias
        if index < len(widths) - 2:
            h = np.maximum(h, 0.0)
    return h


def geometry(layout: FieldLayout, params: np.ndarray, x: np.ndarray, active: int | None = None):
    """(distances (N, K) in mm, geometry features (N, G))."""
    enc, net = layout.config.encoding, layout.config.network
    outputs = layout.structures + net.geometry_features
    widths = [enc.levels * enc.features] + [net.hidden] * net.hidden_layers + [outputs]
    raw = mlp(params, layout.geometry_offset, encode(layout, params, x, active), widths)
    return net.distance_scale_mm * raw[:, : layout.structures], raw[:, layout.structures :]


def appearance(layout: FieldLayout, params: np.ndarray, feature: np.ndarray, inputs: np.ndarray) -> np.ndarray:
    """Sigmoid outputs (N, K·(3+M)): per structure the albedo then the materials."""
    net = layout.config.network
    widths = [net.geometry_features + layout.appearance_inputs, net.appearance_hidden,
              layout.structures * (3 + net.materials)]
    raw = mlp(params, layout.appearance_offset, np.concatenate([feature, inputs], axis=1), widths)
    return 1.0 / (1.0 + np.exp(-raw))


#: the corners of shaders/neural_field.slang's tetrahedral differences
TETRAHEDRON = np.array([[1, -1, -1], [-1, -1, 1], [-1, 1, -1], [1, 1, 1]], np.float64)


def distance_gradients(layout, params, x, h: float) -> np.ndarray:
    """∇s_k (N, K, 3) by the shader's tetrahedral differences at distance h."""
    e = h / np.sqrt(3.0)
    return sum(geometry(layout, params, x + e * corner)[0][..., None] * corner / (4 * e) for corner in TETRAHEDRON)


def segment_tetrahedron(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """(4, N, 3): a shaded segment's ends and the two corners (shaders/neural_field.slang's SegmentFrame) that
    make it an edge of a regular tetrahedron; the corners' frame around the segment is Duff et al.'s basis."""
    along = end - start
    length = np.linalg.norm(along, axis=1, keepdims=True)
    x, y, z = (along / length).T
    sign = np.where(z >= 0.0, 1.0, -1.0)
    a = -1.0 / (sign + z)
    b = x * y * a
    across = np.stack([1.0 + sign * x * x * a, sign * b, -sign * x], axis=1)
    away = np.stack([b, sign + y * y * a, -y], axis=1)
    base = 0.5 * (start + end) + np.sqrt(0.5) * length * away
    return np.stack([start, end, base + 0.5 * length * across, base - 0.5 * length * across])


def tetrahedron_gradients(corners: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(N, K, 3): ∇s_k of a regular tetrahedron's corners (4, N, 3) with values (4, N, K): exact for linear s,
    (3 / 4R²) Σ_j s(p_j) (p_j - c) for centre c and circumradius R."""
    centre = corners.mean(axis=0)
    offsets = corners - centre
    radius2 = (offsets ** 2).sum(axis=-1).mean(axis=0)
    return 3.0 / (4.0 * radius2)[:, None, None] * np.einsum("jnk,jnc->nkc", values, offsets)


def point_loss(layout, params, x, target, eikonal: bool, settings: dict) -> np.ndarray:
    """Per-point loss of shaders/sdf_fit.slang (N,)."""
    tau = settings["truncation"]
    distance, _ = geometry(layout, params, x)
    error = np.where(target >= tau, np.maximum(tau - distance, 0.0),
                     np.where(target <= -tau, np.maximum(distance + tau, 0.0), np.abs(distance - target)))
    loss = settings["dataScale"] * error.sum(axis=1)
    if eikonal:  # the tetrahedron whose first corner is x
        h = settings["eikonalStep"]
        gradient = distance_gradients(layout, params, x - (h / np.sqrt(3.0)) * TETRAHEDRON[0], h)
        loss = loss + settings["eikonalScale"] * ((np.linalg.norm(gradient, axis=-1) - 1.0) ** 2).sum(axis=1)
    return loss


def central_difference(function, values: np.ndarray, directions: np.ndarray, step: float) -> np.ndarray:
    """d function / d values along each direction (rows of ``directions``), central differences."""
    return np.array([(function(values + step * u) - function(values - step * u)) / (2 * step) for u in directions])


def tiny_config(log2_table: int = 10, coarsest_cells: int = 4, finest_cell_mm: float = 2.0):
    """The small field every field test uses (one shader compile shared by all of them)."""
    from NeuralRaycastLib.field.field import EncodingConfig, FieldConfig, NetworkConfig

    return FieldConfig(
        EncodingConfig(levels=8, features=2, log2_table=log2_table, coarsest_cells=coarsest_cells,
                       finest_cell_mm=finest_cell_mm),
        NetworkConfig(hidden=32, hidden_layers=1, geometry_features=3, appearance_hidden=16, materials=2,
                      distance_scale_mm=10.0),
    )


def far_from_zero_parameters(layout: FieldLayout, seed: int = 3) -> np.ndarray:
    """Parameters large enough that every layer is far from zero (initial tables are ~1e-4), rounded to float32
    exactly as the device holds them, in float64: what the gradient checks differentiate."""
    rng = np.random.default_rng(seed)
    values = layout.initial_parameters(seed=seed).astype(np.float64)
    values[: layout.geometry_offset] = rng.uniform(-1.0, 1.0, layout.geometry_offset)
    values[layout.geometry_offset :] += rng.normal(0.0, 0.05, layout.count - layout.geometry_offset)
    return values.astype(np.float32).astype(np.float64)
