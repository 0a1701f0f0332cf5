"""Neural Raycast: fit a neural signed-distance + appearance field to a brain MRI study and render it.

The heavy lifting lives in ``NeuralRaycastLib`` (no Slicer imports there); this file holds the Slicer
module, its parameter node, widget, logic and self-test. Nothing heavy (slangpy, scikit-image) is
imported here at load time: dependencies are checked and installed when the user presses Apply.
"""

import importlib.metadata
import logging
import os
import pathlib
import re
import shutil
import sys
import time
from typing import Annotated

import numpy as np
import slicer
import vtk
from slicer import vtkMRMLScalarVolumeNode, vtkMRMLSegmentationNode, vtkMRMLVectorVolumeNode
from slicer.i18n import tr as _
from slicer.i18n import translate
from slicer.parameterNodeWrapper import Choice, WithinRange, parameterNodeWrapper
from slicer.ScriptedLoadableModule import (
    ScriptedLoadableModule,
    ScriptedLoadableModuleLogic,
    ScriptedLoadableModuleTest,
    ScriptedLoadableModuleWidget,
)
from slicer.util import VTKObservationMixin

MODULE_NAME = "NeuralRaycast"
README_URL = "https://github.com/SlicerNeuralRaycast/SlicerNeuralRaycast#readme"
#: The library's presets (NeuralRaycastLib.train.presets) and devices (gpu.device.CHOICES), spelled out here so
#: that loading this file imports nothing but Slicer; a test checks they match the library's.
PRESETS = ("auto", "quick", "standard", "high")
DEVICES = ("auto", "cuda", "vulkan", "metal")
#: What a run trains: the neural field, or ray-traced Gaussians (``fit --representation``).
REPRESENTATIONS = ("field", "gaussians")
#: What to lower when a run does not fit the GPU's memory, in the module's words.
MEMORY_ADVICE = ("raise the GPU memory setting if the GPU has more free, or choose the quick preset or a coarser "
                 "study")
#: Packages Slicer ships that installing the requirements must leave at their installed versions.
KEPT_PACKAGES = ("numpy", "scipy")
#: How long a training asked to stop may take to save the state reached before it is ended.
STOP_GRACE_MS = 60_000
#: The application setting (Slicer's settings file) that keeps a training process ready ahead of the next Train
#: ("true" by default; "false" starts one only when Train is pressed).
KEEP_READY_SETTING = "NeuralRaycast/KeepTrainingProcessReady"
#: Extra channels beside the reference volume (the parameter node wrapper has no GUI for node lists).
ADDITIONAL_VOLUME_PARAMETERS = ("inputVolume2", "inputVolume3", "inputVolume4")


def _ensureLibrary() -> None:
    """Make ``NeuralRaycastLib`` importable. An installed extension has it beside this file (on Slicer's path);
    a module run from the source tree finds it one folder up, added to the path here, when first needed."""
    try:
        import NeuralRaycastLib  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name != "NeuralRaycastLib":
            raise
        sourceRoot = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if not os.path.isfile(os.path.join(sourceRoot, "NeuralRaycastLib", "__init__.py")):
            raise
        sys.path.insert(0, sourceRoot)


def _libraryVersion() -> str:
    _ensureLibrary()
    import NeuralRaycastLib

    return NeuralRaycastLib.__version__


def _platformsText() -> str:
    """What each platform gets, from the library's table (the command line's ``info`` reads the same)."""
    _ensureLibrary()
    from NeuralRaycastLib.gpu.platforms import platforms_summary

    return platforms_summary()


class GridMismatchError(ValueError):
    """A volume is not on the reference volume's grid (it can be resampled onto it after asking)."""


#: Attribute that marks the model nodes this module made, valued with the structure name.
MODEL_ATTRIBUTE = "NeuralRaycast.Structure"
#: Attribute that marks the segmentation and table nodes of the learned surfaces this module made, valued
#: with what the node holds (see RESULT_NODES).
RESULT_ATTRIBUTE = "NeuralRaycast.Result"
#: The longest side of a live view picture on a software device (lavapipe), where one of a whole view's size takes
#: seconds: a coarse picture stretched over the view keeps it following the camera.
LIVE_SIDE_SOFTWARE = 96
#: What each result node holds: attribute value -> (node class, name).
RESULT_NODES = {
    "segmentation": ("vtkMRMLSegmentationNode", "Learned surfaces (neural)"),
    "structures": ("vtkMRMLTableNode", "Learned surfaces: per structure"),
    "pieces": ("vtkMRMLTableNode", "Learned surfaces: pieces not held as drawn"),
}


#
# NeuralRaycast
#


class NeuralRaycast(ScriptedLoadableModule):
    """Module description shown in Slicer's module panel and Help & Acknowledgement section."""

    def __init__(self, parent):
        ScriptedLoadableModule.__init__(self, parent)
        self.parent.title = _("Neural Raycast")
        self.parent.categories = [translate("qSlicerAbstractCoreModule", "Rendering")]
        self.parent.dependencies = []
        self.parent.contributors = ["SlicerNeuralRaycast authors"]
        self.parent.helpText = _(
            """
Fits a neural signed-distance and appearance field to a brain MRI study (one or more co-registered
channels plus a tumour segmentation) and renders it with a differentiable Slang raycaster.
Select the reference volume, any further channels on the same grid and the segmentation, choose a
preset and press Train. Missing Python packages are installed on first use, after asking; on a platform
where slangpy has no wheel, or no device is known to open, the module says so before installing anything.
After a training, Share as web page writes one HTML file that renders the model live in a browser (WebGPU).
<p>{platforms}</p>
See the <a href="{url}">project documentation</a> for details. Version {version}.
"""
        ).format(url=README_URL, version=_libraryVersion(), platforms=_platformsText())
        # Sample data is registered once the Sample Data module exists.
        slicer.app.connect("startupCompleted()", registerSampleData)
        self.parent.acknowledgementText = _(
            """
Developed by the SlicerNeuralRaycast authors. Rendering and training use
<a href="https://github.com/shader-slang/slangpy">slangpy</a> and the Slang shading language;
image processing uses NumPy, SciPy, scikit-image and nibabel.
"""
        )


#
# Sample data
#

SAMPLE_NAME = "NeuralRaycastBrainTumour"


def registerSampleData():
    """The built-in sample case in the Sample Data module: real anatomy (ICBM 2009a) with a synthetic lesion.

    It is generated on first use (the template is fetched once, pinned and checksummed, then cached), so
    there is nothing to download here: the button calls ``NeuralRaycastLogic.loadSampleStudy``.
    """
    import SampleData

    iconsPath = os.path.join(os.path.dirname(os.path.abspath(__file__)), "Resources", "Icons")
    if hasattr(SampleData.SampleDataLogic, "registerCustomSampleDataCategory"):  # Slicer 5.12 and later
        SampleData.SampleDataLogic.registerCustomSampleDataCategory(MODULE_NAME, title=_("Neural Raycast"))
    SampleData.SampleDataLogic.registerCustomSampleDataSource(
        category=MODULE_NAME,
        sampleName=SAMPLE_NAME,
        uris=[],
        fileNames=[],
        thumbnailFileName=os.path.join(iconsPath, "NeuralRaycastSample.png"),
        customDownloader=lambda source: _loadSampleWithErrorDisplay(),
    )


def _loadSampleWithErrorDisplay():
    with slicer.util.tryWithErrorDisplay(_("Failed to load the Neural Raycast sample."), waitCursor=True):
        logic = NeuralRaycastLogic()
        installDependencies(logic)
        volumes, segmentation = logic.loadSampleStudy()
        slicer.util.setSliceViewerLayers(background=volumes[0], fit=True)
        segmentation.CreateClosedSurfaceRepresentation()


def installDependencies(logic: "NeuralRaycastLogic", device: str = "auto") -> None:
    """Install the missing packages of ``Resources/requirements.txt`` after asking (the widget's part: the
    Logic opens no dialogs), keeping Slicer's numpy and scipy at their installed versions. A platform where
    slangpy has no wheel, or no ``device`` is known to open, is refused first (UnsupportedPlatformError naming
    it and what is supported), before anything is installed.

    Uses ``slicer.packaging.pip_ensure`` (Slicer 5.12 and later), else ``slicer.util.pip_install`` after a
    confirmation. Raises RuntimeError if the user declines. Called when the packages are needed (Apply).
    """
    import tempfile

    logic.checkPlatform(device)
    constraints = logic.writePipConstraints(os.path.join(tempfile.gettempdir(), MODULE_NAME))
    try:
        import slicer.packaging as packaging
    except ImportError:
        packaging = None
    if packaging is not None and hasattr(packaging, "pip_ensure"):
        packaging.pip_ensure(packaging.load_requirements(logic.requirementsPath()), constraints=constraints,
                             requester=MODULE_NAME)
        return
    missing = logic.missingRequirements()
    if not missing:
        return
    if not slicer.util.confirmOkCancelDisplay(
        _(
            "Neural Raycast needs additional Python packages. Installation needs a network connection and "
            "may take several minutes. Click OK to proceed."
        ),
        _("Install Python packages"),
        detailedText="\n".join(missing),
    ):
        raise RuntimeError(_("Installation of the required Python packages was declined."))
    slicer.util.pip_install([*missing, "-c", constraints])


#
# NeuralRaycastParameterNode
#


@parameterNodeWrapper
class NeuralRaycastParameterNode:
    """
    The parameters needed by the module.

    inputVolume - the reference channel; its grid is the study's grid.
    inputVolume2..4 - further channels, on the same grid as inputVolume.
    inputSegmentation - the tumour segmentation; each segment becomes a structure.
    probabilityVolume - optional tumour probability map in [0, 1]; derived from the labels if absent.
    brainMaskVolume - optional brain mask (non-zero inside, e.g. a label map from skull stripping); where
        absent the brain is found by thresholding the reference channel.
    preset - training quality preset; auto is quick on a software device and standard on a GPU.
    device - slangpy device: auto, cuda, vulkan or metal.
    gpuMemory - GPU memory the work may take (e.g. 6G); empty: the GPU's free memory less a margin.
    seed - random seed for reproducible training.
    iterations - training iterations; 0 uses the preset's number.
    shadows - train on views lit with key-light shadows (the field is shaded through its own meshes).
    pretrainedAppearance - fit the surfaces only and take the appearance from the shipped pretrained weights
        (no appearance training; not with shadows).
    representation - field (signed distances and appearance network) or gaussians (ray-traced Gaussians; not
        with shadows or the pretrained appearance; no web page).
    runFolder - where the trained model is saved (empty: a new folder under ~/NeuralRaycast/runs);
        the scene keeps it, so the model can be reloaded after the scene is.
    meshSmoothing - smoothing iterations of the learned surfaces' models.
    outputRender - the RGB volume that receives renders of the 3D view's camera.
    labelmapOversampling - the learned segmentation's label maps are on the study's grid split this many times
        along each axis (1: the study's grid).
    """

    inputVolume: vtkMRMLScalarVolumeNode
    inputVolume2: vtkMRMLScalarVolumeNode
    inputVolume3: vtkMRMLScalarVolumeNode
    inputVolume4: vtkMRMLScalarVolumeNode
    inputSegmentation: vtkMRMLSegmentationNode
    probabilityVolume: vtkMRMLScalarVolumeNode
    brainMaskVolume: vtkMRMLScalarVolumeNode
    preset: Annotated[str, Choice(list(PRESETS))] = "auto"
    device: Annotated[str, Choice(list(DEVICES))] = "auto"
    gpuMemory: str = ""
    seed: Annotated[int, WithinRange(0, 2**31 - 1)] = 0
    iterations: Annotated[int, WithinRange(0, 1_000_000)] = 0
    shadows: bool = False
    pretrainedAppearance: bool = False
    representation: Annotated[str, Choice(list(REPRESENTATIONS))] = "field"
    runFolder: pathlib.Path
    meshSmoothing: Annotated[int, WithinRange(0, 100)] = 10
    outputRender: vtkMRMLVectorVolumeNode
    labelmapOversampling: Annotated[int, WithinRange(1, 4)] = 2

    def volumeNodes(self) -> list:
        """The selected channel volumes, reference first, without empty slots."""
        nodes = [self.inputVolume] + [getattr(self, name) for name in ADDITIONAL_VOLUME_PARAMETERS]
        return [node for node in nodes if node is not None]


#
# NeuralRaycastWidget
#


