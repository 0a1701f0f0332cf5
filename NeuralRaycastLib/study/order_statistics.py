"""Order statistics of large arrays without sorting or partitioning all of them: the few values near the rank
sought are found by a sample, counted and partitioned alone, with what numpy gives bit for bit."""

from __future__ import annotations

import numpy as np

#: The share of the values either side of the rank sought that :func:`neighbouring_order_statistics` first
#: looks among.
ORDER_BRACKET_SHARE = 0.01


def neighbouring_order_statistics(values: np.ndarray, rank: int) -> tuple[float, float]:
    """The values of ranks ``rank`` and ``rank + 1`` (from 0) of a flat array, as ``np.partition`` gives them: a
    sample's quantiles bracket them, and only the values within the bracket are partitioned, where the bracket
    holds both (else all of them are)."""
    sample = np.sort(values[:: max(1, values.size // (1 << 16))])
    share = rank / values.size
    low, high = (sample[min(int(q * len(sample)), len(sample) - 1)]
                 for q in (max(share - ORDER_BRACKET_SHARE, 0.0), min(share + ORDER_BRACKET_SHARE, 1.0)))
    lower = int(np.count_nonzero(values < low))
    bracket = values[(values >= low) & (values <= high)]
    if lower <= rank and rank + 1 < lower + len(bracket):
        values, rank = bracket, rank - lower
    first, second = np.partition(values, (rank, rank + 1))[[rank, rank + 1]]
    return first, second


def percentile(values: np.ndarray, q: float):
    """``np.percentile(values, q)`` (its linear method), bit for bit and of the same type: the two values it
    interpolates between are found by :func:`neighbouring_order_statistics`, and numpy interpolates them with
    the same weight (on an array of those two, whose virtual index is that weight exactly). A channel's robust
    range and the brain mask's scale take it on every voxel of a study."""
    flat = np.asarray(values).ravel(order="K")
    virtual = (flat.size - 1) * np.true_divide(q, 100)  # numpy's virtual index for the linear method
    rank = int(np.floor(virtual))
    if not 0 <= rank < flat.size - 1 or (flat.dtype.kind in "fc" and np.isnan(flat.max())):
        return np.percentile(values, q)  # an end, or a NaN (which makes numpy's answer NaN)
    low, high = neighbouring_order_statistics(flat, rank)
    return np.quantile(np.array([low, high], flat.dtype), float(virtual - rank))
