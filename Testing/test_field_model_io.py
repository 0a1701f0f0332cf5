"""Model files: save -> load gives the same field; damaged, foreign or mismatched files are refused."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import analytic_prepared
from field_reference import tiny_config
from safetensors.numpy import save_file

from NeuralRaycastLib.field.field import FieldLayout, NeuralField
from NeuralRaycastLib.field.model_io import (
    FORMAT_VERSION,
    METADATA_KEY,
    ModelFileError,
    StudyGeometry,
    load_field,
    load_model,
    save_field,
    save_model,
)

BOUNDS = np.array([[-40.0, -50.0, -30.0], [40.0, 45.0, 35.0]])


@pytest.fixture
def geometry() -> StudyGeometry:
    affine = np.diag([2.0, 2.0, 2.5, 1.0])
    affine[:3, 3] = (-42.0, -52.0, -32.0)
    structures = ["brain", "whole_tumor", "tumor_core", "enhancing_tumor"]
    colors = [(0.9, 0.8, 0.7), (0.9, 0.8, 0.3), (0.9, 0.4, 0.2), (0.8, 0.1, 0.2)]
    return StudyGeometry(affine, (43, 50, 28), BOUNDS, ["t1"], structures, colors)


@pytest.fixture
def layout(geometry) -> FieldLayout:
    return FieldLayout.build(tiny_config(), BOUNDS, len(geometry.structures), len(geometry.channel_names))


@pytest.fixture
def saved(tmp_path, layout, geometry) -> tuple[Path, np.ndarray]:
    params = np.random.default_rng(0).normal(size=layout.count).astype(np.float32)
    return save_model(tmp_path / "field.safetensors", layout, params, geometry, extra={"note": "x"}), params


def rewrite(path: Path, tensors=None, change=None) -> None:
    """Re-save a model file with its tensors and/or metadata altered (as a tamperer would)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        metadata = json.loads(handle.metadata()[METADATA_KEY])
        stored = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    if change:
        change(metadata)
    save_file(tensors(stored) if tensors else stored, str(path), metadata={METADATA_KEY: json.dumps(metadata)})


def test_round_trip(saved, layout, geometry):
    path, params = saved
    model = load_model(path, expected=geometry)
    np.testing.assert_array_equal(model.parameters, params)
    assert model.config == layout.config and model.layout == layout and model.extra == {"note": "x"}
    assert model.geometry.structures == geometry.structures and model.geometry.colors == geometry.colors
    np.testing.assert_array_equal(model.geometry.affine, geometry.affine)
    assert not list(path.parent.glob("*.partial"))


@pytest.mark.gpu
def test_loaded_field_gives_identical_outputs(gpu, tmp_path):
    sdfs = {name: (lambda p, r=r: np.linalg.norm(p, axis=-1) - r) for name, r in
            [("brain", 30.0), ("whole_tumor", 12.0), ("tumor_core", 8.0), ("enhancing_tumor", 5.0)]}
    prepared = analytic_prepared(sdfs, 4.0, (-40, -40, -40), (40, 40, 40))
    layout = FieldLayout.build(tiny_config(), prepared.bounds, len(prepared.structures), len(prepared.channel_names))
    params = np.random.default_rng(1).normal(0.0, 0.3, layout.count).astype(np.float32)
    field = NeuralField(gpu, layout, params)
    path = save_field(tmp_path / "fitted.safetensors", field, prepared)
    loaded = load_field(gpu, path, prepared)
    points = np.random.default_rng(2).uniform(-40, 40, (64, 3))
    np.testing.assert_array_equal(loaded.parameters(), params)
    np.testing.assert_array_equal(loaded.distances(points), field.distances(points))
    other = analytic_prepared(sdfs, 5.0, (-40, -40, -40), (40, 40, 40))
    with pytest.raises(ModelFileError, match="different study"):
        load_field(gpu, path, other)


