"""The write side under faults: disk full, read-only and unwritable folders, writers that report success and
leave empty or cut-off files, interrupted writes. For each writer (model file, run folder, export, meshes,
reference views, report, metrics.json): the error names the path in one line, an earlier file or folder is
left as it was, nothing partial is left behind, and a trained run whose folder cannot be written is kept
where the error says.

Faults are injected where files.py writes (its ``os``), so they reach every writer without root's way round
permissions or a small file system to fill; VTK's writers, which write on their own, are made to leave
empty or cut-off files as they do on a full disk. Nothing here trains or renders: fields, views and meshes
are small synthetic ones.
"""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import analytic_prepared
from field_reference import tiny_config

from NeuralRaycastLib import files
from NeuralRaycastLib.field.field import FieldLayout
from NeuralRaycastLib.field.model_io import StudyGeometry, load_model, save_model
from NeuralRaycastLib.files import WriteError
from NeuralRaycastLib.mesh import mesh as mesh_module
from NeuralRaycastLib.mesh.mesh import EXPORT_FORMATS, grid_points, mesh_structure, write_meshes
from NeuralRaycastLib.paths import CACHE_ENV, cache_folder
from NeuralRaycastLib.render.camera import orbit_cameras, split_views
from NeuralRaycastLib.render.image import RenderedImage
from NeuralRaycastLib.render.reference_views import ReferenceViews, save_reference_views
from NeuralRaycastLib.study.sample.phantom import sphere_sdf
from NeuralRaycastLib.train.presets import RunSettings
from NeuralRaycastLib.train.run_folder import RunNotSavedError, export_run, read_run, run_metrics, write_run
from NeuralRaycastLib.train.trainer import TrainingError, TrainLog

SPHERES = {"brain": 20.0, "whole_tumor": 8.0}


class FaultyOs:
    """``os`` as files.py sees it, with one fault injected where ``where(path)`` holds (default: anywhere).

    ``fault``: "write" (the disk fills after ``room`` more bytes), "fsync" (the disk reports it only when
    flushing), "open" (creating a file fails: a read-only or unwritable folder), "rename" (moving into place
    fails), "mkdir". ``error``: an errno, or an exception class raised instead (an interruption); ``times``:
    how many times it fails (default: every time)."""

    def __init__(self, fault: str, error: int | type[BaseException] = errno.ENOSPC,
                 where: Callable[[str], bool] | None = None, room: int = 0, times: int | None = None):
        self.fault, self.error, self.where, self.room = fault, error, where or (lambda path: True), room
        self.times = times
        self.paths: dict[int, str] = {}
        self.raised = 0

    def __getattr__(self, name: str):
        return getattr(os, name)

    def _fail(self, path: str):
        self.raised += 1
        if isinstance(self.error, int):
            raise OSError(self.error, os.strerror(self.error), path)
        raise self.error()

    def _hit(self, fault: str, path) -> bool:
        return self.fault == fault and self.where(str(path)) and (self.times is None or self.raised < self.times)

    def open(self, path, flags, mode=0o777, **kwargs):
        if flags & os.O_CREAT and self._hit("open", path):
            self._fail(str(path))
        descriptor = os.open(path, flags, mode, **kwargs)
        self.paths[descriptor] = str(path)
        return descriptor

    def write(self, descriptor, data):
        path = self.paths.get(descriptor, "")
        if self._hit("write", path) and len(data) > self.room:
            if self.room > 0:  # what still fits reaches the disk, as on a disk that fills
                os.write(descriptor, bytes(data[: self.room]))
                self.room = 0
            self._fail(path)
        written = os.write(descriptor, data)
        if self._hit("write", path):
            self.room -= written
        return written

    def fsync(self, descriptor):
        if self._hit("fsync", self.paths.get(descriptor, "")):
            self._fail(self.paths[descriptor])
        return os.fsync(descriptor)

    def replace(self, source, target):
        if self._hit("rename", target):
            self._fail(str(target))
        return os.replace(source, target)

    def rename(self, source, target):
        if self._hit("rename", target):
            self._fail(str(target))
        return os.rename(source, target)

    def mkdir(self, path, mode=0o777):
        if self._hit("mkdir", path):
            self._fail(str(path))
        return os.mkdir(path, mode)


