"""Gaussian model files: written and read back exactly, and refused (ModelFileError naming the file) when they
come from an unknown or an earlier version, hold tensors of the wrong shape or inconsistent settings, or were made
for another study."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load, save

from NeuralRaycastLib.field.model_io import METADATA_KEY, ModelFileError, StudyGeometry, _digest
from NeuralRaycastLib.gaussians.look import Highlights
from NeuralRaycastLib.gaussians.model_io import GaussianModel, encode_gaussians, load_gaussians, save_gaussians
from NeuralRaycastLib.gaussians.scene import GaussianSet, GridShape, MarchSettings


def model(count: int = 5) -> GaussianModel:
    rng = np.random.default_rng(0)
    gaussians = GaussianSet(rng.normal(size=(count, 3)), rng.normal(size=(count, 3)), rng.normal(size=(count, 4)),
                            rng.normal(size=count), rng.normal(size=(count, 6, 3)), rng.normal(size=(count, 8)))
    geometry = StudyGeometry(np.eye(4), (10, 12, 8), np.array([[0.0, 0, 0], [9, 11, 7]]), ["t1"], ["brain"],
                             [(0.8, 0.7, 0.6)])
    grid = GridShape.for_box(geometry.bounds, 2.0)
    return GaussianModel(gaussians, grid, 0.7, MarchSettings(0.4, 1e-3), geometry, {"preset": "quick"},
                         rng.normal(size=(count, 2)).astype(np.float32), 0.5, Highlights((0.6, 0.0, 0.8), 24.0))


def test_round_trip_is_exact(tmp_path):
    written = model()
    read = load_gaussians(save_gaussians(tmp_path / "g.safetensors", written), written.geometry)
    assert read.gaussians.flat().tobytes() == written.gaussians.flat().tobytes()
    assert read.gaussians.looks.tobytes() == written.gaussians.looks.tobytes()
    assert read.structures.tobytes() == written.structures.tobytes()
    assert (read.grid, read.density_scale, read.march, read.extra) == (written.grid, 0.7, written.march,
                                                                        {"preset": "quick"})
    assert read.geometry_thickness == 0.5 and read.highlights == written.highlights


def test_inconsistent_settings_are_refused(tmp_path):
    """A file without its geometry thickness or its highlights, or with values outside their range, is refused."""
    for change, message in ((lambda m, t: m.pop("geometry_thickness"), "inconsistent metadata"),
                            (lambda m, t: m.update(geometry_thickness=2.0), "geometry thickness 2.0"),
                            (lambda m, t: m.pop("highlights"), "inconsistent metadata"),
                            (lambda m, t: m["highlights"].update(key_direction=[1, 1, 0]), "highlights")):
        with pytest.raises(ModelFileError, match=message):
            load_gaussians(rewritten(tmp_path, change))


def rewritten(tmp_path, change) -> str:
    """A model file whose metadata or tensors ``change`` altered (with its checksum kept valid)."""
    data = encode_gaussians(model())
    tensors = load(data)
    path = tmp_path / "source.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), framework="numpy") as handle:
        metadata = json.loads(handle.metadata()[METADATA_KEY])
    change(metadata, tensors)
    metadata["tensors_sha256"] = _digest(tensors)
    target = tmp_path / "changed.safetensors"
    target.write_bytes(save(tensors, metadata={METADATA_KEY: json.dumps(metadata)}))
    return str(target)


def test_unknown_version_is_refused(tmp_path):
    path = rewritten(tmp_path, lambda m, t: m.update(format_version=99))
    with pytest.raises(ModelFileError, match="format version 99 is not supported") as error:
        load_gaussians(path)
    assert path in str(error.value)


def test_tensor_of_the_wrong_shape_is_refused(tmp_path):
    path = rewritten(tmp_path, lambda m, t: t.update(colours=t["colours"][:, :3]))
    with pytest.raises(ModelFileError, match="tensor 'colours'"):
        load_gaussians(path)


def test_model_of_another_study_is_refused(tmp_path):
    written = model()
    path = save_gaussians(tmp_path / "g.safetensors", written)
    other = StudyGeometry(np.eye(4), (10, 12, 9), written.geometry.bounds, ["t1"], ["brain"], [(0.8, 0.7, 0.6)])
    with pytest.raises(ModelFileError, match="made for a different study: grid shape"):
        load_gaussians(path, other)


def test_non_finite_gaussians_are_not_written(tmp_path):
    broken = model()
    broken.gaussians.positions[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        save_gaussians(tmp_path / "g.safetensors", broken)
    assert not (tmp_path / "g.safetensors").exists()


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
def test_files_of_earlier_versions_are_refused_with_what_to_do(tmp_path, version):
    """Before version 6 a Gaussian's colour was a sigmoid and took nothing from its structure's look (before 3 its
    density did not follow its orientation either): such a file would render otherwise than it was trained, so it
    is refused in one line naming it and saying to fit again."""
    path = rewritten(tmp_path, lambda metadata, tensors: metadata.update(format_version=version))
    with pytest.raises(ModelFileError, match=f"format version {version}.*fit the study again") as error:
        load_gaussians(path)
    assert str(path) in str(error.value) and len(str(error.value).splitlines()) == 1


def test_a_version_6_file_reads_with_structure_slopes_of_zero(tmp_path):
    """Version 6 had no structure slopes: its logits were trained for an occupancy without them, which zero slopes
    give exactly, so the file is read as it was written."""
    def as_version_6(metadata, tensors):
        metadata["format_version"] = 6
        del tensors["structure_slopes"]

    written = model()
    read = load_gaussians(rewritten(tmp_path, as_version_6))
    np.testing.assert_array_equal(read.structures[:, :1], written.structures[:, :1])
    assert not read.structures[:, 1:].any()
    assert read.gaussians.flat().tobytes() == written.gaussians.flat().tobytes()


def test_structure_weights_of_the_wrong_shape_are_refused(tmp_path):
    for name in ("structures", "structure_slopes"):
        path = rewritten(tmp_path, lambda m, t, name=name: t.update({name: np.zeros((5, 2), np.float32)}))
        with pytest.raises(ModelFileError, match=f"tensor '{name}'") as error:
            load_gaussians(path)
        assert path in str(error.value)
    without = model()
    without.structures = None
    with pytest.raises(ValueError, match="structure weights"):
        save_gaussians(tmp_path / "g.safetensors", without)
    assert not (tmp_path / "g.safetensors").exists()
