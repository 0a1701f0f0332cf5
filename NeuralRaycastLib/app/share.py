"""A trained run as one web page: the field rendered live in the browser through WebGPU.

The page's renderer is WGSL that the Slang compiler shipped with slangpy generates from the project's own
shaders at share time: the field's sizes as #defines, then shaders/field_render.slang and
shaders/web_render.slang, compiled for the ``wgsl`` target with ``NEURALRAYCAST_WEB`` defined (the shaders'
storage-buffer variant: WGSL has no pointers), through the compiler's C compile-request interface
(:func:`compile_wgsl`). The page carries that WGSL, the field's parameters and the appearance network's
local inputs in float16, the occupancy grid, the look and the structures' names and colours; nothing else
of the study (no names, dates or paths from its files). A content security policy forbids every request.
"""

from __future__ import annotations

import base64
import ctypes
import gzip
import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..field.field import FieldLayout, field_source
from ..gpu.device import structure_slots
from ..paths import shader_dir

if TYPE_CHECKING:
    from ..train.run_folder import TrainedRun

#: The kernel files of the page's module, after the field's sizes (field.py's field_source).
WEB_PARTS = ("field_render", "web_render")
WEB_ENTRY = "renderPixel"
#: The buffers web_render.slang declares, as the page binds them.
WEB_BUFFERS = ("webScene", "webParameters", "webInputs", "webCells", "webNearest", "webView", "webPixels")
#: Every request is refused: scripts and styles are inline, pictures are drawn by the script.
CONTENT_POLICY = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:"
VIEW_FLOATS = 16  # web_render.slang's readView
STYLE_STRUCTURES = 8  # the entries of image_formation.slang's Look, which readScene reads


class ShaderCompileError(RuntimeError):
    """The Slang compiler could not make WGSL of the page's shaders."""


def _slang_library() -> ctypes.CDLL:
    """The Slang compiler library slangpy ships (the one that compiles the desktop kernels)."""
    import slangpy

    folder = Path(slangpy.__file__).parent
    candidates = sorted(folder.glob("libslang-compiler.so*")) + sorted(folder.glob("libslang.so*")) + \
        sorted(folder.glob("slang-compiler.dll")) + sorted(folder.glob("slang.dll")) + \
        sorted(folder.glob("libslang-compiler*.dylib")) + sorted(folder.glob("libslang*.dylib"))
    if not candidates:
        raise ShaderCompileError(f"no Slang compiler library in {folder}: reinstall slangpy")
    lib = ctypes.CDLL(str(candidates[0]))
    lib.spCreateSession.restype = ctypes.c_void_p
    lib.spCreateSession.argtypes = [ctypes.c_char_p]
    lib.spCreateCompileRequest.restype = ctypes.c_void_p
    lib.spCreateCompileRequest.argtypes = [ctypes.c_void_p]
    lib.spProcessCommandLineArguments.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_int]
    lib.spCompile.argtypes = [ctypes.c_void_p]
    lib.spGetDiagnosticOutput.restype = ctypes.c_char_p
    lib.spGetDiagnosticOutput.argtypes = [ctypes.c_void_p]
    lib.spGetEntryPointSource.restype = ctypes.c_char_p
    lib.spGetEntryPointSource.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.spDestroyCompileRequest.argtypes = [ctypes.c_void_p]
    lib.spDestroySession.argtypes = [ctypes.c_void_p]
    return lib


def web_source(layout: FieldLayout) -> str:
    """The page's Slang module: the field's sizes, then its render-only kernel."""
    return field_source(layout, WEB_PARTS)


