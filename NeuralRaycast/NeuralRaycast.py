"""Neural Raycast: fit a neural signed-distance + appearance field to a brain MRI study and render it.

The heavy lifting lives in ``NeuralRaycastLib`` (no Slicer imports there); this file holds the Slicer
module, its parameter node, widget, logic and self-test. Nothing heavy (slangpy, scikit-image) is
imported here at load time: dependencies are checked and installed when the user presses Apply.
"""

import importlib.metadata
import logging
import os
import re
import sys
import time
from typing import Annotated

import numpy as np
import slicer
import vtk
from slicer import vtkMRMLScalarVolumeNode, vtkMRMLSegmentationNode
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

# NeuralRaycastLib sits beside this file in an installed extension and one folder up in the source tree.
try:
    import NeuralRaycastLib
except ModuleNotFoundError as _error:
    if _error.name != "NeuralRaycastLib":
        raise
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import NeuralRaycastLib

MODULE_NAME = "NeuralRaycast"
README_URL = "https://github.com/SlicerNeuralRaycast/SlicerNeuralRaycast#readme"
PRESETS = ("quick", "standard", "high")
DEVICES = ("auto", "cuda", "vulkan")
#: Extra channels beside the reference volume (the parameter node wrapper has no GUI for node lists).
ADDITIONAL_VOLUME_PARAMETERS = ("inputVolume2", "inputVolume3", "inputVolume4")


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
preset and press Apply. Missing Python packages are installed on first use, after asking.
See the <a href="{url}">project documentation</a> for details. Version {version}.
"""
        ).format(url=README_URL, version=NeuralRaycastLib.__version__)
        self.parent.acknowledgementText = _(
            """