class NeuralRaycastWidget(ScriptedLoadableModuleWidget, VTKObservationMixin):
    """Uses ScriptedLoadableModuleWidget base class, available at:
    https://github.com/Slicer/Slicer/blob/main/Base/Python/slicer/ScriptedLoadableModule.py
    """

    def __init__(self, parent=None) -> None:
        """Called when the user opens the module the first time and the widget is initialized."""
        ScriptedLoadableModuleWidget.__init__(self, parent)
        VTKObservationMixin.__init__(self)  # needed for parameter node observation
        self.logic = None
        self._parameterNode = None
        self._parameterNodeGuiTag = None
        self._running = False
        #: The training in a worker process (TrainingJob) while one runs, and what it was started with.
        self._job = None
        self._jobInputs = None
        self._pollTimer = None
        self._killTimer = None
        self._liveView = None
        self._shareToolTip = None

    def setup(self) -> None:
        """Called when the user opens the module the first time and the widget is initialized."""
        ScriptedLoadableModuleWidget.setup(self)

        uiWidget = slicer.util.loadUI(self.resourcePath("UI/NeuralRaycast.ui"))
        self.layout.addWidget(uiWidget)
        self.ui = slicer.util.childWidgetVariables(uiWidget)
        uiWidget.setMRMLScene(slicer.mrmlScene)

        self.logic = NeuralRaycastLogic()

        self.addObserver(slicer.mrmlScene, slicer.mrmlScene.StartCloseEvent, self.onSceneStartClose)
        self.addObserver(slicer.mrmlScene, slicer.mrmlScene.EndCloseEvent, self.onSceneEndClose)

        self.ui.applyButton.connect("clicked(bool)", self.onApplyButton)
        self.ui.loadButton.connect("clicked(bool)", self.onLoadButton)
        self.ui.renderButton.connect("clicked(bool)", self.onRenderButton)
        self.ui.modelsButton.connect("clicked(bool)", self.onModelsButton)
        self.ui.clearCacheButton.connect("clicked(bool)", self.onClearCacheButton)
        self.ui.segmentationButton.connect("clicked(bool)", self.onSegmentationButton)
        self.ui.liveViewButton.connect("toggled(bool)", self.onLiveViewToggled)
        self.ui.shareButton.connect("clicked(bool)", self.onShareButton)
        self._resetProgress()

        import qt

        # The worker's progress is read on threads (NeuralRaycastLib.app.worker); the timer brings it to the GUI.
        self._pollTimer = qt.QTimer()
        self._pollTimer.setInterval(200)
        self._pollTimer.connect("timeout()", self._pollTraining)
        # A worker asked to stop that does not within this time is ended with the processes it started.
        self._killTimer = qt.QTimer()
        self._killTimer.setSingleShot(True)
        self._killTimer.setInterval(STOP_GRACE_MS)
        self._killTimer.connect("timeout()", self._killTraining)

        self.logic.keepTrainingProcessReady = str(qt.QSettings().value(KEEP_READY_SETTING, "true")).lower() in (
            "true", "1")
        self.initializeParameterNode()

    def cleanup(self) -> None:
        """Called when the application closes and the module widget is destroyed."""
        if self._job is not None:  # no training left running without Slicer
            self._job.kill()
            self._job = None
        if self.logic is not None:
            self.logic.stopStandby()
        for timer in (self._pollTimer, self._killTimer):
            if timer is not None:
                timer.stop()
        self._stopLiveView()
        self.removeObservers()

    def enter(self) -> None:
        """Called each time the user opens this module."""
        self.initializeParameterNode()
        self._keepProcessReady()

    def _keepProcessReady(self) -> None:
        """A training process made ready ahead of the next Train (``NeuralRaycastLogic.startStandby``), where the
        setting allows it and no run goes; a failure to start one is logged, not shown: Train starts a process
        then, as without."""
        if self.logic is None or self._job is not None or self._parameterNode is None:
            return
        if not self.logic.keepTrainingProcessReady:
            return
        try:
            self.logic.startStandby(self._parameterNode.device, self._parameterNode.preset)
        except Exception as error:  # noqa: BLE001 - only a head start is lost
            logging.warning(f"No training process was made ready ahead: {error}")

    def exit(self) -> None:
        """Called each time the user opens a different module."""
        if self._parameterNode:
            self._parameterNode.disconnectGui(self._parameterNodeGuiTag)
            self._parameterNodeGuiTag = None
            self.removeObserver(self._parameterNode, vtk.vtkCommand.ModifiedEvent, self._checkCanApply)

    def onSceneStartClose(self, caller, event) -> None:
        """Called just before the scene is closed. A training keeps running (its model is saved); its end
        finds the inputs gone and says where the model is. The live view stops."""
        self.ui.liveViewButton.checked = False
        self._stopLiveView()
        self.setParameterNode(None)

    def onSceneEndClose(self, caller, event) -> None:
        """Called just after the scene is closed."""
        if self.parent.isEntered:
            self.initializeParameterNode()

    def initializeParameterNode(self) -> None:
        """Ensure parameter node exists and observed; pick sensible first inputs."""
        self.setParameterNode(self.logic.getParameterNode())

        if not self._parameterNode.inputVolume:
            volumes = [
                node
                for node in slicer.util.getNodesByClass("vtkMRMLScalarVolumeNode")
                if node.GetClassName() == "vtkMRMLScalarVolumeNode"
            ]
            if volumes:
                self._parameterNode.inputVolume = volumes[0]
        if not self._parameterNode.inputSegmentation:
            segmentation = slicer.mrmlScene.GetFirstNodeByClass("vtkMRMLSegmentationNode")
            if segmentation:
                self._parameterNode.inputSegmentation = segmentation

    def setParameterNode(self, inputParameterNode) -> None:
        """Set and observe parameter node; changes to the parameter node update the GUI and vice versa."""
        if self._parameterNode:
            self._parameterNode.disconnectGui(self._parameterNodeGuiTag)
            self.removeObserver(self._parameterNode, vtk.vtkCommand.ModifiedEvent, self._checkCanApply)
        self._parameterNode = inputParameterNode
        if self._parameterNode:
            # Binds every widget of the .ui file that has a "SlicerParameterName" property.
            self._parameterNodeGuiTag = self._parameterNode.connectGui(self.ui)
            self.addObserver(self._parameterNode, vtk.vtkCommand.ModifiedEvent, self._checkCanApply)
            self._checkCanApply()

    def _checkCanApply(self, caller=None, event=None) -> None:
        if self._running:
            return
        ready = bool(self._parameterNode and self._parameterNode.inputVolume and self._parameterNode.inputSegmentation)
        self.ui.applyButton.text = _("Train")
        self.ui.applyButton.enabled = ready
        self.ui.applyButton.toolTip = (
            _("Train a neural field on the selected study; then add its models and a render to the scene")
            if ready
            else _("Select the reference volume and the segmentation")
        )
        self.ui.loadButton.enabled = ready
        trained = self.logic is not None and self.logic.run is not None
        self.ui.renderButton.enabled = trained
        self.ui.modelsButton.enabled = trained
        self.ui.segmentationButton.enabled = trained
        self._enableViewButtons(trained)

    def _enableViewButtons(self, enabled: bool) -> None:
        """The live view and the web page, for a trained model; the web page needs a field: off, saying why, for a
        model of Gaussians."""
        self.ui.liveViewButton.enabled = enabled
        button = self.ui.shareButton
        if self._shareToolTip is None:  # the .ui's own, shown again for a field
            self._shareToolTip = button.toolTip
        gaussians = enabled and self.logic.isGaussianRun(self.logic.run)
        button.enabled = enabled and not gaussians
        button.toolTip = _("The model is of Gaussians: the web page is for field models only so far") if gaussians \
            else self._shareToolTip

    def _resetProgress(self) -> None:
        self.ui.progressBar.setRange(0, 100)
        self.ui.progressBar.value = 0
        self.ui.progressBar.setFormat("%p%")

    def _showProgress(self, message: str, fraction: float) -> None:
        self.ui.progressBar.value = int(round(100 * min(max(fraction, 0.0), 1.0)))
        self.ui.progressBar.setFormat(f"{message} %p%")
        slicer.util.showStatusMessage(message)

    def _onProgress(self, message: str, fraction: float) -> None:
        """Progress of work in Slicer's own process (models, renders), shown before it goes on."""
        self._showProgress(message, fraction)
        slicer.app.processEvents()

    def _inputWidgets(self) -> list:
        """Every widget bound to a parameter, and the buttons that read or delete what a run uses."""
        bound = [widget for widget in vars(self.ui).values()
                 if hasattr(widget, "property") and widget.property("SlicerParameterName")]
        return bound + [self.ui.loadButton, self.ui.renderButton, self.ui.modelsButton, self.ui.clearCacheButton]

    def _setRunning(self, running: bool) -> None:
        """While a run goes, every input and the cache button are disabled; Train reads Cancel."""
        self._running = running
        for widget in self._inputWidgets():
            widget.enabled = not running
        self.ui.segmentationButton.enabled = not running and self.logic.run is not None
        if running:  # the live view shows the last model; a new one replaces it when the run is done
            self.ui.liveViewButton.checked = False
        self._enableViewButtons(not running and self.logic.run is not None)
        if running:
            self.ui.applyButton.text = _("Cancel")
            self.ui.applyButton.toolTip = _("Stop training; the state reached so far is kept and saved")
            self.ui.applyButton.enabled = True
        else:
            self._checkCanApply()

    def onApplyButton(self) -> None:
        """Start training in a worker process (the button then reads Cancel); its results are added when it ends."""
        if self._job is not None:
            self._cancelTraining()
            return
        parameters = self._parameterNode
        self._resetProgress()
        self.ui.resultsText.setPlainText("")
        with slicer.util.tryWithErrorDisplay(_("Training could not start."), waitCursor=True):
            installDependencies(self.logic, parameters.device)
            resample = self._askToResample()
            if resample is None:
                return
            self._job = self.logic.startTraining(
                parameters.volumeNodes(),
                parameters.inputSegmentation,
                parameters.probabilityVolume,
                brainMaskNode=parameters.brainMaskVolume,
                preset=parameters.preset,
                device=parameters.device,
                gpuMemory=parameters.gpuMemory,
                seed=parameters.seed,
                iterations=parameters.iterations,
                shadows=parameters.shadows,
                runFolder=parameters.runFolder,
                resampleToReference=resample,
                pretrainedAppearance=parameters.pretrainedAppearance,
                representation=parameters.representation,
            )
            self._jobInputs = {
                "volumes": [node.GetID() for node in parameters.volumeNodes()],
                "segmentation": parameters.inputSegmentation.GetID(),
                "probability": parameters.probabilityVolume.GetID() if parameters.probabilityVolume else None,
                "brainMask": parameters.brainMaskVolume.GetID() if parameters.brainMaskVolume else None,
                "device": parameters.device, "gpuMemory": parameters.gpuMemory, "resample": resample,
            }
            self._setRunning(True)
            self._showProgress(_("starting the training process"), 0.0)
            self._pollTimer.start()

    def _cancelTraining(self) -> None:
        """Ask the worker to stop after its step (the state reached is saved); end it if it does not in time."""
        self._job.requestStop()
        self.ui.applyButton.enabled = False
        self._showProgress(_("cancelling after this step"), self.ui.progressBar.value / 100.0)
        self._killTimer.start()

    def _killTraining(self) -> None:
        if self._job is not None and self._job.running:
            logging.warning("The training process did not stop when asked; it is ended")
            self._job.kill()
            self._pollTraining()

    def _pollTraining(self) -> None:
        """Timer: show the worker's progress; once it has ended, its results."""
        job = self._job
        if job is None:
            return
        progress, outcome = job.poll()
        for item in progress:
            self._showProgress(self.progressText(item), item.fraction)
        if outcome is not None and self._job is job:
            self._pollTimer.stop()
            self._killTimer.stop()
            job, inputs = self._job, self._jobInputs
            self._job, self._jobInputs = None, None
            self._setRunning(False)
            self._trainingEnded(job, outcome, inputs)
            self._keepProcessReady()  # the next Train starts from a ready process again

    @staticmethod
    def progressText(item) -> str:
        """A worker's progress report in the bar: the stage, then loss and held-out PSNR where reported."""
        parts = [item.stage or item.message]
        if item.loss is not None:
            parts.append(f"loss {item.loss:.4g}")
        if item.heldout_psnr is not None:
            parts.append(f"PSNR {item.heldout_psnr:.1f} dB")
        return ", ".join(parts)

    def _trainingEnded(self, job, outcome, inputs) -> None:
        """One message for a run that failed or whose worker crashed (the scene is then as it was); the results
        of one that trained, if the scene still holds its inputs (it may have been closed meanwhile)."""
        if not outcome.trained:
            self._resetProgress()
            if outcome.state == "cancelled":
                self.ui.resultsText.setPlainText(_("Cancelled: {message}").format(message=outcome.message))
            else:
                slicer.util.errorDisplay(_("Training failed: {message}").format(message=outcome.message),
                                         windowTitle=_("Neural Raycast"))
            return
        scene = slicer.mrmlScene
        volumes = [scene.GetNodeByID(nodeId) for nodeId in inputs["volumes"]]
        segmentation = scene.GetNodeByID(inputs["segmentation"])
        if self._parameterNode is None or segmentation is None or any(node is None for node in volumes):
            self.ui.resultsText.setPlainText(
                _("The model is saved in {folder}, but its study left the scene while it trained: load the study "
                  "again, select that folder and press Load model.").format(folder=job.runFolder))
            return
        self._parameterNode.runFolder = pathlib.Path(job.runFolder)
        with slicer.util.tryWithErrorDisplay(_("The trained model could not be shown."), waitCursor=True):
            probability = scene.GetNodeByID(inputs["probability"]) if inputs["probability"] else None
            brainMask = scene.GetNodeByID(inputs["brainMask"]) if inputs["brainMask"] else None
            run = self.logic.loadRun(job.runFolder, volumes, segmentation, probability, inputs["device"],
                                     inputs["resample"], brainMaskNode=brainMask, gpuMemory=inputs["gpuMemory"])
            cancelled = _(" (cancelled; the state reached is kept)") if outcome.state == "cancelled" else ""
            self.ui.resultsText.setPlainText(self.logic.trainingSummary(run) + cancelled)
            self._showResults()
        self._checkCanApply()

    def _askToResample(self) -> bool | None:
        """False when every input is on the reference grid; True if the user agrees to resample the others;
        None if not."""
        parameters = self._parameterNode
        offGrid = self.logic.volumesOffGrid(parameters.volumeNodes(), parameters.probabilityVolume,
                                            parameters.brainMaskVolume)
        if not offGrid:
            return False
        question = _("These volumes are not on the grid of the reference volume '{reference}':\n{names}\n\n"
                     "Resample them onto it (trilinear)? They must already be registered to it.").format(
            reference=parameters.inputVolume.GetName(), names="\n".join(offGrid))
        return True if slicer.util.confirmYesNoDisplay(question, windowTitle=_("Resample volumes")) else None

    def onLoadButton(self) -> None:
        parameters = self._parameterNode
        with slicer.util.tryWithErrorDisplay(_("Failed to load the model."), waitCursor=True):
            installDependencies(self.logic, parameters.device)
            resample = self._askToResample()
            if resample is None:
                return
            run = self.logic.loadRun(parameters.runFolder, parameters.volumeNodes(), parameters.inputSegmentation,
                                     parameters.probabilityVolume, parameters.device, resample,
                                     brainMaskNode=parameters.brainMaskVolume, gpuMemory=parameters.gpuMemory)
            self.ui.resultsText.setPlainText(self.logic.trainingSummary(run))
        self._checkCanApply()

    def onRenderButton(self) -> None:
        with slicer.util.tryWithErrorDisplay(_("Failed to render."), waitCursor=True):
            self._renderThreeDView()

    def onModelsButton(self) -> None:
        with slicer.util.tryWithErrorDisplay(_("Failed to create the models."), waitCursor=True):
            self.logic.createModels(self._parameterNode.meshSmoothing)

    def onSegmentationButton(self) -> None:
        with slicer.util.tryWithErrorDisplay(_("Failed to create the segmentation and tables."), waitCursor=True):
            self._createSegmentationAndTables()

    def _createSegmentationAndTables(self) -> None:
        """The learned surfaces as a segmentation and the per-structure tables; the table is shown beside the
        views."""
        parameters = self._parameterNode
        self.logic.createSegmentation(parameters.labelmapOversampling, parameters.meshSmoothing,
                                      parameters.inputVolume)
        structures, _pieces = self.logic.createResultsTables()
        slicer.app.layoutManager().setLayout(slicer.vtkMRMLLayoutNode.SlicerLayoutFourUpTableView)
        slicer.app.applicationLogic().GetSelectionNode().SetActiveTableID(structures.GetID())
        slicer.app.applicationLogic().PropagateTableSelection()

    def onLiveViewToggled(self, checked: bool) -> None:
        """Live view on: the trained model over the first 3D view, following its camera; off: the view as it was."""
        self._stopLiveView()
        if not checked:
            return
        import qt

        live = None
        with slicer.util.tryWithErrorDisplay(_("Failed to start the live view."), waitCursor=True):
            threeDView = slicer.app.layoutManager().threeDWidget(0).threeDView()
            cameraNode = slicer.modules.cameras.logic().GetViewActiveCameraNode(threeDView.mrmlViewNode())
            live = self.logic.createLiveView(cameraNode, threeDView.renderWindow(),
                                             lambda callback: qt.QTimer.singleShot(0, callback),
                                             threeDView.scheduleRender, self._onLiveViewError)
        if live is None or live.error is not None:  # refused at once (said by _onLiveViewError) or failed
            if live is not None:
                live.close()
            self.ui.liveViewButton.checked = False
            return
        self._liveView = live

    def _onLiveViewError(self, error: Exception) -> None:
        self.ui.liveViewButton.checked = False  # stops the live view
        slicer.util.errorDisplay(_("The live view stopped: {error}").format(error=error))

    def _stopLiveView(self) -> None:
        if self._liveView is not None:
            live, self._liveView = self._liveView, None
            live.close()

    def onShareButton(self) -> None:
        """Write the trained model as a web page, to a file the user names; the page's path in the results."""
        run = self.logic.run
        if run is None or self._running or self.logic.isGaussianRun(run):  # the button is off for these
            return
        path, confirmed = self._askPagePath(str(run.folder))
        if not path:
            return
        with slicer.util.tryWithErrorDisplay(_("Failed to write the web page."), waitCursor=True):
            parameters = self._parameterNode  # None once the scene closed: the loaded model needs no device
            page = self.logic.sharePage(run.folder, path, overwrite=confirmed,
                                        device=parameters.device if parameters else "auto",
                                        gpuMemory=parameters.gpuMemory if parameters else "")
            message = _("Web page written: {path} ({megabytes} MB); open it in a browser with WebGPU").format(
                path=page, megabytes=f"{page.stat().st_size / 1e6:.1f}")
            self.ui.resultsText.setPlainText("\n".join(filter(None, [self.ui.resultsText.plainText, message])))
            slicer.util.showStatusMessage(message)

    @staticmethod
    def _askPagePath(runFolder: str) -> tuple[str, bool]:
        """The page's file name from a save dialog (empty if cancelled), ``.html`` added where missing, and
        whether the dialog confirmed replacing that very file."""
        import qt

        folder = pathlib.Path(runFolder)
        chosen = qt.QFileDialog.getSaveFileName(slicer.util.mainWindow(), _("Share as web page"),
                                                str(folder.parent / f"{folder.name}.html"),
                                                _("Web page (*.html)"))
        if not chosen:
            return "", False
        path = chosen if chosen.lower().endswith((".html", ".htm")) else f"{chosen}.html"
        return path, path == chosen

    def onClearCacheButton(self) -> None:
        with slicer.util.tryWithErrorDisplay(_("Failed to clear the cached data."), waitCursor=True):
            installDependencies(self.logic)
            freed = self.logic.clearCachedData()
            message = _("Cached data cleared: {megabytes} MB freed.").format(megabytes=f"{freed / 1e6:,.0f}")
            slicer.util.infoDisplay(message, windowTitle=_("Neural Raycast"))

    def _renderThreeDView(self) -> None:
        """Render the trained field from the first 3D view's camera and show it in the red slice view."""
        threeDView = slicer.app.layoutManager().threeDWidget(0).threeDView()
        cameraNode = slicer.modules.cameras.logic().GetViewActiveCameraNode(threeDView.mrmlViewNode())
        camera = self.logic.cameraFromNode(cameraNode, (threeDView.width, threeDView.height))
        node = self.logic.renderCamera(camera, self._parameterNode.outputRender)
        self._parameterNode.outputRender = node
        slicer.util.setSliceViewerLayers(background=node, fit=True)

    def _showResults(self) -> None:
        self._onProgress(_("creating models of the learned surfaces"), 1.0)
        self.logic.createModels(self._parameterNode.meshSmoothing)
        self._onProgress(_("creating the segmentation and tables of the learned surfaces"), 1.0)
        self._createSegmentationAndTables()
        self._onProgress(_("rendering the 3D view"), 1.0)
        self._renderThreeDView()
        self._onProgress(_("done"), 1.0)