def compile_wgsl(source: str, structures: int) -> str:
    """WGSL of ``source``'s renderPixel, from the Slang compiler, with the defines the desktop kernels get
    (STRUCTURE_SLOTS) and NEURALRAYCAST_WEB."""
    import slangpy as spy

    lib = _slang_library()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "web_field.slang"
        path.write_text(source)
        args = [str(path), "-target", "wgsl", "-entry", WEB_ENTRY, "-stage", "compute",
                "-I", str(spy.SHADER_PATH), "-I", str(shader_dir()),
                "-D", "NEURALRAYCAST_WEB=1", "-D", "NEURALRAYCAST_CUDA_SM=0",
                "-D", f"STRUCTURE_SLOTS={structure_slots(structures)}"]
        session = lib.spCreateSession(None)
        request = lib.spCreateCompileRequest(session)
        try:
            argv = (ctypes.c_char_p * len(args))(*[a.encode() for a in args])
            if lib.spProcessCommandLineArguments(request, argv, len(args)) < 0:
                raise ShaderCompileError(f"the Slang compiler refused its arguments {args}")
            failed = lib.spCompile(request) < 0
            diagnostics = (lib.spGetDiagnosticOutput(request) or b"").decode(errors="replace")
            code = lib.spGetEntryPointSource(request, 0)
            if failed or not code:
                errors = [line for line in diagnostics.splitlines() if "error" in line]
                raise ShaderCompileError("the page's shaders did not compile to WGSL: "
                                         + " | ".join(errors[:5] or [diagnostics[-500:]]))
            return code.decode()
        finally:
            lib.spDestroyCompileRequest(request)
            lib.spDestroySession(session)


def wgsl_bindings(wgsl: str) -> dict[str, int]:
    """The binding of each of web_render.slang's buffers in the generated WGSL (every one in group 0)."""
    found = {name: int(binding) for binding, name in
             re.findall(r"@binding\((\d+)\)\s*@group\(0\)\s*var(?:<[^>]*>)?\s+(\w+?)(?:_\d+)?\s*:", wgsl)}
    missing = [name for name in ("webScene", "webView", "webPixels") if name not in found]
    if missing:
        raise ShaderCompileError(f"the generated WGSL lacks the buffers {missing}")
    return {name: found[name] for name in WEB_BUFFERS if name in found}


def _int_bits(values) -> np.ndarray:
    return np.asarray(values, np.int32).view(np.float32)


@dataclass
class WebScene:
    """What the page's kernel reads, as flat arrays (web_render.slang's readScene and buffers)."""

    scene: np.ndarray        # float32, readScene's order
    parameters: np.ndarray   # float32, the field's
    inputs: np.ndarray       # float32 (I, J, K, V): the page pads each voxel's V values to whole float4s
    cells: np.ndarray        # int32, the occupancy grid
    nearest: np.ndarray      # float32
    structures: list[dict]   # name and display colour (sRGB 0..255) of each structure
    bounds: np.ndarray       # (2, 3) RAS box of the structures
    max_samples: int
    input_count: int         # V