@pytest.fixture
def inject(monkeypatch) -> Callable[..., FaultyOs]:
    def inject(*args, **kwargs) -> FaultyOs:
        faulty = FaultyOs(*args, **kwargs)
        monkeypatch.setattr(files, "os", faulty)
        return faulty

    return inject


def intended(name: str) -> str:
    """A temporary file's or staging folder's name as the name it is written for."""
    match = re.fullmatch(r"\.?(.*?)\.(?:partial|replaced)-[0-9a-f]{12}(.*)", name)
    return match.group(1) + match.group(2) if match else name


def named(name: str) -> Callable[[str], bool]:
    """Paths written for a file or folder ``name`` (or a file of that stem), or for one inside it."""
    def where(path: str) -> bool:
        return any(part == name or Path(part).stem == name for part in map(intended, Path(path).parts))

    return where


def under(folder: Path, name: str | None = None) -> Callable[[str], bool]:
    """Paths in ``folder`` (or written for it: its staging folder), at any depth; with ``name``, only those
    :func:`named` so."""
    return lambda path: path.startswith(str(folder)) and (name is None or named(name)(path))


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every file and folder under ``folder`` with its bytes (None for folders)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def leftovers(folder: Path) -> list[Path]:
    """What a failed write must never leave: temporary files and folders, empty files."""
    return [p for p in folder.rglob("*") if files.PARTIAL in p.name or files.REPLACED in p.name
            or (p.is_file() and p.stat().st_size == 0)]


def assert_one_line_naming(error: BaseException, path: Path, *words: str) -> None:
    message = str(error)
    assert "\n" not in message and str(path) in message, message
    for word in words:
        assert word in message, message


# -- small synthetic results ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared():
    sdfs = {name: (lambda p, r=r: np.linalg.norm(p, axis=-1) - r) for name, r in SPHERES.items()}
    return analytic_prepared(sdfs, 8.0, (-24, -24, -24), (24, 24, 24))


class FakeField:
    """What writing a run needs of a trained field: its layout and parameters."""

    def __init__(self, prepared, seed: int = 0):
        self.layout = FieldLayout.build(tiny_config(), prepared.bounds, len(prepared.structures),
                                        len(prepared.channel_names))
        self._parameters = np.random.default_rng(seed).normal(0.0, 0.3, self.layout.count).astype(np.float32)

    def parameters(self) -> np.ndarray:
        return self._parameters.copy()


GPU = SimpleNamespace(backend="vulkan", report=SimpleNamespace(
    software=True, adapter="a test device", as_dict=lambda: {"adapter": "a test device"}))


def synthetic_views(prepared, count: int = 3, seed: int = 0) -> ReferenceViews:
    rng = np.random.default_rng(seed)
    cameras = orbit_cameras(prepared.bounds, count, 20, 16)  # the smallest views a user may ask for
    images = [RenderedImage(rng.random((16, 20, 4), np.float32), rng.random((16, 20), np.float32) * 100,
                            rng.random((16, 20, 3), np.float32)) for _ in range(count)]
    return ReferenceViews(cameras, images, *split_views(count, 2))


def written_run(folder: Path, prepared, seed: int = 0) -> FakeField:
    field = FakeField(prepared, seed)
    write_run(folder, GPU, prepared, field, TrainLog(rows=[{"step": 1, "sdf": 0.5}], seconds=2.0),
              RunSettings("quick"), "/studies/a")
    return field


def sphere_meshes():
    """Two small meshes, "brain" the last."""
    affine = np.diag([2.0, 2.0, 2.0, 1.0])
    affine[:3, 3] = -16.0
    points = grid_points(affine, (17, 17, 17))
    return [mesh_structure(sphere_sdf(points, np.zeros(3), radius).astype(np.float32), affine, name, (0.9, 0.8, 0.7))
            for name, radius in (("whole_tumor", 6.0), ("brain", 11.0))]


