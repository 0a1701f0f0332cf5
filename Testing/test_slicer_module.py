"""The Slicer module headless: its .ui against its code, its own self-tests, the parameter node through a
saved scene, and bad input that must leave the scene as it was (see slicer_harness.py)."""

from __future__ import annotations

import os
import pathlib
import re
import xml.etree.ElementTree as ET
from dataclasses import replace

import numpy as np
import pytest
import slicer_harness

UI_FILE = slicer_harness.ROOT / "NeuralRaycast" / "Resources" / "UI" / "NeuralRaycast.ui"


@pytest.fixture(scope="module")
def module():
    return slicer_harness.load_module()


@pytest.fixture
def scene(module):
    import slicer

    slicer.mrmlScene.Clear(0)
    return slicer.mrmlScene


@pytest.fixture
def self_test(module, scene):
    return module.NeuralRaycastTest()


def node_ids(scene) -> set[str]:
    return {scene.GetNthNode(index).GetID() for index in range(scene.GetNumberOfNodes())}


# --- the .ui file and the code that uses it ---------------------------------------------------------------


def test_every_bound_widget_names_a_parameter_and_every_parameter_has_a_widget(module):
    bound = {element.find("string").text for element in ET.parse(UI_FILE).iter("property")
             if element.get("name") == "SlicerParameterName"}
    parameters = set(module.NeuralRaycastParameterNode.allParameters)
    assert bound == parameters


def test_every_widget_the_code_touches_exists_in_the_ui(module):
    widgets = {element.get("name") for element in ET.parse(UI_FILE).iter("widget")}
    used = set(re.findall(r"self\.ui\.(\w+)", slicer_harness.MODULE_FILE.read_text()))
    assert used, "the widget reads no widgets?"
    assert used <= widgets, f"missing in the .ui: {sorted(used - widgets)}"


# --- the module's own self-tests (what Slicer's "Reload and Test" runs) --------------------------------------


def test_study_from_nodes(self_test):
    self_test.test_StudyFromNodes()


def test_overlapping_segments_and_transforms(self_test):
    self_test.test_OverlappingSegmentsAndTransforms()


@pytest.mark.gpu
def test_train_render_and_models_end_to_end(self_test):
    self_test.test_TrainRenderModels()


# --- parameter node and scene files -----------------------------------------------------------------------------


def test_a_saved_and_reloaded_scene_keeps_the_parameters(module, scene, self_test, tmp_path):
    volume, _array, _affine = self_test._syntheticVolume("T1 scan")
    segmentation = self_test._newSegmentation(volume)
    parameters = module.NeuralRaycastLogic().getParameterNode()
    assert (parameters.preset, parameters.device, parameters.meshSmoothing) == ("auto", "auto", 10)
    assert parameters.shadows is False
    parameters.inputVolume = volume
    parameters.inputSegmentation = segmentation
    parameters.preset = "quick"
    parameters.seed = 7
    parameters.iterations = 123
    parameters.shadows = True
    parameters.meshSmoothing = 3
    parameters.gpuMemory = "6G"
    assert parameters.representation == "field"
    parameters.representation = "gaussians"
    parameters.runFolder = tmp_path / "run"
    with pytest.raises(ValueError):
        parameters.preset = "fastest"  # not a choice
    with pytest.raises(ValueError):
        parameters.representation = "splats"  # not a choice
    with pytest.raises(ValueError):
        parameters.meshSmoothing = 1000  # out of range

    scene.SetURL(str(tmp_path / "scene.mrml"))
    assert scene.Commit()
    assert "\"shadows True\"" in (tmp_path / "scene.mrml").read_text()  # as Slicer writes a boolean
    scene.Clear(0)  # as closing the scene in Slicer: the singleton parameter node stays, reset
    assert scene.GetNumberOfNodesByClass("vtkMRMLScriptedModuleNode") == 1
    assert not parameters.parameterNode.GetParameter("preset")
    scene.SetURL(str(tmp_path / "scene.mrml"))
    assert scene.Import()
    assert scene.GetNumberOfNodesByClass("vtkMRMLScriptedModuleNode") == 1  # merged into the singleton

    reloaded = module.NeuralRaycastLogic().getParameterNode()
    assert reloaded.parameterNode is parameters.parameterNode or \
        reloaded.parameterNode.GetID() == parameters.parameterNode.GetID()
    assert reloaded.inputVolume.GetName() == "T1 scan"
    assert reloaded.inputSegmentation.GetName() == segmentation.GetName()
    assert (reloaded.preset, reloaded.seed, reloaded.iterations, reloaded.meshSmoothing) == ("quick", 7, 123, 3)
    assert reloaded.shadows is True and reloaded.gpuMemory == "6G" and reloaded.representation == "gaussians"
    assert reloaded.runFolder == tmp_path / "run"
    assert reloaded.volumeNodes() == [reloaded.inputVolume]


# --- bad input: a clear error, and the scene gains nothing -----------------------------------------------------


def test_missing_inputs_are_refused(module, scene):
    logic = module.NeuralRaycastLogic()
    before = node_ids(scene)
    with pytest.raises(ValueError, match="No input volume"):
        logic.train([], None)
    with pytest.raises(RuntimeError, match="No trained model"):
        logic.createModels()
    with pytest.raises(RuntimeError, match="No trained model"):
        logic.renderCamera(None)
    with pytest.raises(ValueError, match="does not exist"):
        logic.loadRun("/nonexistent/run", [], None)
    assert node_ids(scene) == before


def test_empty_segmentations_are_refused(module, scene, self_test):
    volume, array, _affine = self_test._syntheticVolume("t1")
    segmentation = self_test._newSegmentation(volume)
    logic = module.NeuralRaycastLogic()
    before = node_ids(scene)
    with pytest.raises(ValueError, match="has no segments"):
        logic.studyFromNodes([volume], segmentation)
    assert node_ids(scene) == before
    self_test._addSegment(segmentation, "Nothing", np.zeros(array.shape, bool), volume)
    before = node_ids(scene)
    with pytest.raises(ValueError, match="empty"):
        logic.studyFromNodes([volume], segmentation)
    assert node_ids(scene) == before


def test_volumes_on_other_grids_are_refused_by_name(module, scene, self_test):
    volume, _array, affine = self_test._syntheticVolume("t1")
    shifted = affine.copy()
    shifted[:3, 3] += 5.0
    other, _array, _affine = self_test._syntheticVolume("flair elsewhere", ijkToRas=shifted)
    small, _array, _affine = self_test._syntheticVolume("t2 small", shapeKji=(10, 12, 13))
    logic = module.NeuralRaycastLogic()
    before = node_ids(scene)
    with pytest.raises(ValueError, match="flair elsewhere"):
        logic.studyFromNodes([volume, other])
    with pytest.raises(ValueError, match="t2 small"):
        logic.studyFromNodes([volume, small])
    assert logic.volumesOffGrid([volume, other, small]) == ["flair elsewhere", "t2 small"]
    assert node_ids(scene) == before


def test_volumes_on_other_grids_are_resampled_when_asked(module, scene, self_test):
    volume, array, affine = self_test._syntheticVolume("t1")
    moved = affine.copy()
    moved[0, 3] -= 3.0  # two voxels along i (spacing -1.5 mm)
    other, otherArray, _affine = self_test._syntheticVolume("flair", ijkToRas=moved)
    logic = module.NeuralRaycastLogic()
    before = node_ids(scene)
    study = logic.studyFromNodes([volume, other], resampleToReference=True)
    resampled = study.channels["flair"]  # IJK
    np.testing.assert_allclose(resampled[2:], otherArray.transpose(2, 1, 0)[:-2], atol=1e-3)
    np.testing.assert_array_equal(resampled[:2], 0.0)
    np.testing.assert_array_equal(study.channels["t1"], array.transpose(2, 1, 0))
    assert node_ids(scene) == before


