"""Kernels that do not depend on the study: studies with other numbers of structures (and channels), another box
and other voxels train on the kernels already compiled, with the results of fields of their own sizes.

The field's kernels hold a capacity of structures and appearance inputs (field.py's FieldLayout.kernels) and are
told which levels of the hash grid are dense; the studies here fit the same capacity, so the second compiles
nothing: no Slang module and no kernel built in this process while it trains, counted at slangpy's own entry
points.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
from conftest import analytic_prepared
from field_reference import appearance, geometry, tiny_config

from NeuralRaycastLib.field.field import FieldLayout, NeuralField
from NeuralRaycastLib.render.reference_views import render_reference_views
from NeuralRaycastLib.study.sample.phantom import Phantom
from NeuralRaycastLib.train.evaluate import geometry_metrics
from NeuralRaycastLib.train.presets import training_schedule
from NeuralRaycastLib.train.trainer import Trainer

SPACING = 2.5  # as test_train's phantom: in one test session the two share their kernels


@contextmanager
def counted_compiles() -> Iterator[dict[str, list]]:
    """What this process compiles while open: Slang modules (the field's, kept as files of generated source, and
    the code slangpy generates for a call of a new signature), by name, compute pipelines (a kernel each), by
    label, and the call data slangpy builds for a kernel's call of a signature it has not seen (its function)."""
    import slangpy as spy
    from slangpy.core.calldata import CallData

    counts: dict[str, list] = {"modules": [], "pipelines": [], "call data": []}
    load, load_file = spy.SlangSession.load_module_from_source, spy.SlangSession.load_module
    build = spy.Device.create_compute_pipeline
    make_call_data = CallData.__init__

    def counted(loader):
        def counted_load(self, *args, **kwargs):
            counts["modules"].append(str(args[0] if args else kwargs.get("module_name")))
            return loader(self, *args, **kwargs)

        return counted_load

    def counted_build(self, *args, **kwargs):
        counts["pipelines"].append(str(kwargs.get("label")))
        return build(self, *args, **kwargs)

    def counted_call_data(self, *args, **kwargs):
        counts["call data"].append(str(getattr(args[0] if args else None, "name", "?")))
        return make_call_data(self, *args, **kwargs)

    spy.SlangSession.load_module_from_source, spy.SlangSession.load_module = counted(load), counted(load_file)
    spy.Device.create_compute_pipeline = counted_build
    CallData.__init__ = counted_call_data
    try:
        yield counts
    finally:
        spy.SlangSession.load_module_from_source, spy.SlangSession.load_module = load, load_file
        spy.Device.create_compute_pipeline = build
        CallData.__init__ = make_call_data


def phantom_study(names: tuple[str, ...], channels: int, spacing: float = SPACING, margin: float = 6.0):
    """The analytic phantom with only the structures ``names`` and ``channels`` MRI channels, sampled every
    ``spacing`` mm in its bounds grown by ``margin`` mm."""
    phantom = Phantom(brain_tilt_degrees=(0.0, 0.0, 0.0))
    low, high = phantom.bounds(margin)
    sdfs = {name: (lambda p, name=name: phantom.sdf(name, p)) for name in names}
    return analytic_prepared(sdfs, spacing, low, high, channel_count=channels)


def study_layout(prepared) -> FieldLayout:
    """The tests' small field over the study's box, its finest cells the study's voxels (as field_config_for)."""
    return FieldLayout.build(tiny_config(log2_table=14, coarsest_cells=8, finest_cell_mm=float(prepared.spacing.min())),
                             prepared.bounds, len(prepared.structures), len(prepared.channel_names))


def train(gpu, prepared) -> tuple[NeuralField, Trainer]:
    """A short run through every stage (the SDF fit, the appearance and the joint steps, held-out renders)."""
    field = NeuralField(gpu, study_layout(prepared), seed=1)
    views = render_reference_views(gpu, prepared, 4, 32, 32, held_out_every=4)
    config = replace(training_schedule("quick"), appearance_steps=2, joint_steps=2, eval_every=4, patches=4)
    config = replace(config, geometry=replace(config.geometry, steps=80, batch=1 << 12))
    trainer = Trainer(gpu, prepared, field, views, config)
    log = trainer.run()
    assert not log.cancelled and log.skipped_steps == 0
    assert any(np.isfinite(row["heldout_psnr"]) for row in log.rows if "heldout_psnr" in row)
    return field, trainer


