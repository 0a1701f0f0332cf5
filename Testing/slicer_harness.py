"""Slicer without its application, for headless tests of the NeuralRaycast module.

The MRML scene, the node classes and the module logics (segmentations, volumes, colours) are the real
ones from the ``slicer-core`` package. What only the Slicer application provides is stood in for by the
small classes below: ``slicer.app``, ``slicer.modules``, ``slicer.i18n``, ``slicer.ScriptedLoadableModule``
and ``slicer.parameterNodeWrapper`` (values kept as parameters and node references of the real
``vtkMRMLScriptedModuleNode``, so saving and reloading a scene exercises real MRML serialisation).
GUI classes (the Widget) are not exercised here.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types
import typing
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULE_FILE = ROOT / "NeuralRaycast" / "NeuralRaycast.py"


# --- parameter node wrapper ----------------------------------------------------------------------------


class WithinRange:
    def __init__(self, minimum, maximum) -> None:
        self.minimum, self.maximum = minimum, maximum

    def validate(self, value) -> None:
        if not self.minimum <= value <= self.maximum:
            raise ValueError(f"{value} is not within [{self.minimum}, {self.maximum}]")


class Choice:
    def __init__(self, choices) -> None:
        self.choices = list(choices)

    def validate(self, value) -> None:
        if value not in self.choices:
            raise ValueError(f"{value!r} is not one of {self.choices}")


def _is_node_type(kind) -> bool:
    import slicer

    return isinstance(kind, type) and issubclass(kind, slicer.vtkMRMLNode)


_TEXT = {
    bool: (lambda value: "true" if value else "false", lambda text: text == "true"),
    int: (str, int),
    float: (repr, float),
    str: (str, str),
    pathlib.Path: (str, pathlib.Path),
}


def parameterNodeWrapper(cls):
    """Typed attributes stored in a scripted module node: nodes as references, the rest as text."""
    fields = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        kind, validators = hint, ()
        if typing.get_origin(hint) is typing.Annotated:
            kind, *validators = typing.get_args(hint)
        default = cls.__dict__.get(name, None if _is_node_type(kind) else kind())
        fields[name] = (kind, tuple(validators), default)

    def make_property(name, kind, validators):
        if _is_node_type(kind):
            return property(lambda self: self.parameterNode.GetNodeReference(name),
                            lambda self, node: self.parameterNode.SetNodeReferenceID(
                                name, node.GetID() if node is not None else None))
        to_text, from_text = _TEXT[kind]

        def setter(self, value):
            value = kind(value)
            for validator in validators:
                validator.validate(value)
            self.parameterNode.SetParameter(name, to_text(value))

        return property(lambda self: from_text(self.parameterNode.GetParameter(name)), setter)

    namespace = {name: value for name, value in vars(cls).items() if callable(value) and not name.startswith("__")}
    for name, (kind, validators, _default) in fields.items():
        namespace[name] = make_property(name, kind, validators)

    def __init__(self, parameterNode):
        self.parameterNode = parameterNode
        for name, (kind, _validators, default) in fields.items():
            if not _is_node_type(kind) and not parameterNode.GetParameterNames().count(name):
                setattr(self, name, default)

    namespace["__init__"] = __init__
    namespace["allParameters"] = fields
    namespace["connectGui"] = lambda self, ui: None
    namespace["disconnectGui"] = lambda self, tag: None
    return type(cls.__name__, (), namespace)


# --- scripted module base classes ------------------------------------------------------------------------


class ScriptedLoadableModule:
    def __init__(self, parent) -> None:
        self.parent = parent
        self.moduleName = type(self).__name__


class ScriptedLoadableModuleWidget:
    def __init__(self, parent=None) -> None:
        self.parent = parent


class ScriptedLoadableModuleLogic:
    def __init__(self, parent=None) -> None:
        self.moduleName = type(self).__name__.removesuffix("Logic")

    def getParameterNode(self):
        """The scene's one scripted module node of this module (created on first use)."""
        import slicer

        scene = slicer.mrmlScene
        for index in range(scene.GetNumberOfNodesByClass("vtkMRMLScriptedModuleNode")):
            node = scene.GetNthNodeByClass(index, "vtkMRMLScriptedModuleNode")
            if node.GetAttribute("ModuleName") == self.moduleName:
                return node
        node = slicer.vtkMRMLScriptedModuleNode()
        node.SetName(scene.GetUniqueNameByString(self.moduleName))
        node.SetAttribute("ModuleName", self.moduleName)
        scene.AddNode(node)
        return node


class ScriptedLoadableModuleTest(unittest.TestCase):
    def delayDisplay(self, message, msec=None) -> None:
        pass


class _App:
    def processEvents(self) -> None:
        pass

    def testingEnabled(self) -> bool:
        return True


# --- installation --------------------------------------------------------------------------------------------


def install():
    """Give ``slicer`` a fresh scene with the module logics the NeuralRaycast module needs; returns the scene."""
    import slicer

    scene = slicer.vtkMRMLScene()
    application = slicer.vtkSlicerApplicationLogic()
    application.SetMRMLScene(scene)
    colors = slicer.vtkMRMLColorLogic()  # the default colour tables (Slicer's file-based ones need its install)
    colors.SetMRMLScene(scene)
    application.SetColorLogic(colors)
    application.SetModuleLogic("Colors", colors)
    logics = {}
    for name, cls in (("segmentations", slicer.vtkSlicerSegmentationsModuleLogic),
                      ("volumes", slicer.vtkSlicerVolumesLogic), ("models", slicer.vtkSlicerModelsLogic)):
        logic = cls()  # registered before any node exists (segmentations copy converter rules at creation)
        logic.SetMRMLApplicationLogic(application)
        logic.SetMRMLScene(scene)
        logics[name] = logic
    slicer.mrmlScene = scene
    slicer.app = _App()
    slicer.modules = types.SimpleNamespace(**{name: types.SimpleNamespace(logic=lambda logic=logic: logic)
                                              for name, logic in logics.items()})
    slicer._harness_logics = (application, colors, logics)  # keep them alive

    i18n = types.ModuleType("slicer.i18n")
    i18n.tr = lambda text: text
    i18n.translate = lambda context, text: text
    scripted = types.ModuleType("slicer.ScriptedLoadableModule")
    for item in (ScriptedLoadableModule, ScriptedLoadableModuleWidget, ScriptedLoadableModuleLogic,
                 ScriptedLoadableModuleTest):
        setattr(scripted, item.__name__, item)
    wrapper = types.ModuleType("slicer.parameterNodeWrapper")
    wrapper.parameterNodeWrapper, wrapper.WithinRange, wrapper.Choice = parameterNodeWrapper, WithinRange, Choice
    for module in (i18n, scripted, wrapper):
        sys.modules[module.__name__] = module
        setattr(slicer, module.__name__.split(".")[1], module)
    return scene


def load_module():
    """Import NeuralRaycast/NeuralRaycast.py (the Slicer module file) as the module ``NeuralRaycast``."""
    install()
    spec = importlib.util.spec_from_file_location("NeuralRaycast", MODULE_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["NeuralRaycast"] = module
    spec.loader.exec_module(module)
    return module