def test_a_brain_mask_label_map_is_read_and_checked(module, scene, self_test):
    """A brain mask (label map, non-zero inside) reaches the study; one on another grid is named among the
    volumes to resample and resampled nearest-neighbour (still a mask) when asked; an empty one is refused."""
    import slicer

    volume, array, affine = self_test._syntheticVolume("t1")
    inside = np.zeros(array.shape, np.uint8)
    inside[2:8, 3:9, 4:11] = 7
    moved = affine.copy()
    moved[0, 3] -= 3.0  # two voxels along i (spacing -1.5 mm)

    def label_map(values, name, ijk_to_ras):
        return slicer.util.addVolumeFromArray(values, ijkToRAS=ijk_to_ras, name=name,
                                              nodeClassName="vtkMRMLLabelMapVolumeNode")

    mask = label_map(inside, "brain mask", affine)
    shifted = label_map(inside, "shifted mask", moved)
    empty = label_map(np.zeros_like(inside), "empty mask", affine)
    logic = module.NeuralRaycastLogic()
    before = node_ids(scene)

    study = logic.studyFromNodes([volume], brainMaskNode=mask)
    np.testing.assert_array_equal(study.brain_mask, inside.transpose(2, 1, 0) != 0)
    assert logic.volumesOffGrid([volume], brainMaskNode=shifted) == ["shifted mask"]
    with pytest.raises(ValueError, match="shifted mask"):
        logic.studyFromNodes([volume], brainMaskNode=shifted)
    resampled = logic.studyFromNodes([volume], brainMaskNode=shifted, resampleToReference=True).brain_mask
    assert resampled.dtype == bool
    np.testing.assert_array_equal(resampled[2:], inside.transpose(2, 1, 0)[:-2] != 0)
    with pytest.raises(ValueError, match="brain mask"):
        logic.studyFromNodes([volume], brainMaskNode=empty)
    assert node_ids(scene) == before


def test_no_device_is_a_clear_error(module, scene, self_test, monkeypatch):
    import NeuralRaycastLib.gpu.device as gpu

    def no_device(choice=None):
        raise gpu.GpuUnavailableError("no usable GPU or Vulkan driver: install mesa-vulkan-drivers")

    monkeypatch.setattr(gpu, "open_device", no_device)
    volume, array, _affine = self_test._syntheticVolume("t1")
    logic = module.NeuralRaycastLogic()
    before = node_ids(scene)
    with pytest.raises(gpu.GpuUnavailableError, match="mesa-vulkan-drivers"):
        logic.train([volume], None)
    assert node_ids(scene) == before and logic.run is None


@pytest.mark.gpu
def test_the_gpu_memory_setting_is_the_budget_a_training_runs_under(module, scene, self_test, monkeypatch):
    """The module's GPU memory setting reaches train_study as the device's budget; empty is the device's own;
    an amount it cannot read is refused naming the setting, before any work."""
    import NeuralRaycastLib.train.run as run
    from NeuralRaycastLib.gpu.device import GpuMemoryError
    from NeuralRaycastLib.gpu.memory_budget import LOWER, MIB, MemoryBudget

    seen = []

    def recording_train_study(gpu, study, folder, settings, *args, **kwargs):
        seen.append(gpu.memory)
        raise RuntimeError("stopped before training")

    monkeypatch.setattr(run, "train_study", recording_train_study)
    volume, _array, _affine = self_test._syntheticVolume("t1")
    logic = module.NeuralRaycastLogic()
    for setting in ("64M", ""):
        with pytest.raises(RuntimeError, match="stopped before training"):
            logic.train([volume], None, preset="quick", gpuMemory=setting)
    default = logic.gpuContext("auto").memory
    assert seen == [MemoryBudget(64 * MIB, "the GPU memory setting"), default]
    assert default.source != "the GPU memory setting"
    with pytest.raises(ValueError, match="^the GPU memory setting: 'lots' is not an amount of memory"):
        logic.train([volume], None, gpuMemory="lots")
    assert len(seen) == 2

    def too_small(gpu, *args, **kwargs):
        raise GpuMemoryError(f"{gpu.memory.describe()} cannot hold this run; {LOWER}")

    monkeypatch.setattr(run, "train_study", too_small)
    with pytest.raises(GpuMemoryError) as raised:
        logic.train([volume], None, gpuMemory="2M")
    assert str(raised.value) == ("a GPU memory budget of 2 MiB (the GPU memory setting) cannot hold this run; raise "
                                 "the GPU memory setting if the GPU has more free, or choose the quick preset or a "
                                 "coarser study")
    assert "--" not in str(raised.value)  # no command-line options in the module's message


@pytest.mark.gpu
def test_cancel_keeps_a_saved_state_and_the_scene_unchanged(module, scene, self_test, tmp_path):
    from NeuralRaycastLib.train.presets import training_schedule

    _study, volumes, segmentation, _masks = self_test.phantomInScene(str(tmp_path))
    logic = module.NeuralRaycastLogic()
    before = node_ids(scene)
    polls = []

    def cancel_after_a_few_steps() -> bool:
        polls.append(1)
        return len(polls) > 5

    quick = training_schedule("quick")
    schedule = replace(quick, geometry=replace(quick.geometry, steps=40, monitor_every=10))
    run = logic.train(volumes, segmentation, preset="quick", views=4, size=32, config=schedule,
                      runFolder=tmp_path / "run", shouldStop=cancel_after_a_few_steps)
    assert run.log.cancelled
    assert (tmp_path / "run" / "model.safetensors").is_file()
    assert np.all(np.isfinite(run.field.parameters()))
    assert node_ids(scene) == before


@pytest.mark.gpu
def test_a_cancel_while_the_kernels_compile_trains_nothing_and_leaves_the_scene(module, scene, self_test, tmp_path,
                                                                               monkeypatch):
    """On a GPU that has not compiled the run's kernels, training first compiles them in worker processes
    (PythonSlicer) with the progress bar and Cancel live; a cancel there trains and writes nothing."""
    from NeuralRaycastLib.train import run, warmup

    _study, volumes, segmentation, _masks = self_test.phantomInScene(str(tmp_path))
    logic = module.NeuralRaycastLogic()
    before = node_ids(scene)
    calls, messages = [], []

    def compiling(gpu, study, prepared, settings, progress, should_stop, python):
        calls.append((sorted(study.structures), python))
        progress("SDF fit (stage 1): compiled", 0.4)
        if should_stop():
            raise warmup.WarmUpCancelled("cancelled while compiling the kernels; nothing was trained")

    monkeypatch.setattr(run, "ensure_warm", compiling)
    with pytest.raises(warmup.WarmUpCancelled):
        logic.train(volumes, segmentation, preset="quick", views=4, size=32, runFolder=tmp_path / "run",
                    progress=lambda message, fraction: messages.append(message), shouldStop=lambda: True)
    assert calls == [(sorted(_study.structures), logic.workerPython())]
    assert "SDF fit (stage 1): compiled" in messages  # the warm-up's progress reaches the bar
    assert logic.run is None and not (tmp_path / "run").exists() and node_ids(scene) == before


def test_training_again_replaces_the_last_run_and_refuses_any_other_non_empty_folder(module, scene, self_test,
                                                                                      tmp_path, monkeypatch):
    """The module keeps the last run's folder, so Train again writes there: that run is accepted, to be replaced
    whole. A folder of other files is refused before any work, its files kept."""
    from types import SimpleNamespace

    import NeuralRaycastLib.gpu.device as gpu
    from NeuralRaycastLib.outputs import OutputError
    from NeuralRaycastLib.train import field_ahead, run

    class Trained(Exception):
        pass

    def stop_at_the_field(*args, **kwargs):
        raise Trained

    monkeypatch.setattr(gpu, "open_device", lambda choice=None: SimpleNamespace(
        backend="vulkan", report=SimpleNamespace(software=True)))
    monkeypatch.setattr(run, "prepare_for_run", lambda study, settings, progress, gpu=None, with_outline=None,
                        before_maps=None: "prepared")
    monkeypatch.setattr(run, "ensure_warm", lambda *args: None)
    monkeypatch.setattr(run, "reference_views_for_run", lambda *args: "views")
    monkeypatch.setattr(run.RunSettings, "field_layout", lambda self, gpu, prepared: "layout")
    monkeypatch.setattr(field_ahead, "check_run_fits", lambda budget, layout, prepared, config: None)
    monkeypatch.setattr(field_ahead, "NeuralField", stop_at_the_field)
    _study, volumes, segmentation, _masks = self_test.phantomInScene(str(tmp_path))
    logic = module.NeuralRaycastLogic()
    last = tmp_path / "last-run"
    (last / "reference").mkdir(parents=True)
    for name in ("run.json", "model.safetensors", "metrics.json", "reference/old.png"):
        (last / name).write_text("{}")
    with pytest.raises(Trained):
        logic.train(volumes, segmentation, preset="quick", runFolder=str(last))
    # accepted (the work started); a run replaces the last one whole once it is complete, so a training that
    # fails leaves the last run as it was and nothing half-written beside it
    assert sorted(str(p.relative_to(last)) for p in last.rglob("*")) == [
        "metrics.json", "model.safetensors", "reference", "reference/old.png", "run.json"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("last-run")) == ["last-run"]
    other = tmp_path / "documents"
    other.mkdir()
    (other / "notes.txt").write_text("the user's notes")
    with pytest.raises(OutputError, match=f"{other} is not empty"):
        logic.train(volumes, segmentation, preset="quick", runFolder=str(other))
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


