"""The Slicer module headless: its .ui against its code, its own self-tests, the parameter node through a
saved scene, and bad input that must leave the scene as it was (see slicer_harness.py)."""

from __future__ import annotations

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
    parameters.runFolder = tmp_path / "run"
    with pytest.raises(ValueError):
        parameters.preset = "fastest"  # not a choice
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
    assert reloaded.shadows is True and reloaded.gpuMemory == "6G"
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
    from NeuralRaycastLib.train import run

    class Trained(Exception):
        pass

    def stop_at_the_field(*args, **kwargs):
        raise Trained

    monkeypatch.setattr(gpu, "open_device", lambda choice=None: SimpleNamespace(
        backend="vulkan", report=SimpleNamespace(software=True)))
    monkeypatch.setattr(run, "prepare_for_run", lambda study, settings, progress: "prepared")
    monkeypatch.setattr(run, "ensure_warm", lambda *args: None)
    monkeypatch.setattr(run, "reference_views_for_run", lambda *args: "views")
    monkeypatch.setattr(run.RunSettings, "field_layout", lambda self, gpu, prepared: "layout")
    monkeypatch.setattr(run, "check_run_fits", lambda budget, layout, prepared, config: None)
    monkeypatch.setattr(run, "NeuralField", stop_at_the_field)
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
