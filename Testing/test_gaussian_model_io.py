"""Gaussian model files: written and read back exactly, and refused (ModelFileError naming the file) when they
come from an unknown or an earlier version, hold tensors of the wrong shape, or were made for another study."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load, save

from NeuralRaycastLib.field.model_io import METADATA_KEY, ModelFileError, StudyGeometry, _digest
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
                         rng.normal(size=(count, 1)).astype(np.float32), 0.5)


def test_round_trip_is_exact(tmp_path):
    written = model()
    read = load_gaussians(save_gaussians(tmp_path / "g.safetensors", written), written.geometry)
    assert read.gaussians.flat().tobytes() == written.gaussians.flat().tobytes()
    assert read.gaussians.textures.tobytes() == written.gaussians.textures.tobytes()
    assert read.structures.tobytes() == written.structures.tobytes()
    assert (read.grid, read.density_scale, read.march, read.extra) == (written.grid, 0.7, written.march,
                                                                        {"preset": "quick"})
    assert read.geometry_thickness == 0.5


def test_a_file_of_version_4_reads_its_structure_weights_with_the_whole_thickness(tmp_path):
    """Before version 5 the structure weights were trained reading each Gaussian's whole thickness: such a file
    is read that way; a version-5 file without the thickness, or with one outside (0, 1], is refused."""
    def as_version_4(metadata, tensors):
        metadata.update(format_version=4)
        del metadata["geometry_thickness"]
        del tensors["textures"]

    assert load_gaussians(rewritten(tmp_path, as_version_4)).geometry_thickness == 1.0
    with pytest.raises(ModelFileError, match="inconsistent metadata"):
        load_gaussians(rewritten(tmp_path, lambda m, t: m.pop("geometry_thickness")))
    with pytest.raises(ModelFileError, match="geometry thickness 2.0"):
        load_gaussians(rewritten(tmp_path, lambda m, t: m.update(geometry_thickness=2.0)))


def test_a_file_of_version_5_is_read_without_texture(tmp_path):
    """Before version 6 no channel textured a Gaussian's colour: such a file is read with texture records of zeros,
    which render it as it was trained; a version-6 file without its records is refused."""
    def as_version_5(metadata, tensors):
        metadata.update(format_version=5)
        del tensors["textures"]

    read = load_gaussians(rewritten(tmp_path, as_version_5))
    assert read.gaussians.textures.shape == (5, 8) and not read.gaussians.textures.any()
    np.testing.assert_array_equal(read.gaussians.colours, model().gaussians.colours)
    with pytest.raises(ModelFileError, match="tensors .* differ"):
        load_gaussians(rewritten(tmp_path, lambda m, t: t.pop("textures")))


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


@pytest.mark.parametrize("version", [1, 2])
def test_files_of_earlier_versions_are_refused_with_what_to_do(tmp_path, version):
    """Before version 3 a Gaussian's density did not follow its orientation: such a file would render otherwise
    than it was trained, so it is refused in one line naming it and saying to fit again."""
    def as_old(metadata, tensors):
        metadata.update(format_version=version)
        if version == 1:
            del tensors["structures"]

    path = rewritten(tmp_path, as_old)
    with pytest.raises(ModelFileError, match=f"format version {version}.*fit the study again") as error:
        load_gaussians(path)
    assert str(path) in str(error.value) and len(str(error.value).splitlines()) == 1


def test_a_file_of_version_3_is_read_with_colours_that_render_as_before(tmp_path):
    """Version 3 had four colour coefficients a channel (the spherical harmonics); read now, its facing and side
    coefficients are zero, which leaves every colour as it was. A version-3 file with version 4's colours is
    refused."""
    written = model()

    def as_version_3(metadata, tensors):
        metadata.update(format_version=3)
        tensors["colours"] = np.ascontiguousarray(tensors["colours"][:, :4])
        del tensors["textures"]

    read = load_gaussians(rewritten(tmp_path, as_version_3))
    np.testing.assert_array_equal(read.gaussians.colours[:, :4], written.gaussians.colours[:, :4])
    assert read.gaussians.colours.shape == (5, 6, 3) and not read.gaussians.colours[:, 4:].any()
    np.testing.assert_array_equal(read.gaussians.positions, written.gaussians.positions)
    with pytest.raises(ModelFileError, match="tensor 'colours'"):
        load_gaussians(rewritten(tmp_path, lambda m, t: (m.update(format_version=3), t.pop("textures"))))


def test_structure_weights_of_the_wrong_shape_are_refused(tmp_path):
    path = rewritten(tmp_path, lambda m, t: t.update(structures=np.zeros((5, 2), np.float32)))
    with pytest.raises(ModelFileError, match="tensor 'structures'") as error:
        load_gaussians(path)
    assert path in str(error.value)
    without = model()
    without.structures = None
    with pytest.raises(ValueError, match="structure weights"):
        save_gaussians(tmp_path / "g.safetensors", without)
    assert not (tmp_path / "g.safetensors").exists()