def test_worker_processes_run_in_pythonslicer_and_never_start_another_slicer(module, monkeypatch):
    """The warm-up's workers need Slicer's Python without its GUI: PythonSlicer where Slicer has one; in a
    Slicer without it none (its own executable would start another Slicer; the run then compiles itself);
    outside the application (these headless tests) this interpreter."""
    import shutil
    import sys

    import slicer

    logic = module.NeuralRaycastLogic
    installed = {"PythonSlicer": "/opt/Slicer/bin/PythonSlicer"}
    monkeypatch.setattr(shutil, "which", installed.get)
    assert logic.workerPython() == "/opt/Slicer/bin/PythonSlicer"
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert logic.workerPython() == sys.executable
    monkeypatch.setattr(slicer.app, "slicerHome", "/opt/Slicer", raising=False)
    assert logic.workerPython() is None


class TetrahedraRun:
    """Stands in for a trained run: three small tetrahedra as the learned surfaces."""

    def meshes(self, smoothing_iterations: int = 0, decimation: float = 0.0):
        from NeuralRaycastLib.mesh.mesh import Mesh

        vertices = np.array([[0, 0, 0], [10, 0, 0], [0, 10, 0], [0, 0, 10]], np.float64)
        faces = np.array([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]])
        return [Mesh(vertices + 20 * index, faces, vertices / 10.0, name, (0.5, 0.5, 0.5))
                for index, name in enumerate(("brain", "whole_tumor", "tumor_core"))]


def test_models_are_added_together_or_not_at_all(module, scene, monkeypatch):
    from NeuralRaycastLib.mesh.mesh import Mesh

    logic = module.NeuralRaycastLogic()
    logic.run = TetrahedraRun()
    calls = []
    original = Mesh.polydata

    def fails_on_the_third(self):
        calls.append(self.name)
        if len(calls) == 3:
            raise MemoryError("out of memory (simulated)")
        return original(self)

    monkeypatch.setattr(Mesh, "polydata", fails_on_the_third)
    before = node_ids(scene)
    with pytest.raises(MemoryError):
        logic.createModels(smoothingIterations=0)
    assert len(calls) == 3
    assert node_ids(scene) == before

    monkeypatch.setattr(Mesh, "polydata", original)
    models = logic.createModels(smoothingIterations=0)
    assert [model.GetName() for model in models] == ["brain (neural)", "whole tumor (neural)", "tumor core (neural)"]
    assert all(model.GetPolyData().GetNumberOfCells() == 4 for model in models)


def test_default_run_folder_is_outside_temporary_space(module):
    folder = pathlib.Path(module.NeuralRaycastLogic.defaultRunFolder("Case 7: T1/FLAIR"))
    assert folder.parent == pathlib.Path.home() / "NeuralRaycast" / "runs"
    assert re.fullmatch(r"Case_7_T1_FLAIR-\d{8}-\d{6}", folder.name)


def test_clearing_cached_data_keeps_the_compiled_kernels(module, tmp_path, monkeypatch):
    """"Clear cached data" frees the studies, boundary maps and reference views a second training on the same
    data would reuse; the compiled kernels stay."""
    from NeuralRaycastLib.paths import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    for name in ("studies", "prepared", "views", "shaders"):
        (tmp_path / name / "entry").mkdir(parents=True)
        (tmp_path / name / "entry" / "array.npy").write_bytes(b"x" * 100)
    assert module.NeuralRaycastLogic.clearCachedData() == 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shaders"]
    assert module.NeuralRaycastLogic.clearCachedData() == 0  # nothing left to clear is no error


# --- training in a worker process --------------------------------------------------------------------------------


def _study_in_scene(self_test):
    volume, array, _affine = self_test._syntheticVolume("t1")
    segmentation = self_test._newSegmentation(volume)
    self_test._addSegment(segmentation, "Tumor", self_test._box(array.shape, (3, 6), (4, 8), (5, 9)), volume)
    return volume, segmentation


def test_training_starts_in_a_worker_running_the_command_lines_fit(module, scene, self_test, tmp_path):
    import sys

    volume, segmentation = _study_in_scene(self_test)
    logic = module.NeuralRaycastLogic()
    before = node_ids(scene)
    job = logic.startTraining([volume], segmentation, preset="quick", seed=3, iterations=50, shadows=True,
                              runFolder=tmp_path / "run")
    try:
        command = job.worker.command
        assert command[:4] == [sys.executable, "-m", "NeuralRaycastLib.app.entry", "fit"]  # PythonSlicer in Slicer
        assert command[command.index("--out") + 1] == str(tmp_path / "run")
        assert {"--progress-json", "--shadows"} <= set(command)
        assert command[command.index("--iterations") + 1] == "50" and command[command.index("--seed") + 1] == "3"
        study = pathlib.Path(command[4])
        assert study.name == "manifest.json" and study.is_file()  # the scene's study, handed over as files
        assert job.worker.env["PYTHONPATH"].split(os.pathsep)[0] == str(slicer_harness.ROOT)
    finally:
        job.kill()
    assert job.outcome.state == "cancelled" and not job.outcome.trained
    assert not study.parent.exists()  # the temporary study is removed once the worker has ended
    assert not (tmp_path / "run").exists()
    assert node_ids(scene) == before and logic.run is None