class SceneWriter:
    """Web_render.slang's scene constants in readScene's order, as float32 (integers as their bits)."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []

    def put(self, *values: float) -> None:
        self.parts.append(np.asarray(values, np.float32).reshape(-1))

    def put_int(self, *values: int) -> None:
        self.parts.append(_int_bits(values).reshape(-1))

    def field(self, field) -> None:
        layout = field.layout
        for level in layout.levels:
            self.put_int(*level.dims)
            self.put(1.0 / level.cell_mm)
            self.put_int(level.offset, level.size)
        self.put(*layout.origin)
        # The kernel holds the field's capacity (field.py's FieldLayout.kernels): its offsets, the study's count.
        kernels = layout.kernels
        self.put_int(field.active_levels, layout.dense_levels, kernels.geometry_offset, kernels.appearance_offset,
                     layout.structures)
        self.put(layout.config.network.distance_scale_mm)

    def volumes(self, shape: tuple[int, ...], affine: np.ndarray, count: int) -> None:
        self.put_int(*shape, (count + 3) // 4)  # a voxel's float4s: the page pads its values to whole ones
        self.put(*np.linalg.inv(affine).reshape(-1))

    def occupancy(self, occupancy) -> None:
        z, y, x = occupancy.cells.shape
        self.put_int(x, y, z)
        self.put(*occupancy.origin)
        self.put(1.0 / occupancy.cell_mm, occupancy.reach_mm)
        self.put_int(int(occupancy.nearest is not None))

    def look(self, look: dict) -> None:
        if len(look["opticalDepth"]) != STYLE_STRUCTURES:
            raise ValueError(f"a look of {STYLE_STRUCTURES} structures expected, got {len(look['opticalDepth'])}")
        for k in range(STYLE_STRUCTURES):
            self.put(*_vector(look["color"][k]), look["opticalDepth"][k])
            self.put_int(look["channel"][k])
            self.put(*_vector(look["window"][k]), look["modulation"][k], look["specular"][k])

    def lighting(self, lighting: dict) -> None:
        self.put(lighting["ambient"], lighting["headlight"], lighting["key"], *_vector(lighting["keyDirection"]),
                 lighting["shininess"])
        self.put_int(lighting.get("shadows", 0))

    def march(self, renderer) -> None:
        settings = renderer.settings
        self.put(settings["epsilon"], settings["step"], settings["shadowStep"], *_vector(settings["boxMin"]),
                 *_vector(settings["boxMax"]))
        self.put(renderer.min_weight, renderer.shade_weight)
        self.put_int(renderer.max_samples)

    def values(self) -> np.ndarray:
        return np.concatenate(self.parts)


def web_scene(run: TrainedRun) -> WebScene:
    """The arrays of a trained run as the page's kernel reads them."""
    renderer, prepared = run.renderer, run.prepared
    inputs = np.concatenate([prepared.channels, prepared.probability[None]], axis=0).astype(np.float32)
    writer = SceneWriter()
    writer.field(run.field)
    writer.volumes(inputs.shape[1:], prepared.affine, inputs.shape[0])
    writer.occupancy(renderer.occupancy)
    writer.look(renderer.look)
    writer.lighting(renderer.shading["lighting"])
    writer.march(renderer)
    occupancy = renderer.occupancy
    inputs[:, ~read_voxels(prepared.affine, inputs.shape[1:], occupancy)] = 0.0  # never read: they pack to nothing
    nearest = occupancy.nearest if occupancy.nearest is not None else np.zeros(1, np.float32)
    structures = [{"name": s.name, "color": _display_colour(renderer.look["color"][k])}
                  for k, s in enumerate(prepared.structures)]
    parameters = run.field.layout.pad(run.field.parameters())  # as the kernel holds them: its capacity's layout
    return WebScene(writer.values(), parameters, np.moveaxis(inputs, 0, -1).reshape(-1),
                    np.ascontiguousarray(occupancy.cells, np.int32).reshape(-1),
                    np.asarray(nearest, np.float32).reshape(-1), structures,
                    np.asarray(prepared.bounds, np.float64), renderer.max_samples, inputs.shape[0])


def read_voxels(affine: np.ndarray, shape: tuple[int, ...], occupancy) -> np.ndarray:
    """The voxels the kernel's trilinear reads of the local inputs can reach: the appearance network reads them
    at the middles of shaded segments, which lie in occupied cells (ray_samples.slang), so the voxels of each
    occupied cell's box in voxel indices and one more on every side."""
    z, y, x = np.nonzero(occupancy.cells)
    low = np.asarray(occupancy.origin, np.float64) + occupancy.cell_mm * np.stack([x, y, z], axis=1)
    corners = np.stack([low + occupancy.cell_mm * np.array([(c >> 0) & 1, (c >> 1) & 1, (c >> 2) & 1], np.float64)
                        for c in range(8)])  # (8, N, 3) RAS
    to_ijk = np.linalg.inv(affine)
    ijk = corners @ to_ijk[:3, :3].T + to_ijk[:3, 3]
    dims = np.asarray(shape)
    first = np.clip(np.floor(ijk.min(axis=0)).astype(np.int64) - 1, 0, dims)
    last = np.clip(np.ceil(ijk.max(axis=0)).astype(np.int64) + 2, 0, dims)
    needed = np.zeros(shape, bool)
    for (i0, j0, k0), (i1, j1, k1) in zip(first, last, strict=True):
        needed[i0:i1, j0:j1, k0:k1] = True
    return needed


def _vector(value) -> tuple[float, ...]:
    """A vector of the shader structs (slangpy's float2/float3, or a sequence) as floats."""
    return tuple(float(v) for v in np.asarray(value, np.float64).reshape(-1))


def _display_colour(linear) -> list[int]:
    rgb = np.clip(np.asarray(_vector(linear), np.float64), 0.0, 1.0)
    return [int(round(255 * c)) for c in rgb]


