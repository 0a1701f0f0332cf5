"""Slicer without its application, for headless tests of the NeuralRaycast module.

The MRML scene, the node classes and the module logics (segmentations, volumes, colours) are the real
ones from the ``slicer-core`` package. What only the Slicer application provides is stood in for by the
small classes below: ``slicer.app``, ``slicer.modules``, ``slicer.i18n``, ``slicer.ScriptedLoadableModule``
and ``slicer.parameterNodeWrapper``. They behave as Slicer's do where a module can tell: the parameter node is
the scene's one singleton ``vtkMRMLScriptedModuleNode`` of the module (kept, and reset, when the scene is
cleared; merged into when a scene is imported), values are written as Slicer's serialisers write them (``True``
and ``False`` for booleans, ``str`` for numbers, node references for nodes), and ``connectGui`` binds the .ui's
widgets by their ``SlicerParameterName`` with the pairings of widget class and parameter type Slicer's GUI
connectors accept (those connectors need a Qt application, so the widgets here are stand-ins read from the
.ui file: :func:`load_ui`).
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


#: How Slicer's parameterNodeWrapper serialisers write and read each type (serializers.py there).
_TEXT = {
    bool: (lambda value: "True" if value else "False", lambda text: text == "True"),
    int: (str, int),
    float: (str, float),
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

        def getter(self):
            if not self.parameterNode.GetParameterNames().count(name):  # a reset node: the default, as Slicer reads
                setter(self, fields[name][2])
            return from_text(self.parameterNode.GetParameter(name))

        return property(getter, setter)

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
    namespace["AddObserver"] = lambda self, event, callback, priority=0.0: self.parameterNode.AddObserver(
        event, callback, priority)
    namespace["RemoveObserver"] = lambda self, tag: self.parameterNode.RemoveObserver(tag)
    namespace["Modified"] = lambda self: self.parameterNode.Modified()
    namespace["connectGui"] = _connect_gui
    namespace["disconnectGui"] = _disconnect_gui
    return type(cls.__name__, (), namespace)


# --- the .ui's widgets and their binding ------------------------------------------------------------------------


class Widget:
    """A stand-in for one widget of the .ui file: its class, name, properties and value. ``user_sets`` is what
    a user's edit does: the value changes and the widget's change signal reaches its listeners."""

    def __init__(self, class_name: str, name: str, properties: dict, items: list[str]) -> None:
        self.className, self.name, self.properties, self.items = class_name, name, properties, items
        self.enabled, self.toolTip, self.text = True, "", properties.get("text", "")
        self.minimum, self.maximum = properties.get("minimum", 0), properties.get("maximum", 99)
        self.nodeTypes = properties.get("nodeTypes", [])
        self.value, self.listeners, self.plainText, self.format = None, [], "", ""

    def property(self, name: str):
        return self.properties.get(name)

    def setRange(self, minimum, maximum) -> None:
        self.minimum, self.maximum = minimum, maximum

    def setFormat(self, text: str) -> None:
        self.format = text

    def setPlainText(self, text: str) -> None:
        self.plainText = text

    def user_sets(self, value) -> None:
        self.value = value
        for listener in list(self.listeners):
            listener(value)


def _property_value(element):
    child = next(iter(element))
    if child.tag == "bool":
        return child.text == "true"
    if child.tag == "number":
        return int(child.text)
    if child.tag == "stringlist":
        return [item.text for item in child.iter("string")]
    return child.text


def load_ui(path: pathlib.Path = ROOT / "NeuralRaycast" / "Resources" / "UI" / "NeuralRaycast.ui"):
    """The .ui file's named widgets as stand-ins, as attributes of one object (``slicer.util.childWidgetVariables``)."""
    import xml.etree.ElementTree as ET

    ui = types.SimpleNamespace()
    for element in ET.parse(path).iter("widget"):
        properties = {prop.get("name"): _property_value(prop) for prop in element.findall("property")}
        items = [item.find("property/string").text for item in element.findall("item")]
        setattr(ui, element.get("name"), Widget(element.get("class"), element.get("name"), properties, items))
    return ui