def test_the_pretrained_appearance_trains_in_the_worker_and_is_refused_with_shadows_before_it_starts(
        module, scene, self_test, tmp_path):
    volume, segmentation = _study_in_scene(self_test)
    logic = module.NeuralRaycastLogic()
    with pytest.raises(ValueError, match="pretrained appearance.*shadows"):
        logic.startTraining([volume], segmentation, preset="quick", shadows=True, pretrainedAppearance=True,
                            runFolder=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    job = logic.startTraining([volume], segmentation, preset="quick", pretrainedAppearance=True,
                              runFolder=tmp_path / "run")
    try:
        command = job.worker.command
        assert command[command.index("--appearance") + 1] == "pretrained" and "--shadows" not in command
    finally:
        job.kill()
    assert not (tmp_path / "run").exists()


def test_gaussians_train_in_the_worker_and_are_refused_with_shadows_or_the_pretrained_appearance_before_it_starts(
        module, scene, self_test, tmp_path):
    volume, segmentation = _study_in_scene(self_test)
    logic = module.NeuralRaycastLogic()
    before = node_ids(scene)
    refusals = ((dict(shadows=True), "shadows are not available with the Gaussians yet: untick shadows or choose "
                                     "the field"),
                (dict(pretrainedAppearance=True), "the pretrained appearance is for the field; the Gaussians carry "
                                                  "their own colours: untick the pretrained appearance or choose "
                                                  "the field"))
    for options, message in refusals:
        with pytest.raises(ValueError) as refused:
            logic.startTraining([volume], segmentation, preset="quick", representation="gaussians",
                                runFolder=tmp_path / "refused", **options)
        assert str(refused.value) == message
        with pytest.raises(ValueError, match=message.split(":")[0]):  # the blocking training refuses the same
            logic.train([volume], segmentation, representation="gaussians", runFolder=tmp_path / "refused",
                         **options)
    with pytest.raises(ValueError, match="Unknown representation 'splats': choose one of field, gaussians"):
        logic.startTraining([volume], segmentation, representation="splats", runFolder=tmp_path / "refused")
    assert not (tmp_path / "refused").exists() and node_ids(scene) == before
    job = logic.startTraining([volume], segmentation, preset="quick", representation="gaussians",
                              runFolder=tmp_path / "run")
    try:
        command = job.worker.command
        assert command[command.index("--representation") + 1] == "gaussians" and "--progress-json" in command
        assert "--shadows" not in command and "--appearance" not in command
    finally:
        job.kill()
    job = logic.startTraining([volume], segmentation, preset="quick", runFolder=tmp_path / "field")
    try:
        assert "--representation" not in job.worker.command  # the field, as before
    finally:
        job.kill()
    assert not (tmp_path / "run").exists() and node_ids(scene) == before


def test_the_command_line_refuses_gaussians_with_shadows_in_the_stream_the_worker_reads(
        module, scene, self_test, tmp_path, capsys):
    """The worker's own refusal, should a caller skip the Logic's: one error event and exit status 2, before the
    device opens and with no run folder left."""
    import json

    from NeuralRaycastLib.app.cli import main
    from NeuralRaycastLib.study.study import write_study

    volume, segmentation = _study_in_scene(self_test)
    manifest = write_study(module.NeuralRaycastLogic().studyFromNodes([volume], segmentation), tmp_path / "study")
    capsys.readouterr()
    code = main(["fit", str(manifest), "--representation", "gaussians", "--shadows", "--progress-json",
                 "--out", str(tmp_path / "run")])
    assert code == 2
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert events == [{"event": "error", "message": "--shadows is not available with --representation gaussians "
                                                    "yet; leave one of them out"}]
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(os.name == "nt", reason="signals as on POSIX")
def test_a_worker_that_dies_is_one_clear_message_and_the_scene_is_unchanged(module, scene, self_test, tmp_path):
    import signal

    volume, segmentation = _study_in_scene(self_test)
    logic = module.NeuralRaycastLogic()
    before = node_ids(scene)
    job = logic.startTraining([volume], segmentation, runFolder=tmp_path / "run")
    os.killpg(job.worker.pid, signal.SIGKILL)  # as a GPU fault or the out-of-memory killer would
    outcome = job.wait()
    assert outcome.state == "crashed"
    assert outcome.message.startswith("the training process ended unexpectedly (signal SIGKILL); nothing was saved "
                                      "and the scene is unchanged")
    assert node_ids(scene) == before and logic.run is None and not (tmp_path / "run").exists()


def test_inputs_are_checked_before_the_gpu_is_opened(module, scene, monkeypatch):
    """Where slangpy is missing (a fresh Slicer, the Extensions Index's build machines) a missing input is still
    reported as such."""
    import sys

    import NeuralRaycastLib.gpu.device as device

    monkeypatch.setitem(sys.modules, "slangpy", None)  # importing it fails
    monkeypatch.setattr(device, "_CONTEXTS", {})  # no device an earlier test of this process opened
    logic = module.NeuralRaycastLogic()
    with pytest.raises(ValueError, match="No input volume"):
        logic.train([], None)
    with pytest.raises(ValueError, match="No input volume"):
        logic.startTraining([], None)
    from NeuralRaycastLib.gpu.device import GpuUnavailableError

    with pytest.raises(GpuUnavailableError):  # and the GPU's absence is its own error
        module.NeuralRaycastLogic.gpuContext("auto")


def test_the_gpu_self_test_is_skipped_with_its_reason_where_no_device_opens(module, self_test, monkeypatch):
    import NeuralRaycastLib.gpu.device as gpu

    def no_device(choice=None, *args):
        raise gpu.GpuUnavailableError("no usable GPU or Vulkan driver: install mesa-vulkan-drivers")

    monkeypatch.setattr(gpu, "open_device", no_device)
    shown = []
    monkeypatch.setattr(self_test, "delayDisplay", lambda message, msec=None: shown.append(message))
    self_test.test_TrainRenderModels()
    assert shown == ["Skipped the train, render and models test: no usable GPU or Vulkan driver: install "
                     "mesa-vulkan-drivers"]


def test_the_modules_presets_and_devices_are_the_librarys(module):
    from NeuralRaycastLib.gpu.device import CHOICES
    from NeuralRaycastLib.train.presets import AUTO, PRESETS

    assert (AUTO, *PRESETS) == module.PRESETS
    assert module.DEVICES == CHOICES


def test_loading_the_module_file_changes_no_import_path(module):
    source = slicer_harness.MODULE_FILE.read_text()
    top_level = [line for line in source.splitlines() if line.startswith(("sys.path", "import NeuralRaycastLib",
                                                                          "from NeuralRaycastLib"))]
    assert top_level == []
    import ast

    for node in ast.parse(source).body:  # file scope: no statement touches sys.path
        assert "sys.path" not in ast.unparse(node) or isinstance(node, ast.FunctionDef), ast.unparse(node)[:80]


def test_pip_constraints_keep_slicers_numpy(module, tmp_path):
    import importlib.metadata

    path = module.NeuralRaycastLogic.writePipConstraints(str(tmp_path))
    lines = pathlib.Path(path).read_text().splitlines()
    assert f"numpy=={importlib.metadata.version('numpy')}" in lines


def test_the_logic_opens_no_dialogs(module):
    import ast
    import inspect

    source = inspect.getsource(module.NeuralRaycastLogic)
    calls = {ast.unparse(node.func) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)}
    dialogs = {call for call in calls if re.search(r"Display$|pip_install|pip_ensure|QMessageBox", call)}
    assert dialogs == set()


# --- the widget around a run, with the .ui's widgets as stand-ins -------------------------------------------------


@pytest.fixture
def widget(module, scene, monkeypatch):
    import slicer

    monkeypatch.setattr(slicer.util, "showStatusMessage", lambda *args: None, raising=False)
    panel = module.NeuralRaycastWidget()
    panel.ui = slicer_harness.load_ui(UI_FILE)
    panel.logic = module.NeuralRaycastLogic()
    panel.setParameterNode(panel.logic.getParameterNode())
    yield panel
    panel.setParameterNode(None)


def test_every_input_and_the_cache_button_are_disabled_while_a_run_goes(widget):
    bound = [w for w in vars(widget.ui).values() if w.property("SlicerParameterName")]
    assert len(bound) == len(widget._parameterNode.allParameters)
    widget._setRunning(True)
    assert all(not w.enabled for w in bound)
    assert not widget.ui.clearCacheButton.enabled and not widget.ui.loadButton.enabled
    assert widget.ui.applyButton.enabled and widget.ui.applyButton.text == "Cancel"
    widget._setRunning(False)
    assert all(w.enabled for w in bound) and widget.ui.clearCacheButton.enabled


def test_the_widget_keeps_a_training_process_ready_unless_told_not_to_or_a_run_goes(widget, monkeypatch):
    """On entering the module and after each run the widget asks the logic for a process kept ready, for the
    parameter node's device and preset; not while a run goes, nor with the setting off; a failure to start one
    leaves Train as it was (logged, not shown)."""
    asked = []
    monkeypatch.setattr(widget.logic, "startStandby", lambda device, preset: asked.append((device, preset)) or True)
    widget._parameterNode.device, widget._parameterNode.preset = "vulkan", "quick"
    widget._keepProcessReady()
    assert asked == [("vulkan", "quick")]
    widget._job = object()  # a run goes
    widget._keepProcessReady()
    widget._job = None
    widget.logic.keepTrainingProcessReady = False
    widget._keepProcessReady()
    assert asked == [("vulkan", "quick")]
    widget.logic.keepTrainingProcessReady = True

    def fails(device, preset):
        raise OSError("no such interpreter")

    monkeypatch.setattr(widget.logic, "startStandby", fails)
    widget._keepProcessReady()  # no exception, no dialog (the logic opens none: test_the_logic_opens_no_dialogs)


def test_a_run_that_ends_after_the_scene_closed_says_where_its_model_is(widget, scene, self_test, tmp_path):
    from types import SimpleNamespace

    from NeuralRaycastLib.app.worker import Outcome

    volume, segmentation = _study_in_scene(self_test)
    inputs = {"volumes": [volume.GetID()], "segmentation": segmentation.GetID(), "probability": None,
              "brainMask": None, "device": "auto", "gpuMemory": "", "resample": False}
    widget.onSceneStartClose(None, None)  # as Slicer: the widget lets go of the parameter node, then the scene clears
    scene.Clear(0)
    assert widget._parameterNode is None
    before = node_ids(scene)
    job = SimpleNamespace(runFolder=str(tmp_path / "run"))
    widget._trainingEnded(job, Outcome("done", "trained", str(tmp_path / "run"), 0), inputs)
    assert str(tmp_path / "run") in widget.ui.resultsText.plainText
    assert "left the scene" in widget.ui.resultsText.plainText
    assert node_ids(scene) == before