def _packed(array: np.ndarray) -> str:
    """An array's bytes gzip-compressed (the browser's DecompressionStream unpacks them), in base64."""
    data = gzip.compress(np.ascontiguousarray(array).tobytes(), compresslevel=6, mtime=0)
    return base64.b64encode(data).decode("ascii")


def quantised_inputs(inputs: np.ndarray, count: int) -> dict[str, Any]:
    """The local inputs (each voxel's ``count`` values in turn) as one byte each, over each input's own range
    (``inputRanges``: low and high, the page maps byte b back to low + b / 255 · (high − low)). They are
    normalised intensities read trilinearly: a 256th of their range is far below what the appearance
    network's colours resolve, and the page holds half the bytes of float16."""
    values = np.asarray(inputs, np.float32).reshape(-1, count)
    low, high = values.min(axis=0), values.max(axis=0)
    span = np.where(high > low, high - low, 1.0)
    quantised = np.rint((values - low) / span * 255.0).astype(np.uint8)
    return {"inputs": _packed(quantised), "inputRanges": [[float(lo), float(hi)] for lo, hi in zip(low, high,
                                                                                                   strict=True)]}


def page_data(scene: WebScene, wgsl: str, mesh_shadows: bool) -> dict[str, Any]:
    """The page's model: the WGSL, its bindings, the arrays (float16 or bytes where they are large), the
    structures."""
    return {
        "wgsl": wgsl,
        "bindings": wgsl_bindings(wgsl),
        "scene": _packed(scene.scene.astype(np.float32)),
        "parameters": _packed(scene.parameters.astype(np.float16)),
        **quantised_inputs(scene.inputs, scene.input_count),
        "inputCount": scene.input_count,
        "cells": _packed(scene.cells.astype(np.uint8)),
        "nearest": _packed(scene.nearest.astype(np.float32)),
        "structures": scene.structures,
        "bounds": scene.bounds.tolist(),
        "meshShadows": mesh_shadows,
    }


def check_page_path(out: str | Path, overwrite: bool = False, replace_hint: str = "pass --overwrite") -> Path:
    """The page's path, checked before any work: a browser opens it by its ``.html`` name, and a page already
    there is kept unless replacing it was asked for (the command line's ``--overwrite``, a save dialog's
    confirmation; ``replace_hint`` says how, in the caller's words). Raises ValueError naming the path and what
    to do."""
    out = Path(out)
    if out.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"{out}: the page's file name must end in .html")
    if out.is_dir():
        raise ValueError(f"{out} is a folder: give the page's file name (ending in .html)")
    if out.exists() and not overwrite:
        raise ValueError(f"{out} exists: choose another file name or {replace_hint}")
    return out


def write_page(run: TrainedRun, out: str | Path) -> Path:
    """Write the page of a trained run to ``out`` (one self-contained HTML file); returns its path."""
    from ..appearance.latent_scene import LatentFieldScene

    if isinstance(run.renderer.scene, LatentFieldScene):  # the page's renderer knows the field's own network only
        raise ValueError(f"{run.folder}: the web page does not render the pretrained appearance yet; share a run "
                         "fitted with the per-study appearance network (fit without --appearance pretrained)")
    layout = run.field.layout
    wgsl = compile_wgsl(web_source(layout), layout.structures)
    scene = web_scene(run)
    data = page_data(scene, wgsl, run.renderer.mesh_shadows is not None)
    template = (Path(__file__).parent / "share_page.html").read_text()
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    html = template.replace("__CONTENT_POLICY__", CONTENT_POLICY).replace("__MODEL_JSON__", payload)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(html, encoding="utf-8")
    partial.replace(out)
    return out


def view_floats(camera) -> np.ndarray:
    """A camera (render/camera.py) as the page's view (web_render.slang's readView), every structure shown."""
    right, up, forward = camera.basis()
    values = [*camera.position, *right, *up, *forward, np.tan(np.radians(camera.view_angle) / 2),
              camera.width, camera.height, (1 << STYLE_STRUCTURES) - 1]
    view = np.asarray(values, np.float32)
    assert view.size == VIEW_FLOATS
    return view