def unused_weights(field: NeuralField) -> np.ndarray:
    """The device's parameters in the kernels' places that the study does not use."""
    unused = np.setdiff1d(np.arange(field.kernels.count), field.layout.kernel_positions)
    return field.kernel_parameters()[unused]


@pytest.mark.parametrize(("structures", "channels"), [(1, 1), (3, 2), (4, 4), (6, 3)])
def test_the_kernels_networks_padded_with_zeros_compute_the_studys_own(structures, channels):
    """Laid out for the kernels (field.py's pad), the study's parameters give the kernels' networks the study's
    distances, features and appearance in the study's places, whatever the unused inputs hold; unpad undoes it."""
    layout = FieldLayout.build(tiny_config(), np.array([[-4.0, 2.0, 1.0], [16.0, 26.0, 17.0]]), structures, channels)
    kernels = layout.kernels
    assert kernels.capacity == layout.capacity == (4 if structures <= 4 else 8, 5)
    assert (kernels.structures, kernels.appearance_inputs) == layout.capacity
    rng = np.random.default_rng(2)
    params = layout.initial_parameters(seed=2) + rng.normal(0.0, 0.1, layout.count).astype(np.float32)
    padded = layout.pad(params)
    assert padded.shape == (kernels.count,) and np.array_equal(layout.unpad(padded), params)
    assert np.count_nonzero(padded) == np.count_nonzero(params)
    points = rng.uniform([-4.0, 2.0, 1.0], [16.0, 26.0, 17.0], (32, 3))
    distance, feature = geometry(layout, params, points)
    kernel_distance, kernel_feature = geometry(kernels, padded, points)
    np.testing.assert_allclose(kernel_distance[:, :structures], distance, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(kernel_distance[:, structures:], 0.0)  # zero weights and biases
    np.testing.assert_allclose(kernel_feature, feature, rtol=1e-6, atol=1e-6)
    inputs = rng.uniform(size=(32, layout.appearance_inputs))
    unused = rng.uniform(size=(32, kernels.appearance_inputs - layout.appearance_inputs))  # zeros on the device
    values = appearance(kernels, padded, feature, np.concatenate([inputs, unused], axis=1))
    outputs = structures * (3 + layout.config.network.materials)
    np.testing.assert_allclose(values[:, :outputs], appearance(layout, params, feature, inputs), rtol=1e-6, atol=1e-6)
    if structures == 4 and channels == 4:  # the sample's counts: its own kernels, nothing padded
        assert kernels is layout and np.array_equal(padded, params)


@pytest.mark.parametrize("hash_name", ["x_added", "xor"])
def test_studies_whose_box_and_voxels_make_other_levels_dense_share_one_kernel_source(hash_name):
    """The standard field over boxes of BraTS, clinical and small studies with voxels of 0.5 to 3 mm: from 8 to
    all 16 levels dense, one kernel source (one compile) for each structure capacity."""
    from NeuralRaycastLib.field.field import field_config_for, field_source

    for structures in (3, 6):
        layouts = []
        for box in ((240.0, 240.0, 155.0), (256.0, 256.0, 168.0), (128.0, 128.0, 128.0)):
            for voxel_mm in (0.5, 1.0, 3.0):
                config = field_config_for(voxel_mm)
                config = replace(config, encoding=replace(config.encoding, hash=hash_name))
                layouts.append(FieldLayout.build(config, np.array([(0.0, 0.0, 0.0), box]), structures, 4))
        assert {layout.dense_levels for layout in layouts} == {8, 9, 10, 12, 16}
        assert len({field_source(layout) for layout in layouts}) == 1


@pytest.mark.gpu
def test_a_study_with_other_counts_box_and_voxels_compiles_nothing_and_trains_its_own_field(gpu):
    """The second study has other structure and channel counts, and a box and voxels that make another number of
    the hash grid's levels dense: it trains on the first's kernels."""
    first = phantom_study(("brain", "whole_tumor", "tumor_core"), channels=2)
    second = phantom_study(("brain",), channels=1, spacing=3.0, margin=3.0)
    layouts = [study_layout(prepared) for prepared in (first, second)]
    assert layouts[0].dense_levels != layouts[1].dense_levels, [layout.dense_levels for layout in layouts]
    assert layouts[0].kernels.defines() == layouts[1].kernels.defines()
    with counted_compiles() as compiled:
        field, _ = train(gpu, first)
    fields = {"first": field}
    with counted_compiles() as compiled:
        fields["second"], _ = train(gpu, second)
    assert compiled == {"modules": [], "pipelines": [], "call data": []}, compiled

    for name, prepared in (("first", first), ("second", second)):
        field = fields[name]
        count = len(prepared.structures)
        assert field.kernels.structures == 4 and field.kernels.appearance_inputs == 5
        assert field.structures == count and field.layout.kernels.count > field.layout.count
        # The unused places took no gradient all through training: still zero, so nothing of them shows.
        assert unused_weights(field).size > 0 and not unused_weights(field).any()
        points = prepared.bounds[0] + np.random.default_rng(0).uniform(size=(64, 3)) * np.ptp(prepared.bounds, axis=0)
        assert field.distances(points).shape == (64, count)
        assert field.parameters().shape == (field.layout.count,)
        geometry = geometry_metrics(field, prepared)
        assert sorted(geometry) == sorted(s.name for s in prepared.structures)
        assert geometry["brain"]["dice"] > 0.9, (name, geometry)
        assert geometry["brain"]["mean_surface_distance_mm"] < prepared.spacing.min(), (name, geometry)


@pytest.mark.gpu
def test_the_warm_up_compiles_the_other_capacity_when_asked_and_a_study_with_fewer_structures_needs_none(
        gpu, phantom_study_dir, tmp_path, monkeypatch):
    """``neuralraycast warmup --all-capacities``: every part once for the study's own capacity and once for the
    other, each with its stamp. The stamp's key is the kernels', not the study's: the same study with a
    structure fewer finds the warm-up done."""
    from NeuralRaycastLib.gpu.device import STRUCTURE_SLOTS
    from NeuralRaycastLib.train import warmup
    from NeuralRaycastLib.train.presets import RunSettings
    from NeuralRaycastLib.train.run_folder import prepare_for_run

    calls = []
    monkeypatch.setattr(warmup, "tiny_views", lambda gpu, prepared: None)
    monkeypatch.setattr(warmup, "warm_up_part",
                        lambda gpu, prepared, views, settings, part, slots=None: calls.append((part, slots)))

    def in_processes(study_path, settings, backend, jobs, report, should_stop, python, slots=None):
        """On a GPU the parts run in worker processes of their own: each is asked for, as in this process."""
        calls.extend((part, slots) for part in warmup.PARTS)
        return {title: 0.0 for title in warmup.PARTS.values()}

    monkeypatch.setattr(warmup, "_parts_in_processes", in_processes)
    monkeypatch.setattr(warmup, "warm_up_stamp", lambda gpu, prepared, settings, slots=None: tmp_path / "stamps" / (
        warmup.kernels_key(gpu, prepared, settings, slots) + ".json"))
    settings = RunSettings.for_device(gpu, "quick")
    seconds = warmup.warm_up(gpu, phantom_study_dir, settings, structure_slots=STRUCTURE_SLOTS)
    assert calls == [(part, None) for part in warmup.PARTS] + [(part, 8) for part in warmup.PARTS]
    assert [title for title in seconds if title.startswith("8 structures: ")] == [
        "8 structures: " + title for title in warmup.PARTS.values()]
    prepared = prepare_for_run(phantom_study_dir, settings)
    assert len(prepared.structures) == 4
    stamps = {warmup.warm_up_stamp(gpu, prepared, settings, slots) for slots in (None, 8)}
    assert len(stamps) == 2 and all(stamp.exists() for stamp in stamps)
    fewer = replace(prepared, structures=prepared.structures[:3], boundary=prepared.boundary[:3])
    assert warmup.warm_up_stamp(gpu, fewer, settings) in stamps