Developed by the SlicerNeuralRaycast authors. Rendering and training use
<a href="https://github.com/shader-slang/slangpy">slangpy</a> and the Slang shading language;
image processing uses NumPy, SciPy, scikit-image and nibabel.
"""
        )


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
    preset - training quality preset.
    device - slangpy device: auto, cuda or vulkan.
    seed - random seed for reproducible training.
    iterations - training iterations; 0 uses the preset's number.
    """

    inputVolume: vtkMRMLScalarVolumeNode
    inputVolume2: vtkMRMLScalarVolumeNode
    inputVolume3: vtkMRMLScalarVolumeNode
    inputVolume4: vtkMRMLScalarVolumeNode
    inputSegmentation: vtkMRMLSegmentationNode
    probabilityVolume: vtkMRMLScalarVolumeNode
    preset: Annotated[str, Choice(list(PRESETS))] = "standard"
    device: Annotated[str, Choice(list(DEVICES))] = "auto"
    seed: Annotated[int, WithinRange(0, 2**31 - 1)] = 0
    iterations: Annotated[int, WithinRange(0, 1_000_000)] = 0

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
        self._resetProgress()

        self.initializeParameterNode()

    def cleanup(self) -> None:
        """Called when the application closes and the module widget is destroyed."""
        self.removeObservers()

    def enter(self) -> None:
        """Called each time the user opens this module."""
        self.initializeParameterNode()

    def exit(self) -> None:
        """Called each time the user opens a different module."""
        if self._parameterNode:
            self._parameterNode.disconnectGui(self._parameterNodeGuiTag)
            self._parameterNodeGuiTag = None
            self.removeObserver(self._parameterNode, vtk.vtkCommand.ModifiedEvent, self._checkCanApply)

    def onSceneStartClose(self, caller, event) -> None:
        """Called just before the scene is closed."""
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
        if self._parameterNode and self._parameterNode.inputVolume:
            self.ui.applyButton.toolTip = _("Check the inputs and prepare the study for training")
            self.ui.applyButton.enabled = True
        else:
            self.ui.applyButton.toolTip = _("Select at least the reference input volume")
            self.ui.applyButton.enabled = False

    def _resetProgress(self) -> None:
        self.ui.progressBar.setRange(0, 100)
        self.ui.progressBar.value = 0
        self.ui.progressBar.setFormat("%p%")

    def _onProgress(self, message: str, fraction: float) -> None:
        self.ui.progressBar.value = int(round(100 * min(max(fraction, 0.0), 1.0)))
        self.ui.progressBar.setFormat(f"{message} %p%")
        slicer.util.showStatusMessage(message)
        slicer.app.processEvents()

    def onApplyButton(self) -> None:
        """Check dependencies, read the selected nodes into a study and prepare it; show a summary."""
        if self._running:
            return
        parameters = self._parameterNode
        self._running = True
        self.ui.applyButton.enabled = False
        self._resetProgress()
        self.ui.resultsText.setPlainText("")
        try:
            with slicer.util.tryWithErrorDisplay(_("Failed to prepare the study."), waitCursor=True):
                self.logic.ensureDependencies()
                self._onProgress(_("reading volumes and segmentation"), 0.0)
                study = self.logic.studyFromNodes(
                    parameters.volumeNodes(), parameters.inputSegmentation, parameters.probabilityVolume
                )
                prepared = self.logic.prepareStudy(study, progress=self._onProgress)
                self.ui.resultsText.setPlainText(self.logic.summaryText(prepared))
                self._onProgress(_("study ready"), 1.0)
        finally:
            self._running = False
            self._checkCanApply()


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

    def getParameterNode(self):
        return NeuralRaycastParameterNode(super().getParameterNode())

    # -- dependencies ---------------------------------------------------------------------------------

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

    def ensureDependencies(self, requirementsPath: str | None = None) -> None:
        """Install the Python packages of ``Resources/requirements.txt`` that are missing, after asking.

        Uses ``slicer.packaging.pip_ensure`` (Slicer 5.12 and later), else ``slicer.util.pip_install``
        after a confirmation. Raises RuntimeError if the user declines. Call it when the packages are
        needed (on Apply), never at import time.
        """
        path = requirementsPath or self.requirementsPath()
        try:
            import slicer.packaging as packaging
        except ImportError:
            packaging = None
        if packaging is not None and hasattr(packaging, "pip_ensure"):
            packaging.pip_ensure(packaging.load_requirements(path), requester=MODULE_NAME)
            return

        missing = [requirement for requirement in self._readRequirements(path) if not self._isSatisfied(requirement)]
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
        slicer.util.pip_install(missing)

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
        from NeuralRaycastLib.study import BRATS_CHANNELS

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
    def _checkSameGrid(volumeNode, array: np.ndarray, affine: np.ndarray, refNode, refShape, refAffine) -> None:
        """Raise ValueError unless ``volumeNode`` lies on the reference grid (same shape, corners within a
        tenth of a voxel)."""
        from NeuralRaycastLib.study import GRID_TOLERANCE_VOXELS, grid_corners

        if array.shape[:3] != refShape[:3]:
            raise ValueError(
                f"Volume '{volumeNode.GetName()}' has {array.shape[2]} x {array.shape[1]} x {array.shape[0]} voxels "
                f"(IJK) but the reference '{refNode.GetName()}' has {refShape[2]} x {refShape[1]} x {refShape[0]}; "
                "resample it onto the reference volume first"
            )
        shapeIjk = tuple(refShape[:3][::-1])
        offset = float(np.abs(grid_corners(affine, shapeIjk) - grid_corners(refAffine, shapeIjk)).max())
        tolerance = GRID_TOLERANCE_VOXELS * float(np.linalg.norm(refAffine[:3, :3], axis=0).min())
        if offset > tolerance:
            raise ValueError(
                f"Volume '{volumeNode.GetName()}' is not on the grid of the reference '{refNode.GetName()}' "
                f"(corners differ by up to {offset:.2f} mm); register and resample it onto the reference first"
            )

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
                masks[self._sanitizedName(segmentName, "segment", used)] = mask
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

    def studyFromNodes(self, volumeNodes, segmentationNode=None, probabilityNode=None):
        """Build a checked ``NeuralRaycastLib.study.Study`` from scene nodes.

        :param volumeNodes: scalar volumes, the reference channel first; all must share its grid.
        :param segmentationNode: optional segmentation; exported onto the reference grid, one structure
            per non-empty segment, named after it.
        :param probabilityNode: optional tumour probability volume in [0, 1] on the reference grid.
        :return: the study; arrays are IJK ordered, ``affine`` is IJK -> world RAS (parent transforms included).
        Raises ValueError (``StudyError`` is one) naming the node at fault.
        """
        from NeuralRaycastLib.study import Study

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
            array = refArray if node is reference else self._volumeArray(node)
            if node is not reference:
                self._checkSameGrid(node, array, self.ijkToWorldMatrix(node), reference, refArray.shape, refAffine)
            channels[self.channelName(node.GetName(), used)] = array

        probability = None
        if probabilityNode is not None:
            probability = self._volumeArray(probabilityNode)
            probabilityAffine = self.ijkToWorldMatrix(probabilityNode)
            self._checkSameGrid(probabilityNode, probability, probabilityAffine, reference, refArray.shape, refAffine)

        labels, structures = None, None
        if segmentationNode is not None:
            labels, structures = self.segmentationLabels(segmentationNode, reference)

        study = Study.from_arrays(
            channels,
            refAffine,
            labels=labels,
            probability=probability,
            structures=structures,
            name=reference.GetName(),
            axis_order="kji",
        )
        logging.info(f"Study '{study.name}' read from the scene in {time.time() - startTime:.2f} s")
        return study

    # -- preparation ----------------------------------------------------------------------------------

    def prepareStudy(self, study, progress=None):
        """Brain mask, boundary maps and tumour probability (``NeuralRaycastLib.preprocess.prepare``).

        :param progress: optional ``callback(message: str, fraction: float)``.
        """
        from NeuralRaycastLib.preprocess import prepare

        startTime = time.time()
        prepared = prepare(study, progress=progress)
        logging.info(f"Study '{study.name}' prepared in {time.time() - startTime:.2f} s")
        return prepared

    @staticmethod
    def summaryText(prepared) -> str:
        from NeuralRaycastLib.summary import study_summary, summary_text

        return summary_text(study_summary(prepared))


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

    @staticmethod
    def _syntheticVolume(name, shapeKji=(10, 12, 14), ijkToRas=None):
        k, j, i = np.meshgrid(*(np.arange(n) for n in shapeKji), indexing="ij")
        array = (100 + 10 * i + 3 * j + k).astype(np.int16)
        if ijkToRas is None:
            ijkToRas = np.array([[-1.5, 0, 0, 20.0], [0, -1.2, 0, 30.0], [0, 0, 2.0, -40.0], [0, 0, 0, 1]])
        volume = slicer.util.addVolumeFromArray(array, ijkToRAS=ijkToRas, name=name)
        return volume, array, np.asarray(ijkToRas, dtype=float)

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
        core = np.zeros(t1Array.shape, dtype=bool)
        core[3:6, 4:8, 5:9] = True
        oedema = np.zeros(t1Array.shape, dtype=bool)
        oedema[2:8, 2:10, 3:11] = True
        oedema &= ~core
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
        whole = np.zeros(t1Array.shape, dtype=bool)
        whole[2:8, 2:10, 3:11] = True
        enhancing = np.zeros(t1Array.shape, dtype=bool)
        enhancing[4:6, 4:6, 5:7] = True
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


def _shift(millimetres: float) -> np.ndarray:
    """A 4x4 matrix that adds a translation of ``millimetres`` along R, A and S when added to a transform."""
    shift = np.zeros((4, 4))
    shift[:3, 3] = millimetres
    return shift
