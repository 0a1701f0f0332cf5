"""Staged training on a tiny analytic phantom: the held-out views and the geometry come out right, and a
cancel keeps a usable state."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import analytic_prepared
from field_reference import tiny_config

from NeuralRaycastLib.evaluate import geometry_metrics
from NeuralRaycastLib.field import FieldLayout, NeuralField
from NeuralRaycastLib.reference_views import render_reference_views
from NeuralRaycastLib.sample.phantom import Phantom
from NeuralRaycastLib.train import Trainer, preset

pytestmark = pytest.mark.gpu

SPACING = 2.5


@pytest.fixture(scope="module")
def phantom_views(gpu):
    phantom = Phantom()
    low = np.asarray(phantom.brain_centre) - np.asarray(phantom.brain_half_extent) - 6.0
    high = np.asarray(phantom.brain_centre) + np.asarray(phantom.brain_half_extent) + 6.0
    sdfs = {name: (lambda p, name=name: phantom.sdf(name, p)) for name in phantom.structure_names}
    prepared = analytic_prepared(sdfs, SPACING, low, high)
    views = render_reference_views(gpu, prepared, 8, 40, 40, held_out_every=4)
    return prepared, views


def new_field(gpu, prepared) -> NeuralField:
    layout = FieldLayout.build(tiny_config(log2_table=14, coarsest_cells=8, finest_cell_mm=SPACING),
                               prepared.bounds, len(prepared.structures), 1)
    return NeuralField(gpu, layout, seed=1)


def test_training_reproduces_held_out_views_and_the_segmentation(gpu, phantom_views):
    prepared, views = phantom_views
    field = new_field(gpu, prepared)
    config = replace(preset("quick"), appearance_steps=15, joint_steps=15, eval_every=15)
    config = replace(config, geometry=replace(config.geometry, steps=120))
    trainer = Trainer(gpu, prepared, field, views, config)
    log = trainer.run()
    assert not log.cancelled and log.skipped_steps == 0
    scores = [row["heldout_psnr"] for row in log.rows if "heldout_psnr" in row]
    assert len(scores) == 2
    assert scores[-1] > 30.0, scores
    assert log.rays == 30 * config.patches * config.patch_size**2
    geometry = geometry_metrics(field, prepared)
    for name in ("brain", "whole_tumor"):
        assert geometry[name]["dice"] > 0.9, geometry
        assert geometry[name]["mean_surface_distance_mm"] < SPACING, geometry


def test_cancel_keeps_a_finite_state(gpu, phantom_views):
    prepared, views = phantom_views
    field = new_field(gpu, prepared)
    config = replace(preset("quick"), appearance_steps=5, joint_steps=5)
    config = replace(config, geometry=replace(config.geometry, steps=20, monitor_every=10))
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 25  # during stage 2

    log = Trainer(gpu, prepared, field, views, config).run(should_stop=stop)
    assert log.cancelled
    assert np.all(np.isfinite(field.parameters()))
