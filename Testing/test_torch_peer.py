"""The PyTorch peer of the SDF fit (bench suite torch_peer) against the Slang field it imitates.

PyTorch is not a dependency: the tests that need it are skipped where it is not installed.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import phantom_prepared

from NeuralRaycastLib.bench.torch_peer import (
    TORCH_MISSING,
    PeerBatches,
    PeerFitter,
    box_points,
    check_distances,
    perturbed_parameters,
)
from NeuralRaycastLib.field.field import FieldLayout, NeuralField
from NeuralRaycastLib.field.sdf_fit import FitConfig, SdfFitter

SPACING = 2.5  # mm, as test_field_fit


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def study():
    """The phantom, the small field's layout (the one for software devices) and its initial parameters."""
    _, prepared = phantom_prepared(SPACING)
    layout = FieldLayout.for_study(prepared, small=True)
    return prepared, layout, layout.initial_parameters(seed=0)


@pytest.fixture(scope="module")
def slang(gpu, study):
    """The Slang field at the initial parameters, its geometry network per thread (as the peer's, fp32)."""
    return NeuralField(gpu, study[1], study[2], cooperative=False)


def peer_model(layout, parameters):
    from NeuralRaycastLib.bench.torch_peer import TorchGeometryField

    return TorchGeometryField(layout, parameters)


def test_the_module_imports_and_explains_without_torch(monkeypatch):
    import NeuralRaycastLib.bench.torch_peer as peer

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(RuntimeError, match="PyTorch is not installed"):
        peer.bench_torch_peer(None, None, True, lambda message, fraction: None)
    assert "not a dependency" in TORCH_MISSING


@pytest.mark.gpu
def test_torch_distances_equal_the_slang_fields(torch, study, slang):
    _, layout, initial = study
    points = box_points(layout, 3000, seed=1)
    levels = len(layout.levels)
    for active in (levels, 3):
        difference = check_distances(slang, peer_model(layout, initial), points, active, "initial")
        print(f"initial parameters, {active} levels: max |s_torch - s_slang| = {difference:.3g} mm")
        assert difference <= 1e-5
    perturbed = perturbed_parameters(layout)
    slang.set_parameters(perturbed)
    try:
        model = peer_model(layout, perturbed)
        for active in (levels, 3):
            difference = check_distances(slang, model, points, active, "perturbed")
            print(f"table in U(-1, 1), {active} levels: max |s_torch - s_slang| = {difference:.3g} mm")
            assert difference <= 1e-4
        np.testing.assert_array_equal(model.flat_parameters(perturbed), perturbed)
    finally:
        slang.set_parameters(initial)


@pytest.mark.gpu
def test_torch_batch_and_loss_equal_the_slang_fitters(torch, gpu, study, slang):
    prepared, layout, initial = study
    config = FitConfig(batch=2048)
    slang_loss = SdfFitter(gpu, prepared, slang, config).loss()
    peer = PeerFitter(peer_model(layout, initial), PeerBatches(prepared, config, torch.device("cpu")), config)
    peer_loss = peer.loss(0, active=len(layout.levels))
    print(f"batch loss: Slang {slang_loss:.7g}, torch {peer_loss:.7g}")
    assert peer_loss == pytest.approx(slang_loss, rel=1e-5)


def test_torch_adam_steps_reduce_the_loss(torch, study):
    prepared, layout, initial = study
    config = FitConfig(batch=2048, steps=40, warmup_steps=5)
    peer = PeerFitter(peer_model(layout, initial), PeerBatches(prepared, config, torch.device("cpu")), config)
    before = peer.loss(0)
    for _ in range(25):
        peer.step()
    after = peer.loss(0)
    print(f"loss of the first batch: {before:.4g} before, {after:.4g} after 25 steps")
    assert np.isfinite(after) and after < 0.8 * before
    assert not np.array_equal(peer.model.flat_parameters(initial), initial)