# -- model files -----------------------------------------------------------------------------------------------

FAULTS = [
    pytest.param("write", errno.ENOSPC, ("no space left on device", "free space"), id="disk-full-mid-file"),
    pytest.param("fsync", errno.EIO, ("input/output error", "disk may be full"), id="disk-full-on-flush"),
    pytest.param("open", errno.EROFS, ("read-only file system", "write somewhere else"), id="read-only"),
    pytest.param("open", errno.EACCES, ("permission denied", "permissions"), id="not-writable"),
    pytest.param("rename", errno.EDQUOT, ("quota",), id="rename-fails"),
]


@pytest.mark.parametrize(("fault", "code", "words"), FAULTS)
def test_a_model_file_is_written_whole_or_not_at_all(fault, code, words, tmp_path, prepared, inject):
    field = FakeField(prepared)
    geometry = StudyGeometry.from_prepared(prepared)
    path = save_model(tmp_path / "model.safetensors", field.layout, field.parameters(), geometry)
    before = path.read_bytes()
    injected = inject(fault, code, room=1000)
    with pytest.raises(WriteError) as raised:
        save_model(path, field.layout, field.parameters() + 1, geometry)
    assert injected.raised and isinstance(raised.value, OSError) and raised.value.errno == code
    assert_one_line_naming(raised.value, path, *words)
    assert path.read_bytes() == before and leftovers(tmp_path) == []
    with pytest.raises(WriteError):
        save_model(tmp_path / "new" / "model.safetensors", field.layout, field.parameters(), geometry)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # not even the folder made for it


def test_an_interrupted_write_leaves_nothing_and_stays_an_interruption(tmp_path, prepared, inject):
    field = FakeField(prepared)
    path = save_model(tmp_path / "model.safetensors", field.layout, field.parameters(),
                      StudyGeometry.from_prepared(prepared))
    before = path.read_bytes()
    inject("write", KeyboardInterrupt, room=5000)
    with pytest.raises(KeyboardInterrupt):
        save_model(path, field.layout, field.parameters() + 1, StudyGeometry.from_prepared(prepared))
    assert path.read_bytes() == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_files_get_the_usual_permissions_not_owner_only(umask, tmp_path, prepared):
    """Model files were written 0600 while the rest of a run was 0644."""
    previous = os.umask(umask)
    try:
        written_run(tmp_path / "run", prepared)
        save_reference_views(synthetic_views(prepared), tmp_path / "views")
        write_meshes(sphere_meshes(), tmp_path / "meshes", ["vtp", "stl"])
    finally:
        os.umask(previous)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) > 10
    assert {oct(p.stat().st_mode & 0o777) for p in written} == {oct(0o666 & ~umask)}


# -- run folders -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fault", "name"), [("write", "train_log"), ("rename", "run.json"), ("open", "model")])
def test_a_run_folders_files_are_put_in_place_together(fault, name, tmp_path, prepared, inject):
    """The model, train_log.json and run.json of write_run: all three new, or all three as they were (a
    failure at the last rename puts back the two already moved in)."""
    folder = tmp_path / "run"
    written_run(folder, prepared, seed=1)
    before = snapshot(folder)
    inject(fault, errno.ENOSPC, where=named(name))
    with pytest.raises(WriteError) as raised:
        written_run(folder, prepared, seed=2)
    assert_one_line_naming(raised.value, folder, name, "no space left on device")
    assert snapshot(folder) == before and leftovers(tmp_path) == []


class FakeTrainer:
    """Training that takes no time: train_study's writing is what is under test."""

    failure: BaseException | None = None

    def __init__(self, gpu, prepared, field, views, config):
        self.renderer = "renderer"

    def run(self, progress, should_stop) -> TrainLog:
        if FakeTrainer.failure is not None:
            raise FakeTrainer.failure
        return TrainLog(rows=[{"step": 1, "loss": 0.25, "heldout_psnr": 20.0}], seconds=3.0)

    def use_picture_settings(self) -> None:
        pass