#
# NeuralRaycastLogic
#


class NeuralRaycastLogic(ScriptedLoadableModuleLogic):
    """Computations of the module; usable from Python without the widget. Errors raise exceptions.

    Uses ScriptedLoadableModuleLogic base class, available at:
    https://github.com/Slicer/Slicer/blob/main/Base/Python/slicer/ScriptedLoadableModule.py
    """

    def __init__(self) -> None:
        """Called when the logic class is instantiated. Can be used for initializing member variables."""
        ScriptedLoadableModuleLogic.__init__(self)
        _ensureLibrary()
        #: The trained or loaded field (``NeuralRaycastLib.train.run_folder.TrainedRun``); None until train/loadRun.
        self.run = None
        #: Structure name -> (segment name, segment colour) of the last segmentation read.
        self.structureSegments: dict[str, tuple[str, tuple[float, float, float]]] = {}
        #: Whether the module keeps a training process ready ahead of the next Train (:meth:`startStandby`; the
        #: application setting ``NeuralRaycast/KeepTrainingProcessReady``).
        self.keepTrainingProcessReady = True
        #: That process (``NeuralRaycastLib.app.worker.WorkerProcess`` of ``neuralraycast standby``) and the device
        #: it was started for; None while none runs.
        self.standby = None
        self.standbyDevice: str | None = None

    def getParameterNode(self):
        return NeuralRaycastParameterNode(super().getParameterNode())

    @staticmethod
    def clearCachedData() -> int:
        """Delete the cached studies, prepared boundary maps and reference views (made again when needed;
        compiled kernels and downloads are kept); the bytes freed."""
        from NeuralRaycastLib.paths import DATA_CACHE_FOLDERS, clear_cache

        return clear_cache(list(DATA_CACHE_FOLDERS))

    # -- dependencies ---------------------------------------------------------------------------------

    @staticmethod
    def checkPlatform(device: str = "auto") -> str:
        """What this platform gets (a line for the log); raises UnsupportedPlatformError naming the platform and
        what is supported where slangpy has no wheel or no ``device`` is known to open. Needs nothing installed:
        the widget calls it before offering to install the packages."""
        from NeuralRaycastLib.gpu.device import requested_backend
        from NeuralRaycastLib.gpu.platforms import check_platform

        return check_platform(requested_backend(device)).describe()  # auto: NEURALRAYCAST_DEVICE where set

    @staticmethod
    def requirementsPath() -> str:
        return os.path.join(os.path.dirname(os.path.abspath(__file__)), "Resources", "requirements.txt")

    @staticmethod
    def _readRequirements(path: str) -> list[str]:
        with open(path, encoding="utf-8") as file:
            lines = (line.split("#", 1)[0].strip() for line in file)
            return [line for line in lines if line]

    @staticmethod
    def _isSatisfied(requirement: str) -> bool:
        """Installed, and at the pinned version if the line pins one (``name==x.y``); other specifiers
        only need the package to be present."""
        match = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._\-]*)\s*(?:==\s*([^\s;,]+))?", requirement)
        if not match:
            return False
        try:
            installed = importlib.metadata.version(match.group(1))
        except importlib.metadata.PackageNotFoundError:
            return False
        return match.group(2) is None or installed == match.group(2)

    def missingRequirements(self, requirementsPath: str | None = None) -> list[str]:
        """The lines of ``Resources/requirements.txt`` that are not installed (at their pinned version)."""
        path = requirementsPath or self.requirementsPath()
        return [requirement for requirement in self._readRequirements(path) if not self._isSatisfied(requirement)]

    @staticmethod
    def writePipConstraints(folder: str) -> str:
        """A pip constraints file that holds Slicer's own numpy and scipy at their installed versions, so that
        installing the requirements never replaces them (Slicer and its other modules are built against them);
        its path."""
        lines = []
        for name in KEPT_PACKAGES:
            try:
                lines.append(f"{name}=={importlib.metadata.version(name)}")
            except importlib.metadata.PackageNotFoundError:
                continue
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "NeuralRaycast-constraints.txt")
        with open(path, "w", encoding="utf-8") as file:
            file.write("".join(f"{line}\n" for line in lines))
        return path

    # -- nodes -> study -------------------------------------------------------------------------------

    @staticmethod
    def _sanitizedName(name: str, fallbackPrefix: str, used: set) -> str:
        """Lower case, runs of other characters replaced by ``_``, starting with a letter, unique in ``used``."""
        text = re.sub(r"[^a-z0-9]+", "_", (name or "").lower()).strip("_")
        if not text or not text[0].isalpha():
            text = f"{fallbackPrefix}_{text}" if text else fallbackPrefix
        candidate, number = text, 2
        while candidate in used:
            candidate = f"{text}_{number}"
            number += 1
        used.add(candidate)
        return candidate

    @classmethod
    def channelName(cls, nodeName: str, used: set) -> str:
        """Channel name for a volume node: its sanitized name, or the BraTS channel (t1, t1ce, t2, flair)
        when the name ends with a BraTS suffix (``..._t1c``, ``...-t2f``)."""
        from NeuralRaycastLib.study.study import BRATS_CHANNELS

        tokens = re.split(r"[^a-z0-9]+", (nodeName or "").lower().strip())
        brats = BRATS_CHANNELS.get(tokens[-1]) if tokens and len([t for t in tokens if t]) > 1 else None
        if brats and brats not in used:
            used.add(brats)
            return brats
        return cls._sanitizedName(nodeName, "channel", used)

    @staticmethod
    def ijkToWorldMatrix(volumeNode) -> np.ndarray:
        """IJK -> world RAS of a volume, including its (linear) parent transforms, as a 4x4 array.

        Raises ValueError if the volume is under a non-linear transform (harden or resample it first).
        """
        ijkToRas = vtk.vtkMatrix4x4()
        volumeNode.GetIJKToRASMatrix(ijkToRas)
        matrix = slicer.util.arrayFromVTKMatrix(ijkToRas)
        parent = volumeNode.GetParentTransformNode()
        if parent is not None:
            if not parent.IsTransformToWorldLinear():
                raise ValueError(
                    f"Volume '{volumeNode.GetName()}' is under the non-linear transform '{parent.GetName()}'; "
                    "harden the transform (resample the volume) before using it here"
                )
            parentToWorld = vtk.vtkMatrix4x4()
            parent.GetMatrixTransformToWorld(parentToWorld)
            matrix = slicer.util.arrayFromVTKMatrix(parentToWorld) @ matrix
        return np.asarray(matrix, dtype=np.float64)

    @staticmethod
    def _volumeArray(volumeNode) -> np.ndarray:
        if volumeNode.GetImageData() is None:
            raise ValueError(f"Volume '{volumeNode.GetName()}' holds no image data")
        # A copy: arrayFromVolume is a view of VTK memory that the scene may free or change.
        return np.array(slicer.util.arrayFromVolume(volumeNode))

    @staticmethod
    def _shapeKji(volumeNode) -> tuple[int, int, int]:
        """The voxel array's shape (K, J, I), without copying the voxels."""
        if volumeNode.GetImageData() is None:
            raise ValueError(f"Volume '{volumeNode.GetName()}' holds no image data")
        return tuple(reversed(volumeNode.GetImageData().GetDimensions()))

    @staticmethod
    def _checkSameGrid(volumeNode, shape, affine: np.ndarray, refNode, refShape, refAffine) -> None:
        """Raise GridMismatchError unless ``volumeNode`` (voxel array shape ``shape``, KJI) lies on the
        reference grid (same shape, corners within a tenth of a voxel)."""
        from NeuralRaycastLib.grid import off_grid_mm

        if tuple(shape[:3]) != tuple(refShape[:3]):
            raise GridMismatchError(
                f"Volume '{volumeNode.GetName()}' has {shape[2]} x {shape[1]} x {shape[0]} voxels "
                f"(IJK) but the reference '{refNode.GetName()}' has {refShape[2]} x {refShape[1]} x {refShape[0]}; "
                "resample it onto the reference volume first"
            )
        if (offset := off_grid_mm(affine, refAffine, tuple(refShape[:3][::-1]))) is not None:
            raise GridMismatchError(
                f"Volume '{volumeNode.GetName()}' is not on the grid of the reference '{refNode.GetName()}' "
                f"(corners differ by up to {offset:.2f} mm); register and resample it onto the reference first"
            )

    @staticmethod
    def resampledOnto(array: np.ndarray, affine: np.ndarray, refShape, refAffine: np.ndarray,
                      order: int = 1) -> np.ndarray:
        """A KJI volume array resampled (trilinear, or nearest with ``order=0``: masks; zero outside) onto the
        reference grid; both affines map IJK to the same world RAS, so registration is assumed done."""
        from scipy import ndimage

        toOther = np.linalg.inv(affine) @ refAffine  # reference IJK -> this volume's IJK
        reverse = np.eye(3)[::-1]  # IJK <-> KJI
        return ndimage.affine_transform(
            np.asarray(array, np.float32), reverse @ toOther[:3, :3] @ reverse, reverse @ toOther[:3, 3],
            output_shape=tuple(refShape[:3]), order=order, mode="constant", cval=0.0,
        )

    def volumesOffGrid(self, volumeNodes, probabilityNode=None, brainMaskNode=None) -> list[str]:
        """Names of the selected volumes that are not on the reference (first) volume's grid."""
        nodes = [node for node in (volumeNodes or []) if node is not None]
        if not nodes:
            return []
        reference, refAffine = nodes[0], self.ijkToWorldMatrix(nodes[0])
        refShape = self._shapeKji(reference)
        names = []
        for node in nodes[1:] + [node for node in (probabilityNode, brainMaskNode) if node is not None]:
            try:
                self._checkSameGrid(node, self._shapeKji(node), self.ijkToWorldMatrix(node), reference, refShape,
                                    refAffine)
            except GridMismatchError:
                names.append(node.GetName())
        return names

    def _onReferenceGrid(self, node, reference, refShape, refAffine, resample: bool, order: int = 1) -> np.ndarray:
        array, affine = self._volumeArray(node), self.ijkToWorldMatrix(node)
        try:
            self._checkSameGrid(node, array.shape, affine, reference, refShape, refAffine)
        except GridMismatchError:
            if not resample:
                raise
            logging.info(f"Volume '{node.GetName()}' resampled onto the grid of '{reference.GetName()}'")
            return self.resampledOnto(array, affine, refShape, refAffine, order)
        return array

    def segmentationLabels(self, segmentationNode, referenceVolumeNode) -> tuple[np.ndarray, dict[str, list[int]]]:
        """Export the segments onto the reference volume's grid.

        Returns a KJI int16 label array and ``{structure name: label values}``, structure names being the
        sanitized segment names. Segments that do not overlap get one label each (1, 2, ... in segment
        order, as a joint labelmap export would give); where segments overlap, each combination of segments
        gets its own label and a structure lists every label that contains it, so no voxel is lost.
        Empty segments are skipped with a warning.
        """
        segmentation = segmentationNode.GetSegmentation()
        segmentIds = [segmentation.GetNthSegmentID(index) for index in range(segmentation.GetNumberOfSegments())]
        if not segmentIds:
            raise ValueError(f"Segmentation '{segmentationNode.GetName()}' has no segments")

        scene = segmentationNode.GetScene() or slicer.mrmlScene
        nodesBefore = {scene.GetNthNode(index).GetID() for index in range(scene.GetNumberOfNodes())}
        labelmapNode = scene.AddNewNodeByClass("vtkMRMLLabelMapVolumeNode", "NeuralRaycast export (temporary)")
        masks: dict[str, np.ndarray] = {}
        segments: dict[str, tuple] = {}
        used: set = set()
        try:
            for segmentId in segmentIds:
                ids = vtk.vtkStringArray()
                ids.InsertNextValue(segmentId)
                segmentName = segmentation.GetSegment(segmentId).GetName()
                exported = slicer.modules.segmentations.logic().ExportSegmentsToLabelmapNode(
                    segmentationNode, ids, labelmapNode, referenceVolumeNode
                )
                if not exported:
                    raise ValueError(
                        f"Segment '{segmentName}' of '{segmentationNode.GetName()}' could not be exported onto "
                        f"the grid of '{referenceVolumeNode.GetName()}'"
                    )
                mask = np.array(slicer.util.arrayFromVolume(labelmapNode)) > 0
                if not mask.any():
                    logging.warning(f"Segment '{segmentName}' is empty on the reference grid; it is skipped")
                    continue
                structureName = self._sanitizedName(segmentName, "segment", used)
                masks[structureName] = mask
                segments[structureName] = (segmentName, tuple(segmentation.GetSegment(segmentId).GetColor()))
        finally:
            # Removes the labelmap and whatever the export created with it (display, color table nodes).
            added = [
                scene.GetNthNode(index)
                for index in range(scene.GetNumberOfNodes())
                if scene.GetNthNode(index).GetID() not in nodesBefore
            ]
            for node in added:
                if node.GetScene() is not None:
                    scene.RemoveNode(node)

        if not masks:
            raise ValueError(f"Every segment of '{segmentationNode.GetName()}' is empty on the reference grid")
        self.structureSegments = segments
        names = list(masks)
        stack = np.stack([masks[name] for name in names], axis=-1)
        labels = np.zeros(stack.shape[:3], dtype=np.int16)
        if int(stack.sum(axis=-1).max()) <= 1:
            for index, name in enumerate(names):
                labels[masks[name]] = index + 1
            return labels, {name: [index + 1] for index, name in enumerate(names)}

        inside = stack.any(axis=-1)
        combinations, inverse = np.unique(stack[inside], axis=0, return_inverse=True)
        if len(combinations) > 32767:
            raise ValueError("Too many overlapping segment combinations to encode in a label map")
        labels[inside] = (np.asarray(inverse).ravel() + 1).astype(np.int16)
        structures = {
            name: [int(value) + 1 for value in np.flatnonzero(combinations[:, column])]
            for column, name in enumerate(names)
        }
        return labels, structures

    def studyFromNodes(self, volumeNodes, segmentationNode=None, probabilityNode=None, resampleToReference=False,
                       brainMaskNode=None):
        """Build a checked ``NeuralRaycastLib.study.study.Study`` from scene nodes (the scene is not changed).

        :param volumeNodes: scalar volumes, the reference channel first; all must share its grid, unless
            ``resampleToReference``: then volumes on other grids are resampled onto it (trilinear).
        :param segmentationNode: optional segmentation; exported onto the reference grid, one structure
            per non-empty segment, named after it.
        :param probabilityNode: optional tumour probability volume in [0, 1] on the reference grid.
        :param brainMaskNode: optional brain mask volume (label map or scalar volume, non-zero inside) on the
            reference grid (resampled nearest-neighbour with ``resampleToReference``).
        :return: the study; arrays are IJK ordered, ``affine`` is IJK -> world RAS (parent transforms included).
        Raises ValueError (``StudyError`` is one) naming the node at fault.
        """
        from NeuralRaycastLib.study.study import Study

        volumeNodes = [node for node in (volumeNodes or []) if node is not None]
        if not volumeNodes:
            raise ValueError("No input volume given; select at least the reference volume")
        reference = volumeNodes[0]
        seen = set()
        for node in volumeNodes:
            if node.GetID() in seen:
                raise ValueError(f"Volume '{node.GetName()}' is selected more than once")
            seen.add(node.GetID())

        startTime = time.time()
        refAffine = self.ijkToWorldMatrix(reference)
        refArray = self._volumeArray(reference)
        channels: dict[str, np.ndarray] = {}
        used: set = set()
        for node in volumeNodes:
            array = (refArray if node is reference
                     else self._onReferenceGrid(node, reference, refArray.shape, refAffine, resampleToReference))
            channels[self.channelName(node.GetName(), used)] = array

        probability = None
        if probabilityNode is not None:
            probability = self._onReferenceGrid(probabilityNode, reference, refArray.shape, refAffine,
                                                resampleToReference)

        brainMask = None
        if brainMaskNode is not None:
            brainMask = self._onReferenceGrid(brainMaskNode, reference, refArray.shape, refAffine,
                                              resampleToReference, order=0) != 0

        labels, structures = None, None
        if segmentationNode is not None:
            labels, structures = self.segmentationLabels(segmentationNode, reference)

        study = Study.from_arrays(
            channels,
            refAffine,
            labels=labels,
            probability=probability,
            brain_mask=brainMask,
            structures=structures,
            name=reference.GetName(),
            axis_order="kji",
            colors={name: color for name, (_segment, color) in self.structureSegments.items()} if labels is not None
            else None,
        )
        logging.info(f"Study '{study.name}' read from the scene in {time.time() - startTime:.2f} s")
        return study

    # -- preparation ----------------------------------------------------------------------------------

    def prepareStudy(self, study, progress=None):
        """Brain mask, boundary maps and tumour probability (``NeuralRaycastLib.study.preprocess.prepare``).

        :param progress: optional ``callback(message: str, fraction: float)``.
        """
        from NeuralRaycastLib.study.preprocess import prepare

        startTime = time.time()
        prepared = prepare(study, progress=progress)
        logging.info(f"Study '{study.name}' prepared in {time.time() - startTime:.2f} s")
        return prepared

    @staticmethod
    def summaryText(prepared) -> str:
        from NeuralRaycastLib.study.summary import study_summary, summary_text

        return summary_text(study_summary(prepared))

    # -- studies into the scene -----------------------------------------------------------------------

    def addStudyToScene(self, study, name: str | None = None):
        """Add a ``NeuralRaycastLib.study.study.Study`` to the scene: one volume per channel and, if it has labels,
        a segmentation with one (possibly overlapping) segment per structure, in the structure's colour.

        Returns ``(volume nodes, segmentation node or None)``. All or nothing: on an error the nodes added
        so far are removed.
        """
        from NeuralRaycastLib.study.structures import make_structures

        name = name or study.name
        added = []
        try:
            volumes = []
            for channel in study.channel_names:
                array = np.ascontiguousarray(study.channels[channel].transpose(2, 1, 0), dtype=np.float32)
                volume = slicer.util.addVolumeFromArray(array, ijkToRAS=study.affine, name=f"{name} {channel}")
                added.append(volume)
                volumes.append(volume)
            segmentationNode = None
            if study.labels is not None:
                segmentationNode = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode", f"{name} segmentation")
                added.append(segmentationNode)
                segmentationNode.CreateDefaultDisplayNodes()
                segmentationNode.SetReferenceImageGeometryParameterFromVolumeNode(volumes[0])
                for structure in make_structures(study.structures, include_brain=False):
                    mask = np.isin(study.labels, structure.labels).transpose(2, 1, 0).astype(np.uint8)
                    segmentId = segmentationNode.GetSegmentation().AddEmptySegment(
                        "", structure.name.replace("_", " ").capitalize(), list(structure.color)
                    )
                    slicer.util.updateSegmentBinaryLabelmapFromArray(mask, segmentationNode, segmentId, volumes[0])
        except Exception:
            self._removeNodes(added)
            raise
        return volumes, segmentationNode

    def loadSampleStudy(self, folder: str | None = None, case: str = "icbm", spacing: float | None = None,
                        progress=None):
        """The built-in sample case (``neuralraycast sample``) in the scene; see :meth:`addStudyToScene`.

        :param case: ``icbm`` (real anatomy with a synthetic lesion; the template is fetched once, pinned and
            checksummed) or ``phantom`` (analytic shapes, nothing fetched).
        """
        from NeuralRaycastLib.study.sample import write_sample
        from NeuralRaycastLib.study.study import load_study

        folder = folder or os.path.join(os.path.expanduser("~"), "NeuralRaycast", "samples", case)
        study = load_study(write_sample(folder, case, spacing, progress=progress))
        return self.addStudyToScene(study, name=f"{case} sample")

    # -- training -------------------------------------------------------------------------------------

    @staticmethod
    def workerPython() -> str | None:
        """The interpreter for worker processes: Slicer's ``PythonSlicer`` (on Slicer's PATH, with Slicer's
        packages). Outside the Slicer application (headless tests) this process's own; None in a Slicer
        without PythonSlicer, whose own executable would start another Slicer."""
        if found := shutil.which("PythonSlicer"):
            return found
        if hasattr(slicer.app, "slicerHome"):  # the application itself, not a headless stand-in
            return None
        return sys.executable

    @staticmethod
    def gpuContext(device: str = "auto", gpuMemory: str = ""):
        """The slangpy device (opened once per process) with its GPU memory budget (``gpuMemory``, e.g. 6G;
        empty: NEURALRAYCAST_GPU_MEMORY, else the GPU's free memory less a margin); raises GpuUnavailableError
        naming what to install, ValueError for an amount it cannot read."""
        from NeuralRaycastLib.gpu.device import open_device, use_memory_budget

        gpu = open_device(device)
        use_memory_budget(gpu, gpuMemory or None, "the GPU memory setting")
        return gpu

    @staticmethod
    def runSettings(gpu, preset: str = "auto", seed: int = 0, iterations: int = 0, views: int = 0, size: int = 0,
                    shadows: bool = False):
        """``auto`` is the quick preset on a software device (lavapipe) and the standard one on a GPU; zeros
        keep the preset's number of iterations, reference views and view size."""
        from NeuralRaycastLib.train.presets import RunSettings

        return RunSettings.for_device(gpu, preset, seed=seed, iterations=iterations, views=views,
                                               size=size, shadows=shadows)

    @staticmethod
    def defaultRunFolder(studyName: str) -> str:
        """``~/NeuralRaycast/runs/<study>-<date-time>``: kept after Slicer closes, so a saved scene can reload it."""
        name = re.sub(r"[^A-Za-z0-9_-]+", "_", studyName or "study").strip("_") or "study"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return os.path.join(os.path.expanduser("~"), "NeuralRaycast", "runs", f"{name}-{stamp}")

    def train(self, volumeNodes, segmentationNode, probabilityNode=None, preset: str = "auto", device: str = "auto",
              seed: int = 0, iterations: int = 0, runFolder: str | None = None, progress=None, shouldStop=None,
              views: int = 0, size: int = 0, config=None, resampleToReference: bool = False, shadows: bool = False,
              brainMaskNode=None, gpuMemory: str = "", pretrainedAppearance: bool = False,
              representation: str = "field"):
        """Read the study from the scene, train a field or Gaussians (blocking) and save it in ``runFolder``.

        :param progress: optional ``callback(message, fraction)``; the widget uses it to keep Slicer responsive.
        :param shouldStop: optional ``callback() -> bool`` polled between steps; a cancel keeps and saves the
            state reached (``run.log.cancelled`` is then True).
        :param views, size: number and pixel size of the reference views (0: the preset's).
        :param config: a ``NeuralRaycastLib.train.trainer.TrainConfig`` (for Gaussians a
            ``NeuralRaycastLib.gaussians.train.GaussianTrainConfig``) replacing the preset's schedule (scripting).
        :param resampleToReference: resample volumes on other grids onto the reference (else an error).
        :param shadows: train on views lit with key-light shadows, shading the field through its own meshes.
        :param brainMaskNode: optional brain mask volume (see ``studyFromNodes``).
        :param gpuMemory: the GPU memory the run may take (e.g. 6G; empty: the GPU's free memory less a margin):
            steps and the study's grid are sized to it, and a run that cannot fit raises GpuMemoryError.
        :param pretrainedAppearance: fit the surfaces only, the appearance from the shipped pretrained weights
            (``fit --appearance pretrained``); not with ``shadows``.
        :param representation: ``field`` or ``gaussians`` (``fit --representation``; not with ``shadows`` or
            ``pretrainedAppearance``).
        :return: ``NeuralRaycastLib.train.run_folder.TrainedRun`` (a ``GaussianRun`` for Gaussians; also kept as
            ``self.run``). The scene is not changed.
        Raises ValueError for bad inputs, GpuUnavailableError without a device, TrainingError if the loss
        stays non-finite, WarmUpCancelled if cancelled while the kernels compile (nothing trained then).
        On a GPU that has not compiled this run's kernels yet, they are compiled first in worker processes
        side by side (``NeuralRaycastLib.train.warmup``, once per machine), which keeps Slicer responsive while
        they compile.
        """
        from NeuralRaycastLib.gpu.device import GpuMemoryError
        from NeuralRaycastLib.gpu.memory_budget import LOWER
        from NeuralRaycastLib.train.run import train_study

        # The inputs first: a missing volume is reported as such, also where no GPU (or slangpy) is there.
        study = self.studyFromNodes(volumeNodes, segmentationNode, probabilityNode, resampleToReference,
                                    brainMaskNode)
        self.checkRepresentation(representation, shadows, pretrainedAppearance)
        appearance = self.pretrainedAppearance(shadows) if pretrainedAppearance else None
        gpu = self.gpuContext(device, gpuMemory)
        settings = self.runSettings(gpu, preset, seed, iterations, views, size, shadows)
        python = self.workerPython()  # None: the run compiles its kernels itself
        if python is None and not gpu.report.software:
            logging.warning("PythonSlicer not found: the kernels compile in Slicer's own process (slower)")
        folder = str(runFolder) if runFolder and str(runFolder) not in ("", ".") else self.defaultRunFolder(study.name)
        startTime = time.time()
        # Training again into a run folder (the last run's, which the module keeps) replaces that run; any
        # other non-empty folder is refused before any work.
        replace = os.path.isfile(os.path.join(folder, "run.json"))
        try:
            if representation == "gaussians":
                from NeuralRaycastLib.gaussians.run import fit_gaussians

                self.run = fit_gaussians(gpu, study, folder, settings, progress, shouldStop, config=config,
                                         overwrite=replace)
            else:
                self.run = train_study(gpu, study, folder, settings, progress, shouldStop,
                                       warm_up=python is not None, worker_python=python, config=config,
                                       overwrite=replace, appearance=appearance)
        except GpuMemoryError as error:  # the advice in the module's words, not the command line's
            raise GpuMemoryError(str(error).replace(LOWER, MEMORY_ADVICE)) from error
        logging.info(f"Trained '{study.name}' ({representation}, {settings.preset} preset) in "
                     f"{time.time() - startTime:.1f} s into {folder}{' (cancelled)' if self.run.log.cancelled else ''}")
        return self.run

    @staticmethod
    def checkRepresentation(representation: str = "field", shadows: bool = False,
                            pretrainedAppearance: bool = False) -> None:
        """Refuse, before any work, what the Gaussians do not offer (the command line refuses the same)."""
        if representation not in REPRESENTATIONS:
            raise ValueError(f"Unknown representation '{representation}': choose one of {', '.join(REPRESENTATIONS)}")
        if representation != "gaussians":
            return
        if pretrainedAppearance:
            raise ValueError("the pretrained appearance is for the field; the Gaussians carry their own colours: "
                             "untick the pretrained appearance or choose the field")
        if shadows:
            raise ValueError("shadows are not available with the Gaussians yet: untick shadows or choose the field")

    @staticmethod
    def pretrainedAppearance(shadows: bool = False):
        """The shipped pretrained appearance weights, read and checked (ValueError with shadows: not available)."""
        from NeuralRaycastLib.appearance.latent_scene import PretrainedAppearance
        from NeuralRaycastLib.appearance.pretrain import SHIPPED_WEIGHTS

        if shadows:
            raise ValueError("the pretrained appearance is not available with shadows yet: untick one of them")
        return PretrainedAppearance.read(SHIPPED_WEIGHTS)

    def startTraining(self, volumeNodes, segmentationNode, probabilityNode=None, preset: str = "auto",
                      device: str = "auto", seed: int = 0, iterations: int = 0, runFolder: str | None = None,
                      views: int = 0, size: int = 0, resampleToReference: bool = False, shadows: bool = False,
                      brainMaskNode=None, gpuMemory: str = "", pretrainedAppearance: bool = False,
                      representation: str = "field") -> "TrainingJob":
        """Start training in a worker process (``PythonSlicer -m NeuralRaycastLib.app.entry fit --progress-json``,
        the command line's own training); returns at once with the job (see :class:`TrainingJob`).

        The study is read from the scene here (inputs checked before anything starts) and handed to the worker
        as files; the worker opens the GPU, so a GPU fault or a driver reset ends the worker, not Slicer. The
        scene is not changed: load the trained run with :meth:`loadRun` once ``job.outcome.trained``.
        Parameters as :meth:`train` (whose blocking, in-process training stays for scripting).
        """
        import tempfile

        from NeuralRaycastLib.app.worker import WorkerProcess
        from NeuralRaycastLib.study.study import write_study

        study = self.studyFromNodes(volumeNodes, segmentationNode, probabilityNode, resampleToReference,
                                    brainMaskNode)
        self.checkRepresentation(representation, shadows, pretrainedAppearance)  # refused before a worker starts
        if pretrainedAppearance:
            self.pretrainedAppearance(shadows)  # refused here, before a worker starts
        python = self.workerPython()
        if python is None:
            raise RuntimeError("PythonSlicer, which runs the training beside Slicer, was not found on Slicer's PATH; "
                               "reinstall Slicer, or train from the Python console with NeuralRaycastLogic().train")
        folder = str(runFolder) if runFolder and str(runFolder) not in ("", ".") else self.defaultRunFolder(study.name)
        studyFolder = tempfile.mkdtemp(prefix="NeuralRaycast-study-")
        try:
            manifest = write_study(study, studyFolder)
            command = [python, "-m", "NeuralRaycastLib.app.entry", "fit", str(manifest), "--out", folder,
                       "--preset", preset, "--device", device, "--seed", str(int(seed)), "--progress-json"]
            for option, value in (("--iterations", iterations), ("--views", views), ("--size", size)):
                if value:
                    command += [option, str(int(value))]
            if gpuMemory:
                command += ["--gpu-memory", gpuMemory]
            if shadows:
                command.append("--shadows")
            if pretrainedAppearance:
                command += ["--appearance", "pretrained"]
            if representation != "field":
                command += ["--representation", representation]
            if os.path.isfile(os.path.join(folder, "run.json")):
                command.append("--overwrite")  # training again into the last run's folder replaces that run
            worker = self.takeStandby(device, command[4:])
            if worker is None:
                worker = WorkerProcess(command, env=self.workerEnvironment())
                worker.start()
        except Exception:
            shutil.rmtree(studyFolder, ignore_errors=True)
            raise
        how = "the training process kept ready" if worker.job is not None else "a worker process"
        logging.info(f"Training '{study.name}' in {how} (pid {worker.pid}) into {folder}")
        return TrainingJob(worker, folder, studyFolder)

    def startStandby(self, device: str = "auto", preset: str = "auto") -> bool:
        """Start a training process that makes itself ready ahead of the next training (``neuralraycast standby``:
        the backend imported, the device open, the kernels called once on a small phantom where they are
        compiled), unless one runs already for ``device``. :meth:`startTraining` then hands it the study instead
        of starting a process, which saves the seconds a fresh one spends getting there. Returns whether one
        runs (not without PythonSlicer)."""
        from NeuralRaycastLib.app.worker import WorkerProcess

        standby = self.standby
        if standby is not None and standby.process.poll() is None and self.standbyDevice == device:
            return True  # (one that ended, say for want of a device, is started again)
        self.stopStandby()
        python = self.workerPython()
        if python is None:
            return False
        worker = WorkerProcess([python, "-m", "NeuralRaycastLib.app.entry", "standby", "--device", device,
                                "--preset", preset], env=self.workerEnvironment(), name="the training process")
        worker.start()
        self.standby, self.standbyDevice = worker, device
        return True

    def stopStandby(self) -> None:
        """End the training process kept ready, if one runs (nothing of it is kept)."""
        standby, self.standby, self.standbyDevice = self.standby, None, None
        if standby is not None:
            standby.kill()

    def takeStandby(self, device: str, arguments: list[str]):
        """The training process kept ready, given the ``fit`` job of ``arguments``, where one is ready for
        ``device``; else None, the process (one still getting ready, or for another device) ended, so that it
        does not take the GPU beside the run's own."""
        standby = self.standby
        if standby is None:
            return None
        self.standby, self.standbyDevice, device_of_standby = None, None, self.standbyDevice
        if device_of_standby == device and standby.poll_ready():
            try:
                standby.send_job(arguments)
                return standby
            except (RuntimeError, OSError, ValueError) as error:  # it ended meanwhile: a fresh one takes the job
                logging.warning(f"The training process kept ready could not take the job ({error})")
        standby.kill()
        return None

    @staticmethod
    def workerEnvironment() -> dict[str, str]:
        """The worker's environment: Slicer's startup environment (as ``slicer.util.launchConsoleProcess``
        uses) where there is one, with the folder that holds ``NeuralRaycastLib`` first on its Python path."""
        import NeuralRaycastLib

        env = slicer.util.startupEnvironment() if hasattr(slicer.app, "startupEnvironment") else {}
        env = dict(env or os.environ)
        libraryParent = os.path.dirname(os.path.dirname(os.path.abspath(NeuralRaycastLib.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(path for path in (libraryParent, env.get("PYTHONPATH", "")) if path)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def loadRun(self, runFolder: str, volumeNodes, segmentationNode, probabilityNode=None, device: str = "auto",
                resampleToReference: bool = False, brainMaskNode=None, gpuMemory: str = ""):
        """Reload a trained model for the study in the scene (the one it was trained on: its geometry is
        checked), rendering within ``gpuMemory`` (see ``train``). Returns the TrainedRun (also kept as
        ``self.run``)."""
        from NeuralRaycastLib.train.run_folder import load_run, prepare_for_run, read_run

        folder = str(runFolder or "")
        if folder in ("", ".") or not os.path.isdir(folder):
            raise ValueError(f"Model folder '{folder}' does not exist; train a model first or select its folder")
        settings = read_run(folder)["settings"]
        study = self.studyFromNodes(volumeNodes, segmentationNode, probabilityNode, resampleToReference,
                                    brainMaskNode)
        prepared = prepare_for_run(study, settings)
        if self.isGaussianFolder(folder):
            from NeuralRaycastLib.gaussians.run import load_gaussian_run

            self.run = load_gaussian_run(self.gpuContext(device, gpuMemory), folder, prepared)
        else:
            self.run = load_run(self.gpuContext(device, gpuMemory), folder, prepared)
        return self.run

    @staticmethod
    def isGaussianFolder(folder) -> bool:
        """Whether a run folder holds Gaussians (``fit --representation gaussians``) rather than a field."""
        from NeuralRaycastLib.gaussians.run import is_gaussian_run

        return bool(folder) and is_gaussian_run(str(folder))

    @staticmethod
    def isGaussianRun(run) -> bool:
        """Whether a trained or loaded run is of Gaussians: no field, so no web page."""
        from NeuralRaycastLib.gaussians.run import GaussianRun

        return isinstance(run, GaussianRun)

    def sharePage(self, runFolder, path, overwrite: bool = False, device: str = "auto", gpuMemory: str = ""):
        """Write a trained run as one self-contained web page that renders it live in a browser with WebGPU (what
        ``neuralraycast share`` writes: no network requests, no names, dates or paths of the study); returns the
        page's path.

        The loaded model is shared where ``runFolder`` is its folder (a run trained in the module: its study
        lives in the scene); another folder is opened on the study file its run records. The path is checked
        before any work: it must end in .html, and a page already there is kept unless ``overwrite``.
        Raises ValueError naming the path or the folder and what to do.
        """
        from NeuralRaycastLib.app.share import check_page_path, write_page

        out = check_page_path(path, overwrite, "confirm replacing it")
        folder = str(runFolder or "")
        if folder in ("", "."):
            raise ValueError("No model folder given: train a model (Train) or load one (Load model) first")
        if (self._isLoadedRun(folder) and self.isGaussianRun(self.run)) or self.isGaussianFolder(folder):
            raise ValueError(f"The model in {folder} is of Gaussians: the web page is for field models only so far; "
                             "share a field model")
        run = self.run if self._isLoadedRun(folder) else self._openSharedRun(folder, device, gpuMemory)
        page = write_page(run, out)
        logging.info(f"Web page of the model in {folder} written to {page} ({page.stat().st_size / 1e6:.1f} MB)")
        return page

    def _isLoadedRun(self, folder: str) -> bool:
        """Whether ``folder`` is the loaded model's (which may have been moved or deleted since it was loaded)."""
        if self.run is None:
            return False
        loaded = str(self.run.folder)
        if os.path.abspath(folder) == os.path.abspath(loaded):
            return True
        return os.path.isdir(folder) and os.path.isdir(loaded) and os.path.samefile(folder, loaded)

    def _openSharedRun(self, folder: str, device: str, gpuMemory: str):
        """A run folder that is not the loaded model, on the study file its run records."""
        import json

        from NeuralRaycastLib.train.run_folder import open_run

        if not os.path.isfile(os.path.join(folder, "run.json")):
            raise ValueError(f"Model folder '{folder}' holds no trained model (no run.json); train one (Train) or "
                             "select the folder of one")
        with open(os.path.join(folder, "run.json"), encoding="utf-8") as file:
            study = json.load(file).get("study")  # the run's own checks follow in open_run
        if not study or not os.path.exists(str(study)):
            raise ValueError(f"Model folder '{folder}' was trained on a study that is no longer on disk: load its "
                             "study into the scene, select the folder, press Load model, then share it")
        return open_run(self.gpuContext(device, gpuMemory), folder)

    def _requireRun(self):
        if self.run is None:
            raise RuntimeError("No trained model: train one (Apply) or load a model folder first")
        return self.run

    @classmethod
    def trainingSummary(cls, run) -> str:
        lines = [f"Model folder: {run.folder}", f"Preset: {run.settings.preset}, study "
                 f"{' x '.join(map(str, run.prepared.study.shape))} voxels"]
        if cls.isGaussianRun(run):
            return "\n".join(lines + cls._gaussianSummary(run))
        if run.log is not None:
            cancelled = " (cancelled, the state reached is kept)" if run.log.cancelled else ""
            lines.append(f"Training: {run.log.seconds:.1f} s{cancelled}")
            score = run.log.last("heldout_psnr")
            if score is not None:
                lines.append(f"Held-out PSNR: {score:.2f} dB, SSIM {run.log.last('heldout_ssim'):.3f}")
        return "\n".join(lines)

    @staticmethod
    def _gaussianSummary(run) -> list[str]:
        """A Gaussian run's lines, from the training log its folder keeps (a loaded run has no log in memory)."""
        import json

        lines = [f"Representation: Gaussians ({run.scene.count:,}); no web page"]
        logPath = os.path.join(str(run.folder), "train_log.json")
        if not os.path.isfile(logPath):
            return lines
        with open(logPath, encoding="utf-8") as file:
            log = json.load(file)
        cancelled = " (cancelled, the state reached is kept)" if log.get("cancelled") else ""
        if log.get("seconds") is not None:
            lines.append(f"Training: {float(log['seconds']):.1f} s{cancelled}")
        if log.get("heldout_psnr") is not None:
            lines.append(f"Held-out PSNR: {float(log['heldout_psnr']):.2f} dB")
        return lines

    # -- results into the scene -----------------------------------------------------------------------

    @staticmethod
    def cameraFromNode(cameraNode, size: tuple[int, int]):
        """A ``NeuralRaycastLib.render.camera.Camera`` from a vtkMRMLCameraNode and an image size (width, height)."""
        from NeuralRaycastLib.render.camera import Camera

        camera = cameraNode.GetCamera()
        return Camera.from_slicer(camera.GetPosition(), camera.GetFocalPoint(), camera.GetViewUp(),
                                  camera.GetViewAngle(), size)

    def renderCamera(self, camera, outputVolumeNode=None, name: str = "NeuralRaycast render"):
        """Render the trained field from ``camera`` into an RGB vector volume (created if not given).

        The picture lies in the axial plane, upright and unmirrored in an axial slice view (row 0 at the
        top, 1 mm pixels). Returns the volume node; the scene gains it only once the picture is complete.
        """
        run = self._requireRun()
        image = run.render(camera).rgb()
        pixels = np.round(255.0 * image).astype(np.uint8)[np.newaxis]  # (1, H, W, 3) = KJI + components
        ijkToRas = np.diag([-1.0, -1.0, 1.0, 1.0])  # i to the screen's right (patient left), j downwards
        scene = slicer.mrmlScene
        created = outputVolumeNode is None
        if created:
            outputVolumeNode = scene.AddNewNodeByClass("vtkMRMLVectorVolumeNode", name)
        try:
            slicer.util.updateVolumeFromArray(outputVolumeNode, pixels)
            outputVolumeNode.SetIJKToRASMatrix(slicer.util.vtkMatrixFromArray(ijkToRas))
            if outputVolumeNode.GetDisplayNode() is None:
                outputVolumeNode.CreateDefaultDisplayNodes()
        except Exception:
            if created:
                self._removeNodes([outputVolumeNode])
            raise
        return outputVolumeNode

    def createModels(self, smoothingIterations: int = 10, replaceExisting: bool = True) -> list:
        """One model node per learned structure (the surface s_k = 0), in RAS, named and coloured after
        its segment (the brain after itself).

        All meshes are computed before the scene changes; if adding a node fails, the nodes added so far
        are removed. With ``replaceExisting``, models made earlier for the same structure are updated.
        """
        run = self._requireRun()
        meshes = [mesh for mesh in run.meshes(smoothing_iterations=smoothingIterations) if len(mesh.faces)]
        if not meshes:
            raise ValueError("The learned field has no surface inside the study's box (is the model trained?)")
        scene = slicer.mrmlScene
        added, models = [], []
        try:
            for mesh in meshes:
                segmentName, color = self.structureSegments.get(mesh.name, (mesh.name.replace("_", " "), mesh.color))
                model = self._existingModel(mesh.name) if replaceExisting else None
                if model is None:
                    model = scene.AddNewNodeByClass("vtkMRMLModelNode", f"{segmentName} (neural)")
                    added.append(model)
                    model.SetAttribute(MODEL_ATTRIBUTE, mesh.name)
                    model.CreateDefaultDisplayNodes()
                model.SetAndObservePolyData(mesh.polydata())
                model.GetDisplayNode().SetColor(*color)
                models.append(model)
        except Exception:
            self._removeNodes(added)
            raise
        return models

    def _segmentLook(self, structureName: str, color) -> tuple[str, tuple[float, float, float]]:
        """The name and colour of a structure's segment (the brain's, and any structure not read from a
        segmentation, after the structure)."""
        name, look = self.structureSegments.get(structureName, (structureName.replace("_", " "), color))
        return name, tuple(float(c) for c in look)

    @staticmethod
    def _resultNode(kind: str, replaceExisting: bool):
        """The result node of ``kind`` (see RESULT_NODES) this module made before, if asked to replace it;
        else None."""
        if replaceExisting:
            className = RESULT_NODES[kind][0]
            for node in slicer.util.getNodesByClass(className):
                if node.GetAttribute(RESULT_ATTRIBUTE) == kind:
                    return node
        return None

    def createSegmentation(self, oversampling: int = 2, smoothingIterations: int = 10, referenceVolumeNode=None,
                           replaceExisting: bool = True):
        """The learned surfaces as a segmentation node: one segment per structure, named and coloured after
        its input segment, holding the learned mesh as its closed surface and, as its source representation,
        a binary label map on the study's grid split ``oversampling`` times along each axis (the voxels whose
        centres lie inside the mesh), so that Segment Editor, Segment Statistics and export work on it.

        :param referenceVolumeNode: the study's reference volume, kept as the segmentation's reference node.
        All label maps are made before the scene changes; a node this call added is removed if it fails.
        """
        from NeuralRaycastLib.mesh.labelmap import mesh_labelmaps

        run = self._requireRun()
        meshes = [mesh for mesh in run.meshes(smoothing_iterations=smoothingIterations) if len(mesh.faces)]
        if not meshes:
            raise ValueError("The learned field has no surface inside the study's box (is the model trained?)")
        fine, fineShape, labelmaps = mesh_labelmaps(meshes, run.prepared.affine, run.prepared.study.shape,
                                                 oversampling)
        segments = [self._segment(mesh, labelmap, fine) for mesh, labelmap in zip(meshes, labelmaps, strict=True)]

        node = self._resultNode("segmentation", replaceExisting)
        created = node is None
        if created:
            node = slicer.mrmlScene.AddNewNodeByClass(*RESULT_NODES["segmentation"])
            node.SetAttribute(RESULT_ATTRIBUTE, "segmentation")
        try:
            segmentation = node.GetSegmentation()
            wasModifying = node.StartModify()
            segmentation.RemoveAllSegments()
            segmentation.SetSourceRepresentationName(slicer.vtkSegmentationConverter.GetBinaryLabelmapRepresentationName())
            if referenceVolumeNode is not None:
                node.SetNodeReferenceID(node.GetReferenceImageGeometryReferenceRole(), referenceVolumeNode.GetID())
            # the finer grid over the whole study: where the segment tools edit and what export writes
            extent = [value for n in fineShape for value in (0, int(n) - 1)]
            geometry = slicer.vtkSegmentationConverter.SerializeImageGeometry(
                slicer.util.vtkMatrixFromArray(fine), extent)
            segmentation.SetConversionParameter(slicer.vtkSegmentationConverter.GetReferenceImageGeometryParameterName(),
                                                geometry)
            try:
                for mesh, segment in zip(meshes, segments, strict=True):
                    segmentation.AddSegment(segment, mesh.name)
            finally:
                node.EndModify(wasModifying)
            if node.GetDisplayNode() is None:
                node.CreateDefaultDisplayNodes()
            node.GetDisplayNode().SetPreferredDisplayRepresentationName3D(
                slicer.vtkSegmentationConverter.GetClosedSurfaceRepresentationName())
        except Exception:
            if created:
                self._removeNodes([node])
            raise
        return node

    @staticmethod
    def _orientedImage(ijkToRas: np.ndarray, first, inside):
        """A vtkOrientedImageData on the grid of ``ijkToRas`` holding ``inside`` (bool I, J, K; None: no voxels)
        from grid index ``first``: Slicer's binary label map of one segment."""
        from vtk.util.numpy_support import numpy_to_vtk

        image = slicer.vtkOrientedImageData()
        image.SetImageToWorldMatrix(slicer.util.vtkMatrixFromArray(np.asarray(ijkToRas, np.float64)))
        if inside is None or inside.size == 0:
            inside = np.zeros((1, 1, 1), bool)
        i, j, k = (int(v) for v in first)
        ni, nj, nk = inside.shape
        image.SetExtent(i, i + ni - 1, j, j + nj - 1, k, k + nk - 1)
        values = np.ascontiguousarray(inside.transpose(2, 1, 0), np.uint8).reshape(-1)  # VTK's x runs fastest
        image.GetPointData().SetScalars(numpy_to_vtk(values, deep=True, array_type=vtk.VTK_UNSIGNED_CHAR))
        return image

    def _segment(self, mesh, labelmap, ijkToRas: np.ndarray):
        """One segment: the learned mesh as its closed surface and its voxels as its binary label map."""
        name, color = self._segmentLook(mesh.name, mesh.color)
        segment = slicer.vtkSegment()
        segment.SetName(name)
        segment.SetColor(*color)
        segment.AddRepresentation(slicer.vtkSegmentationConverter.GetBinaryLabelmapRepresentationName(),
                                  self._orientedImage(ijkToRas, labelmap.first, labelmap.inside))
        segment.AddRepresentation(slicer.vtkSegmentationConverter.GetClosedSurfaceRepresentationName(),
                                  mesh.polydata())
        return segment

    def createResultsTables(self, metrics=None, replaceExisting: bool = True) -> tuple:
        """Two table nodes: one row per learned structure (Dice, surface distances, the label's and the learned
        volume and their difference in %, connected pieces kept and not), and one row per piece of a label that
        the surface does not hold as drawn (left out or kept apart as too small, holes filled, not reached),
        with its size and centre. Returns (structures table, pieces table).

        :param metrics: ``NeuralRaycastLib.train.evaluate.geometry_metrics`` of the run (computed if None).
        """
        from NeuralRaycastLib.train.structure_table import PIECE_COLUMNS, STRUCTURE_COLUMNS, piece_rows, structure_rows

        run = self._requireRun()
        if metrics is None and self.isGaussianRun(run):  # from the Gaussians' structure weights
            from NeuralRaycastLib.gaussians.geometry import gaussian_geometry_metrics

            metrics = gaussian_geometry_metrics(run.distances(), run.prepared)
        elif metrics is None:
            from NeuralRaycastLib.train.evaluate import geometry_metrics

            metrics = geometry_metrics(run.field, run.prepared)
        names = {structure.name: self._segmentLook(structure.name, structure.color)[0]
                 for structure in run.prepared.structures}
        notes = run.prepared.label_notes
        tables = (("structures", STRUCTURE_COLUMNS, structure_rows(metrics, notes, names)),
                  ("pieces", PIECE_COLUMNS, piece_rows(metrics, notes, names)))
        nodes, added = [], []
        try:
            for kind, columns, rows in tables:
                node = self._resultNode(kind, replaceExisting)
                if node is None:
                    node = slicer.mrmlScene.AddNewNodeByClass(*RESULT_NODES[kind])
                    node.SetAttribute(RESULT_ATTRIBUTE, kind)
                    added.append(node)
                self._fillTable(node, columns, rows)
                nodes.append(node)
        except Exception:
            self._removeNodes(added)
            raise
        return tuple(nodes)

    @staticmethod
    def _fillTable(tableNode, columns, rows) -> None:
        """Replace a table node's content by ``rows`` (dicts keyed by each column's key)."""
        table = vtk.vtkTable()
        for column in columns:
            array = vtk.vtkDoubleArray() if column.numeric else vtk.vtkStringArray()
            array.SetName(column.title)
            for row in rows:
                array.InsertNextValue(row[column.key] if column.numeric else str(row[column.key]))
            table.AddColumn(array)
        wasModifying = tableNode.StartModify()
        tableNode.SetAndObserveTable(table)
        tableNode.SetUseColumnTitleAsColumnHeader(True)
        for column in columns:
            if column.unit:
                tableNode.SetColumnUnitLabel(column.title, column.unit)
            tableNode.SetColumnDescription(column.title, column.description)
        tableNode.EndModify(wasModifying)

    # -- live view ------------------------------------------------------------------------------------

    def liveRender(self, camera) -> np.ndarray:
        """The trained model (a field or Gaussians) from ``camera`` as the live view shows it: straight-alpha bytes
        (H, W, 4), the rows from the bottom, made on the device."""
        return self._requireRun().render_picture(camera)

    def createLiveView(self, cameraNode, renderWindow, defer, redraw=None, onError=None, scale: float = 1.0,
                       maxSide: int | None = None):
        """Show the trained model over a 3D view, rendered again whenever its camera node changes (the mouse,
        scripts, the view's reset) or the view is resized; renders are coalesced (one in flight, one
        waiting). ``defer(callback)`` runs a callback after pending events (the widget: a zero-delay timer);
        ``redraw()`` asks the view to draw again; ``onError(error)`` is told of a failed render (the live view
        stops then). The picture is the view's size times ``scale``, its longer side at most ``maxSide``
        (None: the view's size on a GPU, LIVE_SIDE_SOFTWARE on a software device, where a frame of the view's
        size takes seconds) and stretched over the view. Returns the
        ``NeuralRaycastLib.render.live_view.LiveView``; ``close()`` it to stop."""
        from NeuralRaycastLib.render.camera import MAX_VIEW_SIZE
        from NeuralRaycastLib.render.live_view import LiveView

        run = self._requireRun()
        if maxSide is None:
            report = getattr(getattr(run, "gpu", None), "report", None)
            maxSide = LIVE_SIDE_SOFTWARE if getattr(report, "software", False) else MAX_VIEW_SIZE
        return LiveView(cameraNode, renderWindow, self.liveRender, defer, redraw or (lambda: None), onError, scale,
                        maxSide)

    @staticmethod
    def _existingModel(structureName: str):
        for model in slicer.util.getNodesByClass("vtkMRMLModelNode"):
            if model.GetAttribute(MODEL_ATTRIBUTE) == structureName:
                return model
        return None

    @staticmethod
    def _removeNodes(nodes) -> None:
        """Remove nodes with their display and storage nodes."""
        scene = slicer.mrmlScene
        for node in nodes:
            if node is None or node.GetScene() is None:
                continue
            if hasattr(node, "GetNumberOfDisplayNodes"):
                for index in reversed(range(node.GetNumberOfDisplayNodes())):
                    display = node.GetNthDisplayNode(index)
                    if display is not None:
                        scene.RemoveNode(display)
            storage = node.GetStorageNode() if hasattr(node, "GetStorageNode") else None
            if storage is not None:
                scene.RemoveNode(storage)
            scene.RemoveNode(node)


class TrainingJob:
    """A training running in a worker process (``NeuralRaycastLogic.startTraining``): poll it from a timer, ask
    it to stop, end it, or wait for it. The temporary study files are removed once it has ended."""

    def __init__(self, worker, runFolder: str, studyFolder: str) -> None:
        self.worker, self.runFolder, self.studyFolder = worker, runFolder, studyFolder

    @property
    def running(self) -> bool:
        return self.worker.running

    @property
    def outcome(self):
        """``NeuralRaycastLib.app.worker.Outcome`` once ended (state done, cancelled, failed or crashed), else None."""
        return self.worker.outcome

    def poll(self):
        """Progress since the last call, and the outcome once ended (never blocks)."""
        progress, outcome = self.worker.poll()
        if outcome is not None:
            self._cleanUp()
        return progress, outcome

    def requestStop(self) -> None:
        """Stop after the current step, keeping and saving the state reached."""
        self.worker.request_stop()

    def kill(self) -> None:
        """End the worker and the processes it started at once (nothing more is saved)."""
        self.worker.kill()
        self.poll()

    def wait(self, progress=None):
        """Block until the worker ends; ``progress(message, fraction)`` receives its reports. The outcome."""
        report = None if progress is None else (lambda item: progress(item.message, item.fraction))
        outcome = self.worker.wait(report)
        self._cleanUp()
        return outcome

    def _cleanUp(self) -> None:
        if self.studyFolder:
            shutil.rmtree(self.studyFolder, ignore_errors=True)
            self.studyFolder = None


#
# NeuralRaycastTest
#


class NeuralRaycastTest(ScriptedLoadableModuleTest):
    """Reads a small synthetic study from the scene; no GPU and no network needed."""

    def setUp(self):
        """Do whatever is needed to reset the state - typically a scene clear will be enough."""
        slicer.mrmlScene.Clear()

    def runTest(self):
        """Run as few or as many tests as needed here."""
        self.setUp()
        self.test_StudyFromNodes()
        self.setUp()
        self.test_OverlappingSegmentsAndTransforms()
        self.setUp()
        self.test_TrainRenderModels()

    @staticmethod
    def _syntheticVolume(name, shapeKji=(10, 12, 14), ijkToRas=None):
        k, j, i = np.meshgrid(*(np.arange(n) for n in shapeKji), indexing="ij")
        array = (100 + 10 * i + 3 * j + k).astype(np.int16)
        if ijkToRas is None:
            ijkToRas = np.array([[-1.5, 0, 0, 20.0], [0, -1.2, 0, 30.0], [0, 0, 2.0, -40.0], [0, 0, 0, 1]])
        volume = slicer.util.addVolumeFromArray(array, ijkToRAS=ijkToRas, name=name)
        return volume, array, np.asarray(ijkToRas, dtype=float)

    @staticmethod
    def _box(shapeKji, kRange, jRange, iRange) -> np.ndarray:
        """A boolean KJI mask that is true on the half-open index ranges given."""
        mask = np.zeros(shapeKji, dtype=bool)
        mask[slice(*kRange), slice(*jRange), slice(*iRange)] = True
        return mask

    @staticmethod
    def _addSegment(segmentationNode, name, maskKji, referenceVolume):
        segmentId = segmentationNode.GetSegmentation().AddEmptySegment("", name)
        slicer.util.updateSegmentBinaryLabelmapFromArray(
            maskKji.astype(np.uint8), segmentationNode, segmentId, referenceVolume
        )
        return segmentId

    @staticmethod
    def _newSegmentation(referenceVolume):
        segmentationNode = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLSegmentationNode", "Tumour")
        segmentationNode.CreateDefaultDisplayNodes()
        segmentationNode.SetReferenceImageGeometryParameterFromVolumeNode(referenceVolume)
        return segmentationNode

    def test_StudyFromNodes(self):
        self.delayDisplay("Starting the study-from-nodes test")
        t1, t1Array, affine = self._syntheticVolume("Case7_T1c")
        flair, flairArray, _unused = self._syntheticVolume("Case 7 FLAIR scan")
        segmentationNode = self._newSegmentation(t1)
        core = self._box(t1Array.shape, (3, 6), (4, 8), (5, 9))
        oedema = self._box(t1Array.shape, (2, 8), (2, 10), (3, 11)) & ~core
        self._addSegment(segmentationNode, "Tumor core", core, t1)
        self._addSegment(segmentationNode, "Oedema", oedema, t1)
        nodesBefore = slicer.mrmlScene.GetNumberOfNodes()

        logic = NeuralRaycastLogic()
        study = logic.studyFromNodes([t1, flair], segmentationNode)

        self.assertEqual(study.shape, tuple(reversed(t1Array.shape)))  # IJK order
        np.testing.assert_allclose(study.affine, affine)
        self.assertEqual(study.channel_names, ["t1ce", "case_7_flair_scan"])
        np.testing.assert_array_equal(study.channels["t1ce"], t1Array.transpose(2, 1, 0))
        np.testing.assert_array_equal(study.channels["case_7_flair_scan"], flairArray.transpose(2, 1, 0))
        self.assertEqual(study.structures, {"tumor_core": (1,), "oedema": (2,)})
        for name, segmentName in (("tumor_core", "Tumor core"), ("oedema", "Oedema")):  # renders use segment colours
            segmentation = segmentationNode.GetSegmentation()
            segment = segmentation.GetSegment(segmentation.GetSegmentIdBySegmentName(segmentName))
            np.testing.assert_allclose(study.colors[name], segment.GetColor())
        np.testing.assert_array_equal(study.labels == 1, core.transpose(2, 1, 0))
        np.testing.assert_array_equal(study.labels == 2, oedema.transpose(2, 1, 0))
        self.assertEqual(slicer.mrmlScene.GetNumberOfNodes(), nodesBefore, "temporary export nodes were left behind")

        # A volume on another grid is refused, naming the node.
        moved, _array, _affine = self._syntheticVolume("Shifted", ijkToRas=affine + _shift(5.0))
        with self.assertRaisesRegex(ValueError, "Shifted"):
            logic.studyFromNodes([t1, moved])
        self.delayDisplay("Test passed")

    def test_OverlappingSegmentsAndTransforms(self):
        self.delayDisplay("Starting the overlap and transform test")
        t1, t1Array, affine = self._syntheticVolume("t1")
        segmentationNode = self._newSegmentation(t1)
        whole = self._box(t1Array.shape, (2, 8), (2, 10), (3, 11))
        enhancing = self._box(t1Array.shape, (4, 6), (4, 6), (5, 7))
        self._addSegment(segmentationNode, "Whole tumor", whole, t1)
        self._addSegment(segmentationNode, "Enhancing", enhancing, t1)

        # A linear parent transform moves the volume (and the segmentation, observed by the same transform).
        transformNode = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLLinearTransformNode", "Shift")
        transformNode.SetMatrixTransformToParent(slicer.util.vtkMatrixFromArray(np.eye(4) + _shift(7.0)))
        t1.SetAndObserveTransformNodeID(transformNode.GetID())
        segmentationNode.SetAndObserveTransformNodeID(transformNode.GetID())

        logic = NeuralRaycastLogic()
        study = logic.studyFromNodes([t1], segmentationNode)
        np.testing.assert_allclose(study.affine, (np.eye(4) + _shift(7.0)) @ affine)
        self.assertEqual(set(study.structures), {"whole_tumor", "enhancing"})
        wholeLabels = np.isin(study.labels, study.structures["whole_tumor"])
        enhancingLabels = np.isin(study.labels, study.structures["enhancing"])
        np.testing.assert_array_equal(wholeLabels, whole.transpose(2, 1, 0))
        np.testing.assert_array_equal(enhancingLabels, enhancing.transpose(2, 1, 0))

        # A non-linear parent transform is refused.
        warp = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLTransformNode", "Warp")
        thinPlate = vtk.vtkThinPlateSplineTransform()
        source, target = vtk.vtkPoints(), vtk.vtkPoints()
        for point in ((0, 0, 0), (30, 0, 0), (0, 30, 0), (0, 0, 30)):
            source.InsertNextPoint(point)
            target.InsertNextPoint(point[0] + 1, point[1], point[2])
        thinPlate.SetSourceLandmarks(source)
        thinPlate.SetTargetLandmarks(target)
        thinPlate.SetBasisToR()
        warp.SetAndObserveTransformToParent(thinPlate)
        t1.SetAndObserveTransformNodeID(warp.GetID())
        with self.assertRaisesRegex(ValueError, "non-linear"):
            logic.studyFromNodes([t1], segmentationNode)
        self.delayDisplay("Test passed")

    @staticmethod
    def gpuUnavailableReason() -> str | None:
        """Why no device opens here (no slangpy, no GPU or Vulkan driver), or None where one does."""
        from NeuralRaycastLib.gpu.device import GpuUnavailableError

        try:
            NeuralRaycastLogic.gpuContext("auto")
        except (GpuUnavailableError, ImportError) as error:
            return str(error)
        return None

    def phantomInScene(self, folder: str, spacing: float = 2.0):
        """The analytic phantom sample as four volumes and a three-segment segmentation (the way the
        Sample Data button adds a sample), with the segments' masks (IJK)."""
        from NeuralRaycastLib.study.study import load_study

        volumes, segmentationNode = NeuralRaycastLogic().loadSampleStudy(folder, "phantom", spacing)
        study = load_study(os.path.join(folder, "manifest.json"))
        masks = {
            name.replace("_", " ").capitalize(): np.isin(study.labels, values)
            for name, values in study.structures.items()
        }
        return study, volumes, segmentationNode, masks

    def test_TrainRenderModels(self):
        """End to end on a tiny phantom: train, render a camera into a volume, one model per segment."""
        import tempfile
        from dataclasses import replace

        from NeuralRaycastLib.train.presets import training_schedule

        logic = NeuralRaycastLogic()
        if reason := self.gpuUnavailableReason():  # build machines of the Extensions Index have no GPU
            logging.warning(f"Skipped the train, render and models test: {reason}")
            self.delayDisplay(f"Skipped the train, render and models test: {reason}")
            return
        self.delayDisplay("Starting the train, render and models test (about a minute on a CPU)")
        # Mostly geometry (what the models show), a few rendering steps.
        quick = training_schedule("quick")
        schedule = replace(quick, geometry=replace(quick.geometry, steps=150), appearance_steps=4, joint_steps=4,
                           eval_every=8)
        with tempfile.TemporaryDirectory() as folder:
            study, volumes, segmentationNode, masks = self.phantomInScene(folder)
            nodesBefore = slicer.mrmlScene.GetNumberOfNodes()
            run = logic.train(volumes, segmentationNode, preset="quick", views=4, size=32, config=schedule,
                              runFolder=os.path.join(folder, "run"))
            self.assertEqual(slicer.mrmlScene.GetNumberOfNodes(), nodesBefore, "training must not change the scene")
            self.assertTrue(os.path.isfile(os.path.join(folder, "run", "model.safetensors")))
            self.assertFalse(run.log.cancelled)

            # A render of a camera node's view: an RGB volume of the requested size, not blank.
            cameraNode = slicer.mrmlScene.AddNewNodeByClass("vtkMRMLCameraNode", "test camera")
            values = run.views.cameras[0].to_slicer()
            cameraNode.SetPosition(values["position"])
            cameraNode.SetFocalPoint(values["focal_point"])
            cameraNode.SetViewUp(values["view_up"])
            cameraNode.SetViewAngle(values["view_angle"])
            renderNode = logic.renderCamera(logic.cameraFromNode(cameraNode, (48, 40)))
            pixels = slicer.util.arrayFromVolume(renderNode)
            self.assertEqual(pixels.shape, (1, 40, 48, 3))
            self.assertEqual(renderNode.GetImageData().GetNumberOfScalarComponents(), 3)
            covered = (pixels.max(axis=-1) > 10).mean()
            self.assertGreater(covered, 0.1, "the render is blank")
            self.assertLess(covered, 0.95, "the render has no background")

            # One model per segment (and the brain), named and coloured after it, bounds as the segment's.
            models = logic.createModels(smoothingIterations=0)
            byName = {model.GetName(): model for model in models}
            spacing = float(np.linalg.norm(study.affine[:3, :3], axis=0).max())
            for segmentName, mask in masks.items():
                model = byName[f"{segmentName} (neural)"]
                segment = segmentationNode.GetSegmentation().GetSegment(
                    segmentationNode.GetSegmentation().GetSegmentIdBySegmentName(segmentName)
                )
                np.testing.assert_allclose(model.GetDisplayNode().GetColor(), segment.GetColor(), atol=1e-6)
                ijk = np.argwhere(mask)  # IJK, as the study's affine expects
                corners = np.array([ijk.min(axis=0) - 0.5, ijk.max(axis=0) + 0.5])
                ras = corners @ study.affine[:3, :3].T + study.affine[:3, 3]
                expected = np.ravel(np.column_stack([ras.min(axis=0), ras.max(axis=0)]))
                # a drawn (blocky) label's surface is smoothed over about a voxel: its corners round off
                np.testing.assert_allclose(model.GetPolyData().GetBounds(), expected, atol=1.5 * spacing,
                                           err_msg=f"bounds of the model of '{segmentName}'")
            # Creating them again updates the same nodes.
            self.assertEqual([node.GetID() for node in logic.createModels(smoothingIterations=0)],
                             [node.GetID() for node in models])

            # The learned surfaces as a segmentation (one segment per structure, named after its segment, with a
            # label map and a closed surface) and a table row per structure.
            segmentation = logic.createSegmentation(oversampling=1, smoothingIterations=0,
                                                    referenceVolumeNode=volumes[0]).GetSegmentation()
            names = [segmentation.GetNthSegment(index).GetName() for index in range(segmentation.GetNumberOfSegments())]
            self.assertTrue(set(masks) <= set(names), f"segments {names}")
            for index in range(segmentation.GetNumberOfSegments()):
                segment = segmentation.GetNthSegment(index)
                self.assertTrue(segment.GetRepresentation("Binary labelmap") is not None)
                self.assertGreater(segment.GetRepresentation("Closed surface").GetNumberOfCells(), 0)
            structuresTable, _piecesTable = logic.createResultsTables()
            self.assertEqual(structuresTable.GetTable().GetNumberOfRows(), len(run.prepared.structures))

            # A live view picture of a camera: premultiplied RGBA at the camera's size.
            self.assertEqual(logic.liveRender(logic.cameraFromNode(cameraNode, (32, 24))).shape, (24, 32, 4))

            # The trained model as a web page (Share as web page): the loaded model, whose study is the scene's.
            page = logic.sharePage(run.folder, os.path.join(folder, "page.html"))
            self.assertIn("default-src 'none'", page.read_text(encoding="utf-8"))
        self.delayDisplay("Test passed")


def _shift(millimetres: float) -> np.ndarray:
    """A 4x4 matrix that adds a translation of ``millimetres`` along R, A and S when added to a transform."""
    shift = np.zeros((4, 4))
    shift[:3, 3] = millimetres
    return shift