def test_a_crashed_run_is_one_error_message(widget, scene, monkeypatch):
    import slicer

    from NeuralRaycastLib.app.worker import Outcome

    shown = []
    monkeypatch.setattr(slicer.util, "errorDisplay", lambda text, **kwargs: shown.append(text), raising=False)
    before = node_ids(scene)
    widget._trainingEnded(None, Outcome("crashed", "the training process ended unexpectedly (signal SIGSEGV); "
                                        "nothing was saved and the scene is unchanged"), None)
    assert shown == ["Training failed: the training process ended unexpectedly (signal SIGSEGV); nothing was saved "
                     "and the scene is unchanged"]
    assert node_ids(scene) == before


def test_the_ui_binds_every_widget_to_its_parameter_both_ways(module, scene, self_test, tmp_path):
    """Each widget the .ui binds shows its parameter and writes the user's edit to it, through the pairings of
    widget class and type Slicer's GUI connectors accept; every parameter has its widget."""
    ui = slicer_harness.load_ui(UI_FILE)
    parameters = module.NeuralRaycastLogic().getParameterNode()
    tag = parameters.connectGui(ui)
    bound = {w.property("SlicerParameterName"): w for w in vars(ui).values() if w.property("SlicerParameterName")}
    assert set(bound) == set(module.NeuralRaycastParameterNode.allParameters)
    volume, _array, _affine = self_test._syntheticVolume("t1")
    edits = {"preset": "high", "device": "vulkan", "gpuMemory": "6G", "seed": 11, "iterations": 900,
             "shadows": True, "pretrainedAppearance": True, "representation": "gaussians", "meshSmoothing": 4,
             "labelmapOversampling": 3,
             "runFolder": tmp_path / "run",
             "inputSegmentation": self_test._newSegmentation(volume),
             "outputRender": scene.AddNewNodeByClass("vtkMRMLVectorVolumeNode", "render")}
    for name in ("inputVolume", "inputVolume2", "inputVolume3", "inputVolume4", "probabilityVolume",
                 "brainMaskVolume"):
        edits[name] = volume
    assert set(edits) == set(bound)
    for name, value in edits.items():
        bound[name].user_sets(value)
        assert getattr(parameters, name) == value, name
    assert bound["preset"].items == list(module.PRESETS)
    assert bound["representation"].items == ["field", "gaussians"]
    assert bound["seed"].maximum == 2**31 - 1
    parameters.meshSmoothing = 7  # and the parameter shows in its widget
    assert bound["meshSmoothing"].value == 7
    with pytest.raises(ValueError):
        bound["meshSmoothing"].user_sets(500)  # out of range, refused as the wrapper does
    parameters.disconnectGui(tag)
    bound["seed"].user_sets(12)
    assert parameters.seed == 11


def test_a_widget_without_a_parameter_or_of_a_class_no_connector_binds_is_refused(module, scene):
    ui = slicer_harness.load_ui(UI_FILE)
    ui.seedSpinBox.properties["SlicerParameterName"] = "randomSeed"
    parameters = module.NeuralRaycastLogic().getParameterNode()
    with pytest.raises(ValueError, match="seedSpinBox.*randomSeed"):
        parameters.connectGui(ui)
    ui = slicer_harness.load_ui(UI_FILE)
    ui.shadowsCheckBox.className = "QLineEdit"
    with pytest.raises(TypeError, match="shadowsCheckBox"):
        parameters.connectGui(ui)


@pytest.mark.gpu
def test_a_worker_trains_into_a_run_folder_and_leaves_the_scene_unchanged(module, scene, self_test, tmp_path):
    """End to end through the worker: the command line's training in a process of its own, its progress read,
    the run folder written; the scene gains nothing (the widget then loads the run with loadRun)."""
    _study, volumes, segmentation, _masks = self_test.phantomInScene(str(tmp_path), spacing=4.0)
    logic = module.NeuralRaycastLogic()
    before = node_ids(scene)
    job = logic.startTraining(volumes, segmentation, preset="quick", iterations=30, views=4, size=32,
                              runFolder=tmp_path / "run")
    reports = []
    outcome = job.wait(lambda message, fraction: reports.append(message))
    assert outcome.state == "done", outcome.message
    assert outcome.run_folder == str(tmp_path / "run") and (tmp_path / "run" / "model.safetensors").is_file()
    assert any("held-out PSNR" in message for message in reports) and outcome.heldout_psnr > 10
    assert node_ids(scene) == before and logic.run is None


def test_a_training_process_kept_ready_takes_the_next_training(module, scene, self_test, tmp_path):
    """``startStandby`` starts ``neuralraycast standby`` ahead of Train; ``startTraining`` then hands it the study
    (its job: the command line's fit arguments) instead of starting a process, and it trains into the run folder,
    the scene unchanged. A process kept ready for another device is ended, not used; none is kept without
    PythonSlicer."""
    import shutil
    import sys
    import time

    import slicer

    _study, volumes, segmentation, _masks = self_test.phantomInScene(str(tmp_path), spacing=4.0)
    logic = module.NeuralRaycastLogic()
    before = node_ids(scene)
    assert logic.startStandby("auto", "quick")
    standby = logic.standby
    try:
        assert standby.command == [sys.executable, "-m", "NeuralRaycastLib.app.entry", "standby", "--device", "auto",
                                   "--preset", "quick"]
        assert logic.startStandby("auto", "quick") and logic.standby is standby  # one at a time
        deadline = time.monotonic() + 120
        while not standby.poll_ready():
            assert standby.running and time.monotonic() < deadline, standby.poll()
            time.sleep(0.05)
        job = logic.startTraining(volumes, segmentation, preset="quick", iterations=30, views=4, size=32,
                                  runFolder=tmp_path / "run")
        assert job.worker is standby and logic.standby is None
        assert standby.job[0].endswith("manifest.json") and standby.job[standby.job.index("--out") + 1] == str(
            tmp_path / "run")
        outcome = job.wait()
        assert outcome.state == "done" and (tmp_path / "run" / "model.safetensors").is_file(), outcome.message
        assert node_ids(scene) == before and logic.run is None
        # Kept ready for the automatic device, a training on another: that process is ended, a fresh one trains.
        assert logic.startStandby("auto", "quick")
        other = logic.standby
        job = logic.startTraining(volumes, segmentation, preset="quick", device="vulkan", iterations=30, views=4,
                                  size=32, runFolder=tmp_path / "second")
        try:
            assert job.worker is not other and job.worker.job is None and other.process.poll() is not None
            assert job.worker.command[3] == "fit"
        finally:
            job.kill()
    finally:
        logic.stopStandby()
        standby.kill()
    assert logic.standby is None
    assert logic.startStandby("auto", "quick")
    ended = logic.standby
    ended.kill()  # as one that ends for want of a device: the next call starts another
    assert logic.startStandby("auto", "quick") and logic.standby is not ended
    logic.stopStandby()
    original = slicer.app
    try:
        slicer.app = type("InstalledSlicer", (), {"slicerHome": "/opt/Slicer"})()  # no PythonSlicer beside it
        with pytest.MonkeyPatch.context() as patched:
            patched.setattr(shutil, "which", lambda name: None)
            assert not logic.startStandby("auto", "quick") and logic.standby is None
    finally:
        slicer.app = original


