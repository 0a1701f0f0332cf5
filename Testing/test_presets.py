"""The presets' one table: what each run gets by default, what a user can override, and what the help says."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from NeuralRaycastLib.app.cli import build_parser
from NeuralRaycastLib.train.presets import AUTO, PRESETS, RunSettings, get_preset, training_schedule


def device(software: bool) -> SimpleNamespace:
    return SimpleNamespace(report=SimpleNamespace(software=software))


@pytest.mark.parametrize("name", [None, "", AUTO])
def test_the_device_picks_the_preset_when_none_is_named(name):
    quick = RunSettings.for_device(device(True), name)
    assert (quick.preset, quick.views, quick.size, quick.max_voxels) == ("quick", 16, 128, 96)
    standard = RunSettings.for_device(device(False), name)
    assert (standard.preset, standard.views, standard.size, standard.max_voxels) == ("standard", 24, 512, None)


def test_overrides_replace_the_presets_values_and_zeros_keep_them():
    settings = RunSettings.for_device(device(True), "high", views=6, size=0, iterations=None, seed=3, shadows=True)
    assert (settings.preset, settings.views, settings.size, settings.seed, settings.shadows) == (
        "high", 6, PRESETS["high"].size, 3, True)


def test_an_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="unknown preset 'fast' \\(choose from quick, standard, high\\)"):
        RunSettings.for_device(device(False), "fast")


def test_a_runs_schedule_is_its_presets_scaled_to_its_iterations_with_its_shadows():
    base = training_schedule("quick", seed=2)
    assert base.seed == base.geometry.seed == 2 and base.patches == 4 and base.geometry.steps == 300
    settings = replace(RunSettings.for_device(device(True)), iterations=48, shadows=True, seed=2)
    scheduled = settings.schedule()
    steps = (scheduled.geometry.steps, scheduled.appearance_steps, scheduled.joint_steps)
    assert sum(steps) == 48 and steps[0] > steps[1] > steps[2] and scheduled.shadows
    given = replace(base, joint_steps=7)
    assert settings.schedule(given).joint_steps == 7 and settings.schedule(given).shadows  # taken whole


def test_the_help_is_generated_from_the_table():
    fit = next(a for a in build_parser()._subparsers._group_actions[0].choices["fit"]._actions
               if "--preset" in a.option_strings)
    assert fit.choices == [AUTO, *PRESETS]
    for preset in PRESETS.values():
        assert preset.describe() in fit.help
    assert get_preset("quick").describe() == "quick (a CPU: study at most 96 voxels a side, 16 views of 128²)"


@pytest.mark.parametrize("name", ["quick", "standard"])
def test_a_pretrained_run_fits_the_geometry_alone_on_its_presets_shorter_schedule(name):
    """``fit --appearance pretrained``: no rendering stage, stage 1 as the preset's ``pretrained_fit`` (fewer steps
    than the whole schedule's, the warm-up shorter with them); ``iterations`` or a given schedule still rule."""
    settings = RunSettings(name, seed=3)
    whole, pretrained = settings.schedule(), settings.schedule(pretrained=True)
    assert (pretrained.appearance_steps, pretrained.joint_steps) == (0, 0)
    assert pretrained.geometry.steps < whole.geometry.steps
    assert pretrained.geometry.warmup_steps < whole.geometry.warmup_steps < pretrained.geometry.steps
    assert pretrained.geometry.batch >= whole.geometry.batch and pretrained.geometry.seed == 3
    assert replace(pretrained.geometry, steps=whole.geometry.steps, warmup_steps=whole.geometry.warmup_steps,
                   batch=whole.geometry.batch) == whole.geometry  # the rest of stage 1 as the preset's
    scaled = replace(settings, iterations=40).schedule(pretrained=True)
    assert scaled.geometry == replace(settings, iterations=40).schedule().geometry and scaled.joint_steps == 0
    given = training_schedule(name).with_total_steps(9)
    assert settings.schedule(given, pretrained=True).geometry == given.geometry
