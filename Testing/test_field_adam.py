"""Adam in Slang against a numpy reference, and the Python-side schedules."""

from __future__ import annotations

import numpy as np
import pytest

from NeuralRaycastLib.field.sdf_fit import FitConfig, active_levels, learning_rate_factor


def numpy_adam(values, grads, m, v, groups, rates, beta1, beta2, epsilon, step, sparse_groups):
    g = np.where(np.isfinite(grads), grads, 0.0)
    skip = (g == 0) & (((sparse_groups >> groups) & 1) == 1)
    m_new = np.where(skip, m, beta1 * m + (1 - beta1) * g)
    v_new = np.where(skip, v, beta2 * v + (1 - beta2) * g * g)
    update = rates[groups] * (m_new / (1 - beta1**step)) / (np.sqrt(v_new / (1 - beta2**step)) + epsilon)
    return np.where(skip, values, values - update), m_new, v_new


@pytest.mark.gpu
def test_adam_matches_reference_with_groups_sparsity_and_zeroing(gpu):
    import slangpy as spy

    module = gpu.load_module("adam")
    rng = np.random.default_rng(0)
    n = 257
    starts = [101, 182, n]  # groups 0, 1, 2 contiguous, as in a field's buffer (group 3 empty), meeting mid-vector
    groups = np.searchsorted(starts, np.arange(n), side="right").astype(np.int32)
    values = rng.normal(size=n).astype(np.float32)
    rates = np.array([1e-2, 3e-3, 1e-3, 0.0])
    beta1, beta2, epsilon, sparse = 0.9, 0.99, 1e-8, 1
    # The hash table's (group 0's) gradient in two copies, the second from `shifted` on (as a field's).
    shifted, table = n + (2 - n) % 4, starts[0]
    tensors = [spy.Tensor.from_numpy(gpu.device, a) for a in (values, np.zeros(shifted + table + 4, np.float32))]
    m = spy.Tensor.zeros(gpu.device, shape=(n,), dtype=float)
    v = spy.Tensor.zeros(gpu.device, shape=(n,), dtype=float)
    buffers = {"values": tensors[0].storage.device_address, "grads": tensors[1].storage.device_address,
               "m": m.storage.device_address, "v": v.storage.device_address, "count": n, "groupStart": starts,
               "shifted": shifted, "shiftedCount": table}
    ref_values, ref_m, ref_v = values.astype(np.float64), np.zeros(n), np.zeros(n)
    for step in range(1, 4):
        grads = rng.normal(size=n).astype(np.float32)
        grads[::7] = 0.0  # sparse entries of group 0 keep their state
        grads[20:28] = 0.0  # whole vectors of them too
        grads[5] = np.nan  # a bad gradient is dropped, not propagated
        grads[190] = np.inf
        # Split between the copies: some entries in one of them only, some in both, some cancelling out.
        copies = np.zeros(shifted + table + 4, np.float32)
        copies[:n] = grads
        second = rng.normal(size=table).astype(np.float32) * (rng.uniform(size=table) < 0.5)
        second[::7] = second[20:28] = 0.0
        copies[:table] -= second
        copies[shifted : shifted + table] = second
        copies[30], copies[shifted + 30] = 0.0, grads[30]  # in the second copy alone
        copies[40:44], copies[shifted + 40 : shifted + 44] = 1.5, -1.5  # cancelling: a gradient of 0
        tensors[1].copy_from_numpy(copies)
        grads = copies[:n].copy()
        grads[:table] += copies[shifted : shifted + table]  # the sum in float32, as Adam forms it
        settings = {
            "rates": spy.float4(*rates), "beta1": beta1, "beta2": beta2, "epsilon": epsilon,
            "correction1": 1 / (1 - beta1**step), "correction2": 1 / (1 - beta2**step), "sparseGroups": sparse,
        }
        # a few parameters a thread (257 = 4 · 64 + 1: a vector's worth, then one alone); threads past the end
        # do nothing
        module.adamStep(spy.grid((n + 31,)), buffers, settings)
        ref_values, ref_m, ref_v = numpy_adam(ref_values, grads.astype(np.float64), ref_m, ref_v, groups, rates,
                                              beta1, beta2, epsilon, step, sparse)
        np.testing.assert_allclose(tensors[0].to_numpy(), ref_values, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(m.to_numpy(), ref_m, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(v.to_numpy(), ref_v, rtol=1e-5, atol=1e-9)
        assert not tensors[1].to_numpy().any(), "gradients are zeroed after the step"
    assert np.all(np.isfinite(tensors[0].to_numpy()))
    index = np.arange(n)
    quiet = (index % 7 == 0) | ((index >= 20) & (index < 28)) | ((index >= 40) & (index < 44))
    untouched = quiet & (groups == 0)
    np.testing.assert_array_equal(tensors[0].to_numpy()[untouched], values[untouched])
    fed = ~quiet & (np.arange(n) != 5) & (np.arange(n) != 190)  # a finite, non-zero gradient
    assert np.all(tensors[0].to_numpy()[fed] != values[fed])


def test_learning_rate_schedule():
    config = FitConfig(steps=1000, warmup_steps=100, final_rate_fraction=0.1)
    factors = np.array([learning_rate_factor(s, config) for s in range(config.steps + 1)])
    assert factors[0] == pytest.approx(0.01) and factors[99] == pytest.approx(1.0)
    assert np.all(np.diff(factors[:100]) > 0) and np.all(np.diff(factors[100:]) <= 1e-12)
    assert factors[100] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1)
    assert factors[550] == pytest.approx(0.55)


def test_coarse_to_fine_levels():
    config = FitConfig(steps=100, coarse_to_fine=0.5, start_levels=4)
    levels = [active_levels(s, config, 8) for s in range(100)]
    assert levels[0] == 4 and levels[49] == 7 and levels[50] == 8 and levels[-1] == 8
    assert levels == sorted(levels)
    assert active_levels(0, FitConfig(coarse_to_fine=0.0), 8) == 8