@pytest.mark.gpu
def test_a_gaussian_run_from_the_worker_loads_with_models_tables_and_live_view_and_refuses_the_web_page(
        widget, scene, self_test, tmp_path):
    """Gaussians chosen: the worker trains them (its progress read), the run loads on the scene's study, its
    models, segmentation, tables, render and live view come from the Gaussians; the web page, which needs a field,
    is off with the reason and refused in one line."""
    _study, volumes, segmentation, _masks = self_test.phantomInScene(str(tmp_path / "sample"), spacing=4.0)
    logic = widget.logic
    job = logic.startTraining(volumes, segmentation, preset="quick", iterations=6, views=4, size=32,
                              representation="gaussians", runFolder=tmp_path / "run")
    reports = []
    outcome = job.wait(lambda message, fraction: reports.append(message))
    assert outcome.state == "done", outcome.message
    assert (tmp_path / "run" / "gaussians.safetensors").is_file() and outcome.heldout_psnr > 10
    assert any(message.startswith("Gaussians: step 6") for message in reports), reports

    run = logic.loadRun(tmp_path / "run", volumes, segmentation)
    assert logic.isGaussianRun(run)
    summary = logic.trainingSummary(run)
    assert "Representation: Gaussians" in summary and "Held-out PSNR" in summary
    widget._checkCanApply()
    assert widget.ui.renderButton.enabled and widget.ui.modelsButton.enabled and widget.ui.segmentationButton.enabled
    assert widget.ui.liveViewButton.enabled
    assert not widget.ui.shareButton.enabled and "Gaussians" in widget.ui.shareButton.toolTip
    cameraNode = scene.AddNewNodeByClass("vtkMRMLCameraNode", "3D view camera")
    centre = run.prepared.bounds.mean(axis=0)
    cameraNode.SetFocalPoint(*centre)
    cameraNode.SetPosition(*(centre + (0.0, -600.0, 0.0)))
    cameraNode.SetViewUp(0.0, 0.0, 1.0)
    camera = logic.cameraFromNode(cameraNode, (24, 16))
    live_picture = logic.liveRender(camera)  # the live view's: straight-alpha bytes, rows from the bottom
    assert live_picture.shape == (16, 24, 4) and live_picture.dtype == np.uint8
    np.testing.assert_array_equal(live_picture, run.scene.render_picture(camera))
    assert live_picture[..., 3].max() > 0  # the phantom is in the picture
    import vtk

    window = vtk.vtkRenderWindow()
    window.SetOffScreenRendering(1)
    window.SetSize(24, 16)
    renderer = vtk.vtkRenderer()
    window.AddRenderer(renderer)
    renderer.SetActiveCamera(cameraNode.GetCamera())
    queue = []
    live = logic.createLiveView(cameraNode, window, queue.append)
    while queue:
        queue.pop(0)()
    assert live.shown == [(24, 16)] and live.layer.pixels()[..., 3].max() > 0
    live.close()
    with pytest.raises(ValueError, match="is of Gaussians: the web page is for field models only so far"):
        logic.sharePage(run.folder, tmp_path / "page.html")
    assert not (tmp_path / "page.html").exists()

    render = logic.renderCamera(camera)
    assert render.GetImageData().GetDimensions()[:2] == (24, 16)
    models = logic.createModels(smoothingIterations=0)
    assert models and all(model.GetPolyData().GetNumberOfPoints() > 0 for model in models)
    logic.createSegmentation(oversampling=1, smoothingIterations=0, referenceVolumeNode=volumes[0])
    structures, _pieces = logic.createResultsTables()
    assert structures.GetTable().GetNumberOfRows() == len(run.prepared.structures)
# --- the learned surfaces as Slicer data: segmentation, tables, live view ------------------------------------


class PhantomField:
    """Stands in for a trained field: the phantom's exact surfaces, each moved out by a third of a millimetre
    (so the learned surfaces differ a little from the labels, as a trained field's do)."""

    def __init__(self, phantom, names) -> None:
        self.phantom, self.names = phantom, list(names)

    def distances(self, points: np.ndarray) -> np.ndarray:
        return np.stack([self.phantom.sdf(name, points) - 0.3 for name in self.names], axis=-1).astype(np.float32)


class TracingRenderer:
    """Stands in for the neural renderer: the phantom's brain sphere-traced on the CPU (white where hit)."""

    def __init__(self, phantom) -> None:
        self.phantom, self.cameras = phantom, []

    def render(self, camera):
        from conftest import sphere_trace

        from NeuralRaycastLib.render.image import RenderedImage

        self.cameras.append(camera)
        depth = sphere_trace(lambda p: self.phantom.sdf("brain", p), np.asarray(camera.position),
                             camera.ray_directions())
        alpha = np.isfinite(depth).astype(np.float32)[..., None]
        rgba = np.concatenate([0.8 * alpha.repeat(3, axis=-1), alpha], axis=-1)
        return RenderedImage(rgba, np.where(np.isfinite(depth), depth, 0.0).astype(np.float32),
                             np.zeros(depth.shape + (3,), np.float32))

    def render_picture(self, camera):
        from NeuralRaycastLib.render.live_view import rgba_bytes

        return rgba_bytes(self.render(camera).rgba)  # as the renderer's picture: bytes, the rows from the bottom


#: The input segments the learned structures are named and coloured after (as studyFromNodes records them).
INPUT_SEGMENTS = {"whole_tumor": ("Oedema and tumour", (0.1, 0.6, 0.3)),
                  "tumor_core": ("Core", (0.2, 0.3, 0.9)),
                  "enhancing_tumor": ("Enhancing rim", (0.7, 0.2, 0.8))}


@pytest.fixture(scope="module")
def phantom_run(tmp_path_factory):
    """A run of the analytic phantom on a 4 mm grid whose field is the phantom's exact surfaces moved out a
    little, with a small piece of the whole tumour's label noted as left out."""
    from conftest import phantom_prepared

    from NeuralRaycastLib.study.drawn_labels import LabelNote
    from NeuralRaycastLib.study.pieces import Piece
    from NeuralRaycastLib.train.run_folder import TrainedRun

    phantom, prepared = phantom_prepared(4.0)
    prepared.label_notes = {"whole_tumor": LabelNote(left_out=[Piece(3, 0.192, (10.0, -20.0, 30.0))])}
    field = PhantomField(phantom, [structure.name for structure in prepared.structures])
    return TrainedRun(tmp_path_factory.mktemp("run"), prepared, field, TracingRenderer(phantom), settings=None)


@pytest.fixture
def phantom_logic(module, scene, phantom_run):
    logic = module.NeuralRaycastLogic()
    logic.run = phantom_run
    logic.structureSegments = dict(INPUT_SEGMENTS)
    return logic


def segment_labelmap(segment) -> tuple[np.ndarray, np.ndarray]:
    """A segment's binary label map as Slicer holds it: (bool I, J, K array, RAS of its voxel centres)."""
    import slicer
    import vtk
    from vtk.util.numpy_support import vtk_to_numpy

    image = segment.GetRepresentation(slicer.vtkSegmentationConverter.GetBinaryLabelmapRepresentationName())
    extent = image.GetExtent()
    counts = [extent[1] - extent[0] + 1, extent[3] - extent[2] + 1, extent[5] - extent[4] + 1]
    values = vtk_to_numpy(image.GetPointData().GetScalars()).reshape(counts[::-1]).transpose(2, 1, 0)
    matrix = vtk.vtkMatrix4x4()
    image.GetImageToWorldMatrix(matrix)
    ijkToRas = slicer.util.arrayFromVTKMatrix(matrix)
    ijk = np.stack(np.meshgrid(*[np.arange(extent[2 * a], extent[2 * a + 1] + 1) for a in range(3)],
                               indexing="ij"), axis=-1).reshape(-1, 3)
    return values == segment.GetLabelValue(), (ijk @ ijkToRas[:3, :3].T + ijkToRas[:3, 3]).reshape(*counts, 3)