@pytest.fixture
def fake_training(monkeypatch, prepared, tmp_path):
    """train_study with everything but its writing replaced: (train, the field it trains, the steps run)."""
    from NeuralRaycastLib.train import field_ahead, run

    field = FakeField(prepared, seed=7)
    steps: list[str] = []
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(run, "prepare_for_run",
                        lambda study, settings, progress, gpu=None, with_outline=None, before_maps=None:
                        steps.append("prepare") or prepared)
    monkeypatch.setattr(run, "study_within_budget", lambda study, settings, budget, progress: (study, settings))
    monkeypatch.setattr(run, "downsampled_for_run", lambda study, settings, progress: study)
    monkeypatch.setattr(run, "reference_views_for_run", lambda *args: synthetic_views(prepared, 4))
    monkeypatch.setattr(field_ahead, "NeuralField", lambda gpu, layout, seed: field)
    monkeypatch.setattr(run, "Trainer", FakeTrainer)
    monkeypatch.setattr(FakeTrainer, "failure", None)

    def train(out: Path):
        # overwrite: these runs replace runs of another study, which the output check asks to be said
        return run.train_study(GPU, tmp_path / "study", out, RunSettings("quick"), warm_up=False, overwrite=True)

    return train, field, steps


@pytest.fixture
def earlier_run(tmp_path, prepared) -> Path:
    """A run folder from an earlier training, with its scores and views."""
    folder = tmp_path / "runs" / "run"
    written_run(folder, prepared, seed=3)
    save_reference_views(synthetic_views(prepared, 6, seed=3), folder / "reference")
    (folder / "metrics.json").write_text('{"heldout_psnr": 30}\n')
    return folder


def test_a_run_replaces_an_earlier_run_whole_and_only_once_complete(fake_training, earlier_run, prepared):
    """An earlier run's scores and extra views are not kept beside the new run's (a mix of two runs)."""
    train, field, _ = fake_training
    trained = train(earlier_run)
    assert trained.folder == earlier_run
    assert sorted(p.name for p in earlier_run.iterdir()) == ["model.safetensors", "reference", "run.json",
                                                            "train_log.json"]
    assert len(list((earlier_run / "reference" / "views").iterdir())) == 4  # not the earlier 6
    np.testing.assert_array_equal(load_model(earlier_run / "model.safetensors").parameters, field.parameters())
    assert read_run(earlier_run)["study"].endswith("study")
    assert leftovers(earlier_run.parent.parent) == []
    assert sorted(p.name for p in earlier_run.parent.iterdir()) == ["run"]


SAVE_FAULTS = [
    pytest.param("write", lambda run: under(run.parent, "model"), errno.ENOSPC, "no space left on device",
                 id="model-on-a-full-disk"),
    pytest.param("write", lambda run: under(run.parent, "reference"), errno.ENOSPC, "no space left on device",
                 id="views-written-while-training"),
    pytest.param("fsync", lambda run: under(run.parent), errno.EIO, "input/output error",
                 id="full-disk-found-on-flush"),
    pytest.param("rename", lambda run: lambda path: path == str(run), errno.EROFS, "read-only file system",
                 id="moving-the-run-into-place-fails"),
]


@pytest.mark.parametrize(("fault", "where", "code", "reason"), SAVE_FAULTS)
def test_a_trained_run_whose_folder_cannot_be_written_is_kept_and_the_error_says_where(
        fault, where, code, reason, fake_training, earlier_run, inject):
    """fit on a disk that filled up trained to the end, then lost the model and left a half-written folder."""
    train, field, _ = fake_training
    before = snapshot(earlier_run)
    inject(fault, code, where=where(earlier_run), room=2000, times=1 if fault == "rename" else None)
    with pytest.raises(RunNotSavedError) as raised:
        train(earlier_run)
    error = raised.value
    assert isinstance(error, OSError) and error.errno == code
    assert error.kept is not None and error.kept.parent == cache_folder("recovered")
    assert_one_line_naming(error, earlier_run, reason, f"the trained model is kept in {error.kept}")
    np.testing.assert_array_equal(load_model(error.kept / "model.safetensors").parameters, field.parameters())
    assert read_run(error.kept)["settings"].preset == "quick"  # a run folder: evaluate, render and mesh take it
    assert snapshot(earlier_run) == before  # the earlier run as it was
    assert leftovers(earlier_run.parent.parent) == []
    assert sorted(p.name for p in earlier_run.parent.iterdir()) == ["run"]


