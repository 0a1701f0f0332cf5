"""A float64 numpy re-implementation of shaders/gaussians.slang's ray integration, the reference for its checks.

Written from the definitions (parameter layout, truncated Gaussians, degree-1 spherical harmonics, segments
of a fixed length with early termination), without the grid: the grid only saves work, so the device must
give these values whatever its cells. ``texture``: a function of a point x (3,) giving each Gaussian's texture
factor there (N,), which scales its trained colour; ``highlight``: a function of the Gaussians' third axes (N, 3)
and the ray's direction giving each one's specular term (N,), added to it (gaussians/look.py); None: neither.
"""

from __future__ import annotations

import numpy as np

CUTOFF = np.exp(-4.5)
SH_C0, SH_C1 = 0.28209479177387814, 0.4886025119029199


def unpack(values: np.ndarray, n: int):
    v = np.asarray(values, np.float64)
    return (v[: 3 * n].reshape(n, 3), v[3 * n : 6 * n].reshape(n, 3), v[6 * n : 10 * n].reshape(n, 4),
            v[10 * n : 11 * n], v[11 * n : 29 * n].reshape(n, 6, 3))


def rotations(q: np.ndarray) -> np.ndarray:
    q = q / np.linalg.norm(q, axis=1, keepdims=True)
    w, x, y, z = q.T
    return np.stack([
        np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)], axis=1),
        np.stack([2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)], axis=1),
        np.stack([2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], axis=1),
    ], axis=1)


def density_and_colour(values: np.ndarray, n: int, density_scale: float, x: np.ndarray, d: np.ndarray,
                       texture=None, highlight=None):
    """(σ, σ·c) at a point x (3,) seen along d (3,): each Gaussian's density w G(x) |d · a|, a its third axis, and
    its colour: the linear colour times its texture factor at x, plus its specular term."""
    position, log_scale, quaternion, logit, sh = unpack(values, n)
    rotation = rotations(quaternion)
    local = np.einsum("nab,na->nb", rotation, x - position) / np.exp(log_scale)
    m2 = (local**2).sum(axis=1)
    g = np.where(m2 < 9.0, np.maximum(np.exp(-0.5 * m2) - CUTOFF, 0.0), 0.0)
    facing = rotation[:, :, 2] @ np.asarray(d, np.float64)
    wg = density_scale / (1.0 + np.exp(-logit)) * g * np.abs(facing)
    basis = np.stack([np.full_like(facing, SH_C0), np.full_like(facing, -SH_C1 * d[1]),
                      np.full_like(facing, SH_C1 * d[2]), np.full_like(facing, -SH_C1 * d[0]), np.abs(facing),
                      np.where(facing < 0.0, -1.0, 1.0)], axis=1)
    colour = np.einsum("nl,nlc->nc", basis, sh)
    if texture is not None:
        colour = colour * texture(np.asarray(x, np.float64))[:, None]
    if highlight is not None:
        colour = colour + highlight(rotation[:, :, 2], np.asarray(d, np.float64))[:, None]
    return wg.sum(), (wg[:, None] * colour).sum(axis=0)


def clip_to_box(origin, direction, low, high) -> tuple[float, float]:
    with np.errstate(divide="ignore"):
        t0, t1 = (np.asarray(low) - origin) / direction, (np.asarray(high) - origin) / direction
    near = max(np.minimum(t0, t1).max(), 0.0)
    return near, np.maximum(t0, t1).min()


def normal_at(values, n, density_scale, x, direction, h: float = 1e-5) -> np.ndarray:
    """-∇σ / |∇σ| at x by central differences of σ, turned towards the viewer (zero where σ is flat)."""
    gradient = np.array([(density_and_colour(values, n, density_scale, x + h * e, direction)[0]
                          - density_and_colour(values, n, density_scale, x - h * e, direction)[0]) / (2 * h)
                         for e in np.eye(3)])
    length = np.linalg.norm(gradient)
    if length <= 1e-12:
        return np.zeros(3)
    normal = -gradient / length
    return -normal if normal @ direction > 0 else normal


def march(values, n, density_scale, origin, direction, low, high, step, min_transmittance,
          normals: bool = False, texture=None, highlight=None) -> np.ndarray:
    """One ray's sums: premultiplied RGB, alpha, Σ weight·normal (zeros unless ``normals``) and Σ weight·t, the
    weight of a segment T·(1 - exp(-σ·step))."""
    near, far = clip_to_box(origin, direction, low, high)
    transmittance, rgb, normal, depth = 1.0, np.zeros(3), np.zeros(3), 0.0
    j = 0
    while (t := near + (j + 0.5) * step) < far:
        j += 1
        x = origin + t * direction
        sigma, weighted = density_and_colour(values, n, density_scale, x, direction, texture, highlight)
        if sigma <= 0.0:
            continue
        alpha = 1.0 - np.exp(-sigma * step)
        rgb += transmittance * alpha / sigma * weighted
        depth += transmittance * alpha * t
        if normals:
            normal += transmittance * alpha * normal_at(values, n, density_scale, x, direction)
        transmittance *= 1.0 - alpha
        if transmittance < min_transmittance:
            break
    return np.concatenate([rgb, [1.0 - transmittance], normal, [depth]])


def render(values, n, density_scale, rays, low, high, step, min_transmittance, texture=None,
           highlight=None) -> np.ndarray:
    """(R, 4) for rays (R, 6): origin then unit direction."""
    return render_sums(values, n, density_scale, rays, low, high, step, min_transmittance, texture=texture,
                       highlight=highlight)[:, :4]


def render_sums(values, n, density_scale, rays, low, high, step, min_transmittance, normals: bool = False,
                texture=None, highlight=None):
    """(R, 8): every ray's sums (:func:`march`)."""
    return np.stack([march(values, n, density_scale, r[:3], r[3:], low, high, step, min_transmittance, normals,
                           texture, highlight) for r in np.asarray(rays, np.float64)])


OCCUPANCY_EPSILON = 1e-3


def occupancy(values: np.ndarray, n: int, weights: np.ndarray, points: np.ndarray,
              geometry_thickness: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(M, K) occupancy o_k(x) = Σ_i sigmoid(l_ik + c_ik z_i(x)) G_i(x) / (Σ_i G_i(x) + ε) and (M,) coverage
    Σ_i G_i(x), each G_i read with its third axis's standard deviation times ``geometry_thickness`` and z_i(x) the
    third local coordinate so read; ``weights`` (N, 2K): the logits l, then the slopes c."""
    position, log_scale, quaternion, _, _ = unpack(values, n)
    weights = np.asarray(weights, np.float64)
    k = weights.shape[1] // 2
    local = np.einsum("nab,mna->mnb", rotations(quaternion), np.asarray(points, np.float64)[:, None] - position)
    scale = np.exp(log_scale) * np.array([1.0, 1.0, geometry_thickness])
    local = local / scale
    m2 = (local**2).sum(axis=2)
    shape = np.where(m2 < 9.0, np.maximum(np.exp(-0.5 * m2) - CUTOFF, 0.0), 0.0)
    logit = weights[None, :, :k] + weights[None, :, k:] * local[:, :, 2:3]  # (M, N, K)
    cover = shape.sum(axis=1)
    structure = 1.0 / (1.0 + np.exp(-logit))
    return np.einsum("mn,mnk->mk", shape, structure) / (cover + OCCUPANCY_EPSILON)[:, None], cover