def test_the_learned_surfaces_become_a_segmentation_with_closed_surfaces_and_fine_label_maps(module, scene,
                                                                                           phantom_logic, tmp_path):
    import slicer
    import vtk

    from NeuralRaycastLib.mesh.surface_distance import signed_distance_to_mesh
    from NeuralRaycastLib.train.evaluate import dice

    run = phantom_logic.run
    reference = slicer.util.addVolumeFromArray(np.zeros(run.prepared.study.shape[::-1], np.int16),
                                               ijkToRAS=run.prepared.affine, name="reference")
    node = phantom_logic.createSegmentation(oversampling=2, smoothingIterations=10, referenceVolumeNode=reference)
    segmentation = node.GetSegmentation()
    meshes = {mesh.name: mesh for mesh in run.meshes(smoothing_iterations=10)}
    assert segmentation.GetNumberOfSegments() == 4
    assert segmentation.GetSourceRepresentationName() == "Binary labelmap"  # what Segment Editor edits
    assert node.GetNodeReference(node.GetReferenceImageGeometryReferenceRole()) is reference
    fineSpacing = np.linalg.norm(run.prepared.affine[:3, :3], axis=0) / 2
    for name, mesh in meshes.items():
        segment = segmentation.GetSegment(name)
        expectedName, expectedColor = INPUT_SEGMENTS.get(name, ("brain", mesh.color))
        assert segment.GetName() == expectedName
        np.testing.assert_allclose(segment.GetColor(), expectedColor, atol=1e-6)

        # the closed surface is the learned mesh, and closed
        surface = segment.GetRepresentation("Closed surface")
        assert surface.GetNumberOfPoints() == len(mesh.vertices) and surface.GetNumberOfCells() == len(mesh.faces)
        edges = vtk.vtkFeatureEdges()
        edges.SetInputData(surface)
        edges.BoundaryEdgesOn()
        edges.NonManifoldEdgesOn()
        edges.FeatureEdgesOff()
        edges.ManifoldEdgesOff()
        edges.Update()
        assert edges.GetOutput().GetNumberOfCells() == 0, f"the surface of '{name}' is not closed"

        # the label map is on the study's grid split in two, and holds the mesh's interior
        inside, centres = segment_labelmap(segment)
        matrix = vtk.vtkMatrix4x4()
        segment.GetRepresentation("Binary labelmap").GetImageToWorldMatrix(matrix)
        np.testing.assert_allclose(np.linalg.norm(slicer.util.arrayFromVTKMatrix(matrix)[:3, :3], axis=0),
                                   fineSpacing)
        truth = signed_distance_to_mesh(mesh.vertices, mesh.faces, centres.reshape(-1, 3)).reshape(inside.shape) < 0
        assert truth.any() and dice(inside, truth) >= 0.99, name

    # export to a label map volume (what File > Export and the segment tools read) keeps the finer grid
    labelmapNode = scene.AddNewNodeByClass("vtkMRMLLabelMapVolumeNode", "exported")
    assert slicer.vtkSlicerSegmentationsModuleLogic.ExportAllSegmentsToLabelmapNode(node, labelmapNode, 0)
    np.testing.assert_allclose(labelmapNode.GetSpacing(), fineSpacing)
    assert set(np.unique(slicer.util.arrayFromVolume(labelmapNode))) == {0, 1, 2, 3, 4}

    # saved as a .seg.nrrd (what a saved scene holds) and read back: the same segments, voxels and colours
    voxels = {name: int(segment_labelmap(segmentation.GetSegment(name))[0].sum()) for name in meshes}
    storage = slicer.vtkMRMLSegmentationStorageNode()
    scene.AddNode(storage)
    storage.SetFileName(str(tmp_path / "learned.seg.nrrd"))
    assert storage.WriteData(node)
    reread = scene.AddNewNodeByClass("vtkMRMLSegmentationNode", "reread")
    assert storage.ReadData(reread)
    segments = reread.GetSegmentation()
    for name in meshes:
        segment = segments.GetSegment(name)
        assert segment.GetName() == segmentation.GetSegment(name).GetName()
        np.testing.assert_allclose(segment.GetColor(), segmentation.GetSegment(name).GetColor(), atol=1e-6)
        assert int(segment_labelmap(segment)[0].sum()) == voxels[name]

    # made again: the same node, its segments replaced
    again = phantom_logic.createSegmentation(oversampling=1, smoothingIterations=0)
    assert again.GetID() == node.GetID() and again.GetSegmentation().GetNumberOfSegments() == 4


def test_the_per_structure_table_and_the_pieces_table(module, scene, phantom_logic):
    from NeuralRaycastLib.train.structure_table import NOT_REACHED, PIECE_COLUMNS, STRUCTURE_COLUMNS

    before = node_ids(scene)
    structures, pieces = phantom_logic.createResultsTables()
    assert len(node_ids(scene) - before) == 2
    table = structures.GetTable()
    assert [table.GetColumn(i).GetName() for i in range(table.GetNumberOfColumns())] == \
        [column.title for column in STRUCTURE_COLUMNS]
    assert structures.GetColumnUnitLabel("Mean surface distance") == "mm"
    segments = [table.GetValueByName(row, "Segment").ToString() for row in range(table.GetNumberOfRows())]
    assert segments == ["brain", "Oedema and tumour", "Core", "Enhancing rim"]
    for row in range(table.GetNumberOfRows()):
        # surfaces a third of a millimetre out on a 4 mm grid: close, and a little larger than the labels
        assert 0.85 < table.GetValueByName(row, "Dice").ToDouble() <= 1.0
        assert 0.0 < table.GetValueByName(row, "Mean surface distance").ToDouble() < 1.0
        label, learned = (table.GetValueByName(row, title).ToDouble() for title in ("Label volume", "Learned volume"))
        assert label > 0.0 and learned > 0.0
        difference = table.GetValueByName(row, "Volume difference").ToDouble()
        assert difference == pytest.approx(100 * (learned - label) / label)
        assert table.GetValueByName(row, "Label pieces").ToDouble() >= 1.0
    assert table.GetValueByName(1, "Small pieces left out").ToDouble() == 1.0

    listed = pieces.GetTable()
    assert [listed.GetColumn(i).GetName() for i in range(listed.GetNumberOfColumns())] == \
        [column.title for column in PIECE_COLUMNS]
    rows = [(listed.GetValueByName(row, "Segment").ToString(), listed.GetValueByName(row, "What").ToString(),
             listed.GetValueByName(row, "R").ToDouble()) for row in range(listed.GetNumberOfRows())]
    assert ("Oedema and tumour", "left out (smaller than the minimum piece size)", 10.0) in rows
    assert not any(what == NOT_REACHED for _segment, what, _r in rows)

    # made again: the same two nodes
    again = phantom_logic.createResultsTables()
    assert [node.GetID() for node in again] == [structures.GetID(), pieces.GetID()]
    assert node_ids(scene) - before == {structures.GetID(), pieces.GetID()}


def test_the_live_view_follows_the_3d_views_camera_node_at_the_views_size(module, scene, phantom_logic):
    import vtk

    window = vtk.vtkRenderWindow()
    window.SetOffScreenRendering(1)
    window.SetSize(40, 32)
    renderer = vtk.vtkRenderer()
    window.AddRenderer(renderer)
    cameraNode = scene.AddNewNodeByClass("vtkMRMLCameraNode", "3D view camera")
    renderer.SetActiveCamera(cameraNode.GetCamera())
    values = phantom_logic.run.prepared.bounds.mean(axis=0)
    cameraNode.SetFocalPoint(*values)
    cameraNode.SetPosition(*(values + (0.0, -600.0, 0.0)))
    cameraNode.SetViewUp(0.0, 0.0, 1.0)
    queue = []
    rendered = phantom_logic.run.renderer.cameras
    rendered.clear()
    live = phantom_logic.createLiveView(cameraNode, window, queue.append)

    def settle() -> None:
        assert len(queue) <= 1, "renders queued up"
        while queue:
            queue.pop(0)()

    settle()
    assert live.layer.pixels()[..., 3].mean() > 0.1  # the brain is in the picture
    cameraNode.GetCamera().Azimuth(30.0)  # what a mouse drag does to the camera
    cameraNode.GetCamera().Elevation(10.0)
    settle()
    cameraNode.SetPosition(*(values + (600.0, 0.0, 0.0)))  # a script
    settle()
    from conftest import sphere_actor

    renderer.AddActor(sphere_actor(80.0, values))
    cameraNode.Reset(True, True, True, renderer)  # the view's reset
    settle()
    assert len(rendered) == 4 and len({camera.position for camera in rendered}) == 4
    assert all((camera.width, camera.height) == (40, 32) for camera in rendered)
    assert live.shown == [(40, 32)] * 4
    assert live.scheduler.stats.most_waiting == 1
    live.close()

    phantom_logic.run = None
    with pytest.raises(RuntimeError, match="No trained model"):
        phantom_logic.createLiveView(cameraNode, window, queue.append)


def test_the_live_view_is_coarser_on_a_software_device(module, scene, phantom_logic, monkeypatch):
    from types import SimpleNamespace

    import vtk

    window = vtk.vtkRenderWindow()
    window.SetOffScreenRendering(1)
    window.SetSize(400, 300)
    cameraNode = scene.AddNewNodeByClass("vtkMRMLCameraNode", "3D view camera")
    rendered = phantom_logic.run.renderer.cameras
    for software, expected in ((True, (96, 72)), (False, (400, 300))):
        rendered.clear()
        device = SimpleNamespace(report=SimpleNamespace(software=software))
        monkeypatch.setattr(phantom_logic.run.renderer, "gpu", device, raising=False)
        queue = []
        live = phantom_logic.createLiveView(cameraNode, window, queue.append)
        queue.pop()()
        assert [(camera.width, camera.height) for camera in rendered] == [expected]
        live.close()


# --- sharing a trained model as a web page ------------------------------------------------------------------------