def test_a_run_the_cache_cannot_take_either_goes_to_the_temporary_folder_or_the_error_says_it_is_lost(
        fake_training, tmp_path, inject):
    train, field, _ = fake_training
    out = tmp_path / "runs" / "new"
    cache = tmp_path / "cache"
    inject("write", errno.ENOSPC, where=lambda path: path.startswith((str(out.parent), str(cache))))
    with pytest.raises(RunNotSavedError) as raised:
        train(out)
    kept = raised.value.kept
    assert kept is not None and kept.parent == tmp_path / "tmp" / "neuralraycast-recovered"
    np.testing.assert_array_equal(load_model(kept / "model.safetensors").parameters, field.parameters())
    assert not out.exists() and not (cache / "recovered").exists()

    inject("write", errno.ENOSPC)  # every disk full
    with pytest.raises(RunNotSavedError) as raised:
        train(out)
    assert raised.value.kept is None
    assert_one_line_naming(raised.value, out, "could not be kept anywhere", "no space left on device")
    assert leftovers(tmp_path) == [] and sorted(p.name for p in kept.parent.iterdir()) == [kept.name]


@pytest.mark.parametrize("failure", [TrainingError("the loss is not finite"), KeyboardInterrupt()],
                         ids=["training-fails", "interrupted"])
def test_a_training_that_fails_leaves_the_earlier_run_as_it_was(failure, fake_training, earlier_run, monkeypatch):
    train, _, _ = fake_training
    before = snapshot(earlier_run)
    monkeypatch.setattr(FakeTrainer, "failure", failure)
    with pytest.raises(type(failure)):
        train(earlier_run)
    assert snapshot(earlier_run) == before and leftovers(earlier_run.parent) == []
    assert not cache_folder("recovered").exists()  # nothing trained, nothing to keep


def test_a_folder_that_is_not_a_run_is_refused_before_any_work(fake_training, tmp_path):
    """The study's own folder, a home folder: never replaced by a run, and said so before training."""
    train, _, steps = fake_training
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    with pytest.raises(FileExistsError, match="holds other files"):
        train(folder)
    with pytest.raises((FileExistsError, ValueError), match="not a folder"):
        train(folder / "notes.txt")
    assert steps == [] and snapshot(folder) == {"notes.txt": b"mine\n"} and leftovers(tmp_path) == []


def test_a_run_folder_that_cannot_be_made_is_reported_before_any_work(fake_training, tmp_path, inject):
    train, _, steps = fake_training
    inject("mkdir", errno.EACCES)
    with pytest.raises(WriteError) as raised:
        train(tmp_path / "runs" / "new")
    assert_one_line_naming(raised.value, tmp_path / "runs" / "new", "permission denied")
    assert steps == [] and not (tmp_path / "runs").exists()


# -- export ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exists", [False, True], ids=["new-folder", "empty-folder"])
def test_an_export_on_a_full_disk_leaves_no_partial_folder(exists, tmp_path, prepared, inject):
    source = tmp_path / "run"
    written_run(source, prepared)
    save_reference_views(synthetic_views(prepared), source / "reference")
    before = snapshot(source)
    out = tmp_path / "half"
    if exists:
        out.mkdir()
    inject("write", errno.ENOSPC, where=under(out), room=3000)
    with pytest.raises(WriteError) as raised:
        export_run(source, out)
    assert_one_line_naming(raised.value, out, "no space left on device", "free space")
    assert str(tmp_path / "half.partial") not in str(raised.value)  # named for where it was meant to go
    assert snapshot(source) == before and leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == (["half", "run"] if exists else ["run"])
    assert not exists or not any(out.iterdir())