#: Widget classes Slicer's GUI connectors bind, by parameter type (guiConnectors.py there: canRepresent).
_CONNECTABLE = {
    bool: ("QCheckBox", "ctkCheckBox", "QPushButton", "ctkCheckablePushButton"),
    int: ("QSpinBox", "QSlider", "QDoubleSpinBox", "ctkSliderWidget", "ctkDoubleSpinBox", "qMRMLSliderWidget",
          "qMRMLSpinBox"),
    float: ("QDoubleSpinBox", "ctkSliderWidget", "ctkDoubleSpinBox", "qMRMLSliderWidget", "qMRMLSpinBox"),
    str: ("QLineEdit", "QLabel", "QTextEdit"),
    pathlib.Path: ("ctkPathLineEdit", "ctkDirectoryButton"),
}
_COMBO_BOXES = ("QComboBox", "ctkComboBox")


def _connector_error(widget: Widget, kind, validators) -> str | None:
    """Why Slicer's connectors would refuse to bind ``widget`` to a parameter of type ``kind``; None if they bind."""
    if _is_node_type(kind):
        return None if widget.className == "qMRMLNodeComboBox" else f"a {widget.className} cannot show a node"
    if widget.className in _COMBO_BOXES:
        if kind in (int, float, str, bool) and any(isinstance(v, Choice) for v in validators):
            return None
        return f"a {widget.className} needs a parameter annotated with Choice"
    if widget.className in _CONNECTABLE.get(kind, ()):
        return None
    return f"no GUI connector binds a {widget.className} to a {getattr(kind, '__name__', kind)} parameter"


def _connect_gui(self, ui):
    """Bind every widget of ``ui`` that names a parameter (``SlicerParameterName``) both ways, as Slicer does:
    the widget shows the parameter, the user's edits are validated and written to it. A widget naming no
    parameter, or one no connector binds to its parameter's type, raises as in Slicer."""
    fields = type(self).allParameters
    bindings = []
    for widget in vars(ui).values():
        name = widget.property("SlicerParameterName")
        if not name:
            continue
        if name not in fields:
            raise ValueError(f"widget '{widget.name}' is bound to '{name}', which is no parameter of "
                             f"{type(self).__name__}")
        kind, validators, _default = fields[name]
        if error := _connector_error(widget, kind, validators):
            raise TypeError(f"widget '{widget.name}' cannot be bound to '{name}': {error}")
        for validator in validators:  # as the connectors configure their widgets
            if isinstance(validator, WithinRange):
                widget.setRange(validator.minimum, validator.maximum)
            elif isinstance(validator, Choice) and widget.className in _COMBO_BOXES:
                widget.items = [str(choice) for choice in validator.choices]
        if _is_node_type(kind):
            widget.nodeTypes = [kind.__name__]
        widget.value = getattr(self, name)

        def write(value, name=name):
            setattr(self, name, value)

        widget.listeners.append(write)
        bindings.append((widget, name, write))

    def show(caller=None, event=None):
        for widget, name, _write in bindings:
            widget.value = getattr(self, name)

    observer = self.parameterNode.AddObserver("ModifiedEvent", show)
    return bindings, observer


def _disconnect_gui(self, tag) -> None:
    if tag is None:
        return
    bindings, observer = tag
    for widget, _name, write in bindings:
        widget.listeners.remove(write)
    self.parameterNode.RemoveObserver(observer)


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
        """The scene's singleton scripted module node of this module (created on first use), as Slicer's: its
        singleton tag is the module's name, so a cleared scene keeps it (reset) and an imported scene's is
        merged into it."""
        import slicer

        scene = slicer.mrmlScene
        node = scene.GetSingletonNode(self.moduleName, "vtkMRMLScriptedModuleNode")
        if node is not None:
            if node.GetAttribute("ModuleName") != self.moduleName:  # a scene close resets the attributes
                node.SetAttribute("ModuleName", self.moduleName)
            return node
        node = slicer.vtkMRMLScriptedModuleNode()
        node.SetSingletonTag(self.moduleName)
        node.SetAttribute("ModuleName", self.moduleName)
        node.SetName(scene.GenerateUniqueName(self.moduleName))
        return scene.AddNode(node)


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