@pytest.fixture
def page_writes(monkeypatch):
    """What write_page was asked to write: (run, path); each writes a small stand-in page (the page itself is
    checked in test_share.py and by the GPU test below)."""
    import NeuralRaycastLib.app.share as share

    written = []

    def write_page(run, out):
        written.append((run, pathlib.Path(out)))
        pathlib.Path(out).write_text("<!doctype html><title>page</title>")
        return pathlib.Path(out)

    monkeypatch.setattr(share, "write_page", write_page)
    return written


def test_share_refuses_a_bad_name_an_existing_page_and_a_folder_without_a_model_before_any_work(
        module, scene, phantom_logic, page_writes, tmp_path, monkeypatch):
    import json

    def no_device(*args, **kwargs):
        raise AssertionError("the GPU was opened")

    monkeypatch.setattr(module.NeuralRaycastLogic, "gpuContext", staticmethod(no_device))
    folder = phantom_logic.run.folder
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'page.txt'}: the page's file name must end in .html")):
        phantom_logic.sharePage(folder, tmp_path / "page.txt")
    existing = tmp_path / "existing.html"
    existing.write_text("the user's page")
    with pytest.raises(ValueError, match=re.escape(f"{existing} exists: choose another file name or confirm "
                                                   "replacing it")):
        phantom_logic.sharePage(folder, existing)
    assert existing.read_text() == "the user's page" and page_writes == []
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"Model folder '{re.escape(str(empty))}' holds no trained model"):
        phantom_logic.sharePage(empty, tmp_path / "page.html")
    gone = tmp_path / "study-gone"
    gone.mkdir()
    (gone / "run.json").write_text(json.dumps({"study": str(tmp_path / "deleted" / "manifest.json")}))
    with pytest.raises(ValueError, match="no longer on disk: load its study into the scene.*Load model"):
        phantom_logic.sharePage(gone, tmp_path / "page.html")
    assert page_writes == [] and not (tmp_path / "page.html").exists()

    # the loaded model (trained in the module: its study is the scene's) is the one shared, with no device opened
    assert phantom_logic.sharePage(folder, tmp_path / "page.html") == tmp_path / "page.html"
    assert page_writes == [(phantom_logic.run, tmp_path / "page.html")]
    assert phantom_logic.sharePage(folder, existing, overwrite=True) == existing  # a confirmed replacement


def test_the_share_button_needs_a_trained_model_and_no_run_going_and_writes_where_the_user_says(
        widget, phantom_run, page_writes, tmp_path, monkeypatch):
    import sys
    from types import SimpleNamespace

    import slicer

    widget._checkCanApply()
    assert not widget.ui.shareButton.enabled  # no trained model yet
    widget.logic.run = phantom_run
    widget._checkCanApply()
    assert widget.ui.shareButton.enabled
    widget._setRunning(True)
    assert not widget.ui.shareButton.enabled  # a run is going
    widget._setRunning(False)
    assert widget.ui.shareButton.enabled

    monkeypatch.setitem(sys.modules, "qt", SimpleNamespace(Qt=SimpleNamespace(WaitCursor=3)))
    monkeypatch.setattr(slicer.app, "setOverrideCursor", lambda cursor: None, raising=False)
    monkeypatch.setattr(slicer.app, "restoreOverrideCursor", lambda: None, raising=False)
    answers = [("", False), (str(tmp_path / "shared.html"), True)]
    monkeypatch.setattr(widget, "_askPagePath", lambda folder: answers.pop(0))
    widget.onShareButton()  # the save dialog cancelled: nothing written
    assert page_writes == []
    widget.onShareButton()
    assert page_writes == [(phantom_run, tmp_path / "shared.html")]
    assert f"Web page written: {tmp_path / 'shared.html'}" in widget.ui.resultsText.plainText

    page_writes.clear()
    (tmp_path / "kept.html").write_text("the user's page")
    monkeypatch.setattr(widget, "_askPagePath", lambda folder: (str(tmp_path / "kept.html"), False))
    with pytest.raises(ValueError, match="kept.html exists"):  # shown by tryWithErrorDisplay in Slicer
        widget.onShareButton()
    assert (tmp_path / "kept.html").read_text() == "the user's page" and page_writes == []


@pytest.mark.gpu
def test_share_writes_the_page_of_a_trained_run(module, scene, tmp_path, capsys):
    """The Logic writes the real page (the share command's) of a run trained as test_share.py trains it (the same
    kernels): self-contained, no request allowed, nothing of the study's paths; an existing page is kept."""
    from NeuralRaycastLib.app.cli import main

    assert main(["sample", str(tmp_path / "s"), "--case", "phantom", "--spacing", "4"]) == 0
    manifest = capsys.readouterr().out.strip()
    run = tmp_path / "run"
    assert main(["fit", manifest, "--preset", "quick", "--iterations", "12", "--views", "4", "--size", "32",
                 "--out", str(run)]) == 0
    logic = module.NeuralRaycastLogic()
    before = node_ids(scene)
    page = logic.sharePage(run, tmp_path / "shared" / "page.html")
    assert page == tmp_path / "shared" / "page.html"
    html = page.read_text()
    assert html.startswith("<!") and "default-src 'none'" in html and '"wgsl"' in html
    assert str(tmp_path) not in html
    with pytest.raises(ValueError, match=re.escape(f"{page} exists")):
        logic.sharePage(run, page)
    assert page.read_text() == html
    assert node_ids(scene) == before and logic.run is None  # the scene and the loaded model as they were


# --- platforms: refused before anything is installed ----------------------------------------------------------------


def test_an_unsupported_platform_is_refused_before_anything_is_installed(module, monkeypatch, tmp_path):
    import slicer

    from NeuralRaycastLib.gpu import platforms

    asked = []
    monkeypatch.setattr(slicer.util, "confirmOkCancelDisplay", lambda *args, **kwargs: asked.append(args) or True)
    monkeypatch.setattr(slicer.util, "pip_install", lambda *args, **kwargs: asked.append(args))
    monkeypatch.setattr(module.NeuralRaycastLogic, "writePipConstraints",
                        staticmethod(lambda folder: asked.append(folder) or str(tmp_path / "constraints.txt")))
    logic = module.NeuralRaycastLogic()
    monkeypatch.setattr(logic, "missingRequirements", lambda: ["slangpy==0.43.1"])
    for here, device, named in (
            (platforms.Platform("Windows", "ARM64", (3, 12)), "auto", "Windows arm64, CPython 3.12: slangpy 0.43.1 "
                                                                      "has no wheel for Windows on arm64"),
            (platforms.Platform("Darwin", "arm64", (3, 12), macos=(26, 0)), "auto", "macOS arm64, macOS 26.0, CPython "
                                                                                    "3.12: slangpy installs, and"),
            (platforms.Platform("Linux", "x86_64", (3, 12), libc=("glibc", (2, 28))), "vulkan",
             "slangpy's Linux wheels need glibc 2.34 or newer")):
        monkeypatch.setattr(platforms, "this_platform", lambda here=here: here)
        with pytest.raises(platforms.UnsupportedPlatformError) as raised:
            module.installDependencies(logic, device)
        assert named in str(raised.value) and "Windows x64, Linux x86-64 and Linux aarch64" in str(raised.value)
        assert asked == []  # no question, no constraints file, no install

    # a supported platform goes on to ask; so does a Mac where the device is set to metal or vulkan (the module's
    # setting, or NEURALRAYCAST_DEVICE behind auto), to try them
    monkeypatch.setattr(platforms, "this_platform",
                        lambda: platforms.Platform("Linux", "x86_64", (3, 12), libc=("glibc", (2, 36))))
    module.installDependencies(logic, "auto")
    assert len(asked) == 3
    monkeypatch.setattr(platforms, "this_platform",
                        lambda: platforms.Platform("Darwin", "arm64", (3, 12), macos=(26, 0)))
    module.installDependencies(logic, "vulkan")
    module.installDependencies(logic, "metal")
    monkeypatch.setenv("NEURALRAYCAST_DEVICE", "vulkan")
    module.installDependencies(logic, "auto")
    assert len(asked) == 12


def test_the_modules_help_says_what_each_platform_gets(module, monkeypatch):
    from types import SimpleNamespace

    import slicer

    from NeuralRaycastLib.gpu.platforms import platforms_summary

    parent = SimpleNamespace()
    monkeypatch.setattr(slicer.app, "connect", lambda *args: None, raising=False)
    module.NeuralRaycast(parent)
    assert platforms_summary() in parent.helpText
    assert "tries Metal, then Vulkan" in parent.helpText and "tensor-core" in parent.helpText