def test_an_export_is_complete_and_readable(tmp_path, prepared):
    source = tmp_path / "run"
    field = written_run(source, prepared)
    save_reference_views(synthetic_views(prepared), source / "reference")
    out = export_run(source, tmp_path / "half")
    assert {p.relative_to(out) for p in out.rglob("*")} == {p.relative_to(source) for p in source.rglob("*")}
    model = load_model(out / "model.safetensors")
    assert model.precision == "float16"
    np.testing.assert_allclose(model.parameters, field.parameters(), atol=1e-3)
    assert leftovers(tmp_path) == []


# -- meshes ----------------------------------------------------------------------------------------------------


def damaging_writer(monkeypatch, damage: str, target: str) -> None:
    """VTK's writers as on a full disk: success reported, the file of mesh ``target`` left empty or cut off."""
    real = mesh_module._mesh_writer

    def writer(mesh, kind):
        inner = real(mesh, kind)
        if mesh.name != target:
            return inner

        class Damaged:
            def SetFileName(self, name):  # noqa: N802 (VTK's names)
                self.name = name
                inner.SetFileName(name)

            def Write(self):  # noqa: N802
                inner.Write()
                size = os.path.getsize(self.name)
                os.truncate(self.name, 0 if damage == "empty" else size // 2)
                return 1

            def GetErrorCode(self):  # noqa: N802
                return 0

        return Damaged()

    monkeypatch.setattr(mesh_module, "_mesh_writer", writer)


@pytest.mark.parametrize("damage", ["empty", "cut"])
@pytest.mark.parametrize("kind", EXPORT_FORMATS)
def test_meshes_a_writer_left_empty_or_cut_off_are_caught_and_none_are_written(kind, damage, tmp_path, monkeypatch):
    """mesh on a full disk exited 0 and left 0-byte and truncated files; now the set is written whole or not at
    all, and an earlier set stays as it was."""
    meshes = sphere_meshes()
    out = tmp_path / "meshes"
    write_meshes(meshes[:1], out, [kind])  # an earlier export
    before = snapshot(out)
    damaging_writer(monkeypatch, damage, "brain")  # the last mesh: the ones before it were written fine
    with pytest.raises(WriteError) as raised:
        write_meshes(meshes, out, [kind])
    words = ["left an empty file"] if damage == "empty" else ["written incompletely"]
    assert_one_line_naming(raised.value, out / f"brain.{kind}", *words)
    assert snapshot(out) == before and leftovers(tmp_path) == []
    with pytest.raises(WriteError):
        write_meshes(meshes, tmp_path / "new", [kind])
    assert not (tmp_path / "new").exists()


def test_meshes_on_a_disk_that_fills_when_flushed_are_not_written(tmp_path, inject):
    inject("fsync", errno.ENOSPC, where=named("brain"))
    with pytest.raises(WriteError) as raised:
        write_meshes(sphere_meshes(), tmp_path / "meshes", ["vtp", "ply"])
    assert_one_line_naming(raised.value, tmp_path / "meshes" / "brain.vtp", "no space left on device")
    assert list(tmp_path.iterdir()) == []


def test_mesh_on_a_full_disk_exits_2_with_one_line_and_leaves_no_files(tmp_path, monkeypatch, capsys):
    from NeuralRaycastLib.app.cli import main

    assert main(["sample", str(tmp_path / "s"), "--case", "fixture"]) == 0
    manifest = capsys.readouterr().out.strip()
    damaging_writer(monkeypatch, "cut", "enhancing_tumor")
    assert main(["mesh", manifest, "--out", str(tmp_path / "m"), "--formats", "stl", "vtp"]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("neuralraycast")]  # after progress
    assert errors == [captured.err.strip().splitlines()[-1]] and "Traceback" not in captured.err, captured.err
    assert errors[0].startswith("neuralraycast mesh: error: ") and "written incompletely" in errors[0]
    assert str(tmp_path / "m" / "enhancing_tumor.stl") in errors[0]
    assert "files in" not in captured.out and not (tmp_path / "m").exists()


# -- reference views -------------------------------------------------------------------------------------------


VIEW_FAULTS = [
    pytest.param("write", lambda folder: named("reference.npz"), id="arrays"),
    pytest.param("write", lambda folder: named("002"), id="pictures"),
    pytest.param("rename", lambda folder: lambda path: path == str(folder), id="moving-into-place"),
]


@pytest.mark.parametrize(("fault", "where"), VIEW_FAULTS)
def test_reference_views_are_replaced_whole_or_left_as_they_were(fault, where, tmp_path, prepared, inject,
                                                                  monkeypatch):
    folder = tmp_path / "views"
    save_reference_views(synthetic_views(prepared, 5, seed=1), folder)
    before = snapshot(folder)
    inject(fault, errno.ENOSPC, where=where(folder), room=100, times=1 if fault == "rename" else None)
    with pytest.raises(WriteError) as raised:
        save_reference_views(synthetic_views(prepared, 3, seed=2), folder)
    assert_one_line_naming(raised.value, folder, "no space left on device")
    assert files.PARTIAL not in str(raised.value)  # the file's own place, not the staging folder's
    assert snapshot(folder) == before and leftovers(tmp_path) == []
    monkeypatch.setattr(files, "os", os)  # the disk has room again
    save_reference_views(synthetic_views(prepared, 3, seed=2), folder)
    assert sorted(p.name for p in (folder / "views").iterdir()) == ["000.png", "001.png", "002.png"]  # none left
    assert len(json.loads((folder / "cameras.json").read_text())["cameras"]) == 3


def test_views_are_never_written_over_other_files_and_render_says_so_before_rendering(tmp_path, prepared, capsys):
    from NeuralRaycastLib.app.cli import main

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    with pytest.raises(FileExistsError, match="holds other files"):
        save_reference_views(synthetic_views(prepared), folder)
    # Refused before the study is read or a view rendered (the study named does not even exist).
    for command in (["render-reference", str(tmp_path / "no-study")], ["render", str(tmp_path / "no-run")]):
        assert main([*command, "--out", str(folder)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(folder) in err and "is not empty" in err, err
    assert snapshot(folder) == {"notes.txt": b"mine\n"} and leftovers(tmp_path) == []


# -- the demo's report and metrics.json ----------------------------------------------------------------------


def report_context() -> dict:
    metrics = {"dice": {"brain": 0.9}, "mean_surface_distance_mm": {"brain": 0.1}, "hd95_mm": {"brain": 0.3},
               "heldout_psnr": 30.0, "heldout_ssim": 0.9, "image_size": 8, "preset": "quick", "train_seconds": 1.0,
               "device": "a test device", "backend": "vulkan", "model_bytes": 1000}
    return {"study": "a test study", "metrics": metrics, "log_rows": [{"step": 1, "sdf": 0.1}],
            "timings": {"total": 1.0}, "meshes": [], "versions": {"SlicerNeuralRaycast": "0"},
            "pictures": {"held_out": [], "turntable": "turntable.gif", "depth": "d.png", "normal": "n.png"}}


def readable(path: Path) -> bool:
    """A whole picture, JSON file or page."""
    from PIL import Image

    if path.suffix in (".png", ".gif"):
        with Image.open(path) as picture:
            picture.load()
        return True
    if path.suffix == ".json":
        return isinstance(json.loads(path.read_text()), dict)
    return path.read_text().rstrip().endswith("</html>")


@pytest.mark.parametrize(("fault", "name"), [("write", "report.html"), ("fsync", "report_context"),
                                             ("open", "compare"), ("write", "turntable.gif")])
def test_the_report_and_its_pictures_keep_their_earlier_versions_when_a_write_fails(fault, name, tmp_path, inject):
    """Each file of the demo's output is its earlier version or a whole new one, never a part of one; the
    page itself is written last, once what it shows is there."""
    from NeuralRaycastLib.app.report import save_comparison, save_gif, write_report

    pictures = [np.random.default_rng(i).random((6, 8, 3)) for i in range(3)]

    def write_all() -> None:
        save_comparison(tmp_path, 3, pictures[0], pictures[1], 20.0)
        save_gif(pictures, tmp_path / "turntable.gif")
        write_report(tmp_path, report_context())

    write_all()
    before = snapshot(tmp_path)
    inject(fault, errno.ENOSPC, where=named(name), room=50)
    pictures.reverse()
    with pytest.raises(WriteError) as raised:
        write_all()
    assert_one_line_naming(raised.value, tmp_path, name, "no space left on device")
    after = snapshot(tmp_path)
    failed = [path for path in after if named(name)(path)]
    assert failed and all(after[path] == before[path] for path in failed)
    assert after["report.html"] == before["report.html"]  # not yet rewritten: written last
    assert set(after) == set(before) and leftovers(tmp_path) == []
    assert all(readable(tmp_path / path) for path, data in after.items() if data is not None)


def test_a_folder_that_cannot_be_put_back_is_kept_and_the_error_says_where(tmp_path, inject):
    """Moving the new folder in fails and so does moving the earlier one back: it is never removed."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "a.txt").write_text("earlier\n")
    inject("rename", errno.EIO, where=lambda path: path == str(folder))
    with pytest.raises(WriteError) as raised, files.atomic_folder(folder, lambda path: True) as staging:
        files.write_text(staging / "a.txt", "new\n")
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("out" + files.REPLACED)]
    assert len(kept) == 1 and (kept[0] / "a.txt").read_text() == "earlier\n"
    assert_one_line_naming(raised.value, folder, f"the earlier folder is now {kept[0]}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [kept[0].name]  # the staging folder removed


def test_metrics_json_keeps_its_earlier_version_when_a_write_fails(tmp_path, prepared, monkeypatch, inject):
    from NeuralRaycastLib.train import evaluate, trainer

    folder = tmp_path / "run"
    field = written_run(folder, prepared)
    monkeypatch.setattr(trainer, "score_views", lambda *args: {"heldout_psnr": 25.0, "heldout_ssim": 0.8})
    monkeypatch.setattr(evaluate, "geometry_metrics", lambda field, prepared: {
        "brain": {"dice": 0.9, "mean_surface_distance_mm": 0.2, "hd95_mm": 0.5}})

    def score() -> dict:
        return run_metrics(GPU, folder, prepared, field, synthetic_views(prepared), RunSettings("quick"), "renderer")

    metrics = score()
    assert json.loads((folder / "metrics.json").read_text()) == metrics
    before = snapshot(folder)
    inject("write", errno.ENOSPC, where=named("metrics.json"), room=10)
    with pytest.raises(WriteError) as raised:
        score()
    assert_one_line_naming(raised.value, folder / "metrics.json", "no space left on device")
    assert snapshot(folder) == before and leftovers(tmp_path) == []


# -- sample studies --------------------------------------------------------------------------------------------

def test_a_sample_is_written_whole_replaces_an_earlier_sample_and_never_other_files(tmp_path, monkeypatch):
    import nibabel

    from NeuralRaycastLib.study.sample import write_sample

    folder = tmp_path / "sample"
    manifest = write_sample(folder, "phantom", spacing=8.0)
    first = snapshot(folder)
    assert manifest == folder / "manifest.json" and len(first) >= 3
    saved = nibabel.save

    def fills_the_disk(image, path):  # half a file written, then the disk is full
        saved(image, path)
        with open(path, "r+b") as written:
            written.truncate(max(1, Path(path).stat().st_size // 2))
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(nibabel, "save", fills_the_disk)
    with pytest.raises(WriteError, match="no space left on device"):
        write_sample(folder, "phantom", spacing=8.0, seed=1)
    assert snapshot(folder) == first and leftovers(tmp_path) == []  # the earlier sample as it was
    monkeypatch.setattr(nibabel, "save", saved)
    write_sample(folder, "phantom", spacing=8.0, seed=1)  # an earlier sample is replaced whole
    assert snapshot(folder) != first and set(snapshot(folder)) == set(first)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    with pytest.raises(FileExistsError, match="holds other files"):
        write_sample(mine, "fixture")
    assert snapshot(mine) == {"notes.txt": b"mine\n"}