def test_truncated_file_is_rejected(saved):
    path, _ = saved
    data = path.read_bytes()
    for length in (len(data) - 100, len(data) // 2, 10, 0):
        path.write_bytes(data[:length])
        with pytest.raises(ModelFileError, match="truncated or damaged"):
            load_model(path)


def test_modified_parameters_are_rejected(saved):
    path, _ = saved
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # one bit of the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="checksum"):
        load_model(path)


def test_replaced_tensor_is_rejected(saved):
    path, _ = saved
    rewrite(path, tensors=lambda t: {**t, "geometry": t["geometry"] * 1.01})
    with pytest.raises(ModelFileError, match="checksum"):
        load_model(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.update(format_version=FORMAT_VERSION + 1), "format version"),
        (lambda m: m.update(format="something-else"), "format"),
        (lambda m: m["config"]["network"].update(hidden=48), "parameters stored|differ|float32"),
        (lambda m: m["config"]["encoding"].update(bogus=1), "inconsistent metadata"),
        (lambda m: m["config"]["encoding"].pop("hash"), "inconsistent metadata"),
        (lambda m: m["config"]["encoding"].update(hash="crc32"), "inconsistent metadata"),
        (lambda m: m["config"]["network"].update(hidden=1000), "inconsistent metadata"),
        (lambda m: m["geometry"].update(structures=["brain"]), "inconsistent metadata|parameters stored"),
        (lambda m: m.pop("tensors_sha256"), "inconsistent metadata"),
        (lambda m: m.update(parameter_count=12), "parameters stored"),
    ],
)
def test_inconsistent_metadata_is_rejected(saved, change, message):
    path, _ = saved
    rewrite(path, change=change)
    with pytest.raises(ModelFileError, match=message):
        load_model(path)


def test_float16_copy_is_half_the_size_and_loads_as_float32(saved, tmp_path, layout, geometry):
    path, params = saved
    half = save_model(tmp_path / "half.safetensors", layout, params, geometry, precision="float16")
    assert half.stat().st_size < 0.55 * path.stat().st_size
    model = load_model(half)
    assert model.precision == "float16" and model.parameters.dtype == np.float32
    np.testing.assert_array_equal(model.parameters, params.astype(np.float16).astype(np.float32))
    rewrite(half, tensors=lambda t: {**t, "hash_table": t["hash_table"] * np.float16(1.01)})
    with pytest.raises(ModelFileError, match="checksum"):
        load_model(half)
    rewrite(half, change=lambda m: m.update(precision="float8"))
    with pytest.raises(ModelFileError, match="precision"):
        load_model(half)


def test_float16_refuses_parameters_beyond_its_range(tmp_path, layout, geometry):
    params = np.zeros(layout.count, np.float32)
    params[3] = 1e6
    with pytest.raises(ValueError, match="range of float16"):
        save_model(tmp_path / "half.safetensors", layout, params, geometry, precision="float16")
    assert not list(tmp_path.iterdir())


def as_version(version: int):
    """A metadata change that makes a file look written by an earlier version (without the keys it added)."""
    def change(metadata):
        metadata.update(format_version=version)
        metadata["config"]["encoding"].pop("hash")
        if version < 2:
            metadata.pop("precision")
    return change


@pytest.mark.parametrize("version", [1, 2])
def test_files_of_earlier_versions_load_with_the_hash_they_were_trained_with(saved, version):
    path, params = saved
    assert load_model(path).config.encoding.hash == "x_added"
    rewrite(path, change=as_version(version))
    model = load_model(path)
    np.testing.assert_array_equal(model.parameters, params)
    assert model.config.encoding.hash == "xor"


def test_foreign_and_missing_files_are_rejected(tmp_path):
    with pytest.raises(ModelFileError, match="no such model file"):
        load_model(tmp_path / "absent.safetensors")
    other = tmp_path / "other.safetensors"
    save_file({"weights": np.zeros(3, np.float32)}, str(other))
    with pytest.raises(ModelFileError, match="no NeuralRaycast metadata"):
        load_model(other)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(ModelFileError):
        load_model(junk)


def test_field_for_another_study_is_rejected(saved, geometry):
    path, _ = saved
    shifted = geometry.affine.copy()
    shifted[0, 3] += 1.0
    for other, message in [
        (replace(geometry, affine=shifted), "IJK-to-RAS"),
        (replace(geometry, shape=(43, 50, 29)), "grid shape"),
        (replace(geometry, channel_names=["flair"]), "channels"),
        (replace(geometry, structures=["brain", "whole_tumor", "tumor_core", "necrosis"]), "structures"),
    ]:
        with pytest.raises(ModelFileError, match=message):
            load_model(path, expected=other)


def test_export_of_a_model_beyond_float16_leaves_nothing_behind(tmp_path, layout, geometry):
    from dataclasses import asdict

    from NeuralRaycastLib.train.presets import RunSettings
    from NeuralRaycastLib.train.run_folder import RUN_VERSION, export_run

    run = tmp_path / "run"
    params = np.zeros(layout.count, np.float32)
    params[0] = 1e6
    save_model(run / "model.safetensors", layout, params, geometry)
    (run / "run.json").write_text(json.dumps({"version": RUN_VERSION, "settings": asdict(RunSettings("quick"))}))
    with pytest.raises(ValueError, match="range of float16"):
        export_run(run, tmp_path / "half")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert export_run(run, tmp_path / "copy", "float32") == tmp_path / "copy"
    np.testing.assert_array_equal(load_model(tmp_path / "copy" / "model.safetensors").parameters, params)
