"""The sample cases: labels present, channels on one grid, the lesion inside the brain."""

from __future__ import annotations

import numpy as np
import pytest

from NeuralRaycastLib.study.preprocess import head_mask
from NeuralRaycastLib.study.sample import write_sample
from NeuralRaycastLib.study.sample.icbm import WHEEL_ENV, SampleDataError, synthesise_case
from NeuralRaycastLib.study.sample.phantom import Phantom, voxel_centres
from NeuralRaycastLib.study.study import load_study


@pytest.fixture(scope="module")
def icbm_case():
    """The default sample case at 3 mm (the nilearn wheel is fetched once into the cache)."""
    return synthesise_case(spacing=3.0, seed=0)


def test_icbm_case_has_all_tumour_regions_inside_the_brain(icbm_case):
    channels, labels, affine = icbm_case
    assert list(channels) == ["t1", "t1ce", "t2", "flair"]
    assert {a.shape for a in channels.values()} == {labels.shape}
    np.testing.assert_allclose(np.linalg.norm(affine[:3, :3], axis=0), 3.0)
    assert set(np.unique(labels)) == {0, 1, 2, 3}
    brain = channels["t1"] > 0
    assert brain[labels > 0].mean() == 1.0  # skull-stripped: no lesion voxel outside the brain
    volume_ml = (labels > 0).sum() * 27 / 1000
    assert 5 < volume_ml < 150


def test_icbm_case_contrasts_look_like_a_tumour(icbm_case):
    channels, labels, _ = icbm_case
    normal = (labels == 0) & (channels["t1"] > 0)
    enhancing, oedema = labels == 3, labels == 2
    # the enhancing rim lights up after contrast; oedema is bright on FLAIR
    assert channels["t1ce"][enhancing].mean() > 1.5 * channels["t1"][enhancing].mean()
    assert channels["flair"][oedema].mean() > 1.3 * np.median(channels["flair"][normal])


def test_icbm_case_is_reproducible_and_seeded(icbm_case):
    channels, labels, _ = synthesise_case(spacing=3.0, seed=0)
    np.testing.assert_array_equal(labels, icbm_case[1])
    np.testing.assert_array_equal(channels["t2"], icbm_case[0]["t2"])
    _, other, _ = synthesise_case(spacing=3.0, seed=1)
    assert not np.array_equal(other, labels)


def test_sample_download_refuses_a_wrong_checksum(tmp_path, monkeypatch):
    fake = tmp_path / "nilearn.whl"
    fake.write_bytes(b"not the pinned wheel")
    monkeypatch.setenv(WHEEL_ENV, str(fake))
    with pytest.raises(SampleDataError, match="checksum mismatch"):
        synthesise_case(spacing=3.0)


def test_fixture_case_is_a_loadable_study(tmp_path):
    study = load_study(write_sample(tmp_path, "fixture"))
    assert study.shape == (33, 41, 25) and study.channel_names == ["t1"]
    np.testing.assert_allclose(study.spacing, 2.0)
    assert set(np.unique(study.labels)) == {0, 1, 2, 3}
    assert head_mask(study.channels)[study.labels > 0].all()


def test_runs_starting_together_each_get_a_whole_sample(tmp_path, monkeypatch):
    """Several processes (here threads) asking for a sample that is not cached yet: every one gets a
    complete, loadable study and no half-written folder is left behind."""
    from concurrent.futures import ThreadPoolExecutor

    from NeuralRaycastLib.paths import CACHE_ENV
    from NeuralRaycastLib.study.sample import cached_sample

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    with ThreadPoolExecutor(4) as pool:
        manifests = list(pool.map(lambda _: cached_sample("fixture"), range(4)))
    assert len(set(manifests)) == 1
    study = load_study(manifests[0])
    assert study.shape == (33, 41, 25)
    assert [p.name for p in (tmp_path / "samples").iterdir()] == [manifests[0].parent.name]


def test_phantom_labels_agree_with_its_exact_surfaces(phantom_study_dir):
    study = load_study(phantom_study_dir)
    phantom = Phantom()
    points = voxel_centres(study.affine, study.shape)
    for name, values in study.structures.items():
        inside = np.isin(study.labels, values)
        np.testing.assert_array_equal(inside, phantom.sdf(name, points) < 0)
    # the tumour lies well inside the brain
    assert phantom.sdf("brain", points[study.labels > 0]).max() < -5.0
    assert {a.shape for a in study.channels.values()} == {study.shape}
