"""A study is read from its files once; later runs read the cache until a file changes."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from conftest import save_nifti

from NeuralRaycastLib.array_cache import finish_writes, read_entry, write_entry, write_entry_behind
from NeuralRaycastLib.paths import CACHE_ENV, cache_folder, clear_cache
from NeuralRaycastLib.study import cache as study_cache
from NeuralRaycastLib.study.cache import load_study_cached
from NeuralRaycastLib.study.study import StudyError, load_study


def assert_same_study(a, b):
    assert (a.name, list(a.channels), a.structures, a.sources, a.colors) == \
        (b.name, list(b.channels), b.structures, b.sources, b.colors)
    np.testing.assert_array_equal(a.affine, b.affine)
    for name in a.channels:
        assert a.channels[name].dtype == b.channels[name].dtype
        np.testing.assert_array_equal(a.channels[name], b.channels[name])
    for name in ("labels", "probability", "brain_mask"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype, name
            np.testing.assert_array_equal(x, y)


def refuse_to_read(*args, **kwargs):
    raise AssertionError("the study's files were read again")


def test_a_second_load_reads_the_cache_and_gives_the_same_study(tiny_brats, tmp_path, monkeypatch):
    first = load_study_cached(tiny_brats, cache_root=tmp_path / "cache")
    assert_same_study(first, load_study(tiny_brats))
    with monkeypatch.context() as patched:
        patched.setattr(study_cache, "load_study", refuse_to_read)
        second = load_study_cached(tiny_brats, cache_root=tmp_path / "cache")
    assert_same_study(second, first)


def test_a_manifest_study_with_a_brain_mask_round_trips(phantom_study_dir, tmp_path, monkeypatch):
    manifest = phantom_study_dir / "manifest.json"
    first = load_study_cached(manifest, cache_root=tmp_path)
    with monkeypatch.context() as patched:
        patched.setattr(study_cache, "load_study", refuse_to_read)
        assert_same_study(load_study_cached(manifest, cache_root=tmp_path), first)


def test_a_changed_file_is_read_again(tiny_brats, tmp_path):
    load_study_cached(tiny_brats, cache_root=tmp_path / "cache")
    (t1,) = tiny_brats.glob("*_t1.nii.gz")
    original = load_study(tiny_brats).channels["t1"]
    save_nifti(t1, (original + 7.0).astype(np.float32), load_study(tiny_brats).affine)
    stat = t1.stat()
    os.utime(t1, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # even within the clock's resolution
    changed = load_study_cached(tiny_brats, cache_root=tmp_path / "cache")
    np.testing.assert_allclose(changed.channels["t1"], original + 7.0)


def test_a_new_file_in_the_folder_is_read(tiny_brats, tmp_path):
    before = load_study_cached(tiny_brats, cache_root=tmp_path / "cache")
    assert before.brain_mask is None
    mask = np.zeros(before.shape, np.uint8)
    mask[2:-2, 2:-2, 2:-2] = 1
    save_nifti(tiny_brats / "case_brainmask.nii.gz", mask, before.affine)
    assert load_study_cached(tiny_brats, cache_root=tmp_path / "cache").brain_mask is not None


def test_a_damaged_entry_is_never_trusted(tiny_brats, tmp_path):
    first = load_study_cached(tiny_brats, cache_root=tmp_path / "cache")
    (entry,) = (tmp_path / "cache").iterdir()
    channel = entry / "channel0.npy"
    channel.write_bytes(channel.read_bytes()[:200])  # truncated
    assert_same_study(load_study_cached(tiny_brats, cache_root=tmp_path / "cache"), first)
    (entry / "meta.json").write_text("{not json")
    assert_same_study(load_study_cached(tiny_brats, cache_root=tmp_path / "cache"), first)


def test_a_missing_study_fails_as_without_the_cache(tmp_path):
    with pytest.raises(StudyError, match="no such file"):
        load_study_cached(tmp_path / "nowhere", cache_root=tmp_path / "cache")


def test_entries_are_replaced_atomically_and_only_the_newest_kept(tmp_path):
    for index in range(5):
        write_entry(tmp_path / f"entry{index}", {"a": np.full(3, index)}, {"index": index}, keep=3)
        os.utime(tmp_path / f"entry{index}", (index, index))  # an older use for every earlier entry
    (tmp_path / "legacy.npz").write_bytes(b"an entry of an older format")
    os.utime(tmp_path / "legacy.npz", (0, 0))
    write_entry(tmp_path / "entry4", {"a": np.arange(4)}, keep=3)  # replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry2", "entry3", "entry4"]
    arrays, meta = read_entry(tmp_path / "entry4")
    np.testing.assert_array_equal(arrays["a"], np.arange(4))
    assert meta == {"arrays": ["a"]}
    assert read_entry(tmp_path / "entry0") is None


def test_an_entry_written_behind_is_read_whole_and_none_lands_after_a_clear(tmp_path, monkeypatch):
    """write_entry_behind returns before its entry is written (a fresh study's maps do not wait for the disk); a
    read of the entry in this process waits for it, and clearing the cache waits for what is being written, so
    that nothing lands in a cleared folder."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    for clear in (False, True):
        entry = cache_folder("prepared") / f"entry-{clear}"
        release = threading.Event()

        def arrays(release: threading.Event = release) -> dict[str, np.ndarray]:
            assert release.wait(60), "the entry was never let go"
            return {"a": np.arange(3)}

        write_entry_behind(entry, arrays, {"index": 1})
        assert not entry.exists()  # the caller went on while the entry waits
        threading.Timer(0.2, release.set).start()
        if clear:
            clear_cache(["prepared"])
            finish_writes()
            assert not cache_folder("prepared").exists()
        else:
            arrays_read, meta = read_entry(entry)
            np.testing.assert_array_equal(arrays_read["a"], np.arange(3))
            assert meta == {"index": 1, "arrays": ["a"]}
