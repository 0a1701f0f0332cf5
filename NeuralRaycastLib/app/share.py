"""A trained run as one web page: the field rendered live in the browser through WebGPU.

The page's renderer is WGSL that the Slang compiler shipped with slangpy generates from the project's own
shaders at share time: the field's sizes as #defines, then shaders/field_render.slang and
shaders/web_render.slang, compiled for the ``wgsl`` target with ``NEURALRAYCAST_WEB`` defined (the shaders'
storage-buffer variant: WGSL has no pointers), through the compiler's C compile-request interface
(:func:`compile_wgsl`). The page carries that WGSL, the field's parameters (hash-grid entries one byte
each, networks in float16), the appearance network's local inputs (one byte each), the occupancy grid, the
look, the structures' names and colours and, for a run shaded through meshes, their BVH; nothing else of the
study (no names, dates or paths from its files). A content security policy forbids every request.
"""

from __future__ import annotations

import base64
import ctypes
import dataclasses
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
from ..grid import marked_corners
from ..paths import shader_dir

if TYPE_CHECKING:
    from ..train.run_folder import TrainedRun

#: The kernel files of the page's module, after the field's sizes (field.py's field_source).
WEB_PARTS = ("field_render", "web_render")
WEB_ENTRY = "renderPixel"
#: The buffers web_render.slang declares, as the page binds them.
WEB_BUFFERS = ("webScene", "webParameters", "webInputs", "webCells", "webNearest", "webView", "webPixels",
               "webBvh")
#: Every request is refused: scripts and styles are inline, pictures are drawn by the script.
CONTENT_POLICY = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:"
VIEW_FLOATS = 17  # web_render.slang's readView
STYLE_STRUCTURES = 8  # the entries of image_formation.slang's Look, which readScene reads
BVH_MAX_MESHES = 8  # bvh.slang's: the factors of mesh_shadows.slang's MeshShadowSettings


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
    layout: FieldLayout      # the kernels' (where ``parameters`` lie)
    bvh: Any = None          # the shadow meshes' BVH as the page holds it (leafier_bvh), None without them


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

    def mesh_shadows(self, shadows, bvh) -> None:
        """Whether the key light's visibility comes from meshes, where bvh.slang's web Bvh finds the arrays of
        the page's ``bvh`` in its one buffer (:func:`bvh_offsets`), and mesh_shadows.slang's
        MeshShadowSettings."""
        settings = shadows.settings if shadows is not None else {
            "offset": 0.0, "tMax": 0.0, "factors": [1.0] * BVH_MAX_MESHES, "ambientRays": 0, "ambientRadius": 0.0}
        self.put_int(int(shadows is not None), *bvh_offsets(bvh))
        self.put(settings["offset"], min(settings["tMax"], 3e38), *settings["factors"])
        self.put_int(settings["ambientRays"])
        self.put(settings["ambientRadius"])

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
    bvh = leafier_bvh(renderer.mesh_shadows.bvh) if renderer.mesh_shadows is not None else None
    writer.mesh_shadows(renderer.mesh_shadows, bvh)
    occupancy = renderer.occupancy
    inputs[:, ~read_voxels(prepared.affine, inputs.shape[1:], occupancy)] = 0.0  # never read: they pack to nothing
    nearest = np.zeros(1, np.float32)
    if occupancy.nearest is not None:  # zero where never read: it packs to nothing
        nearest = np.where(read_corners(occupancy), occupancy.nearest, 0.0).astype(np.float32)
    structures = [{"name": s.name, "color": _display_colour(renderer.look["color"][k])}
                  for k, s in enumerate(prepared.structures)]
    parameters = run.field.layout.pad(run.field.parameters())  # as the kernel holds them: its capacity's layout
    return WebScene(writer.values(), parameters, np.moveaxis(inputs, 0, -1).reshape(-1),
                    np.ascontiguousarray(occupancy.cells, np.int32).reshape(-1),
                    np.asarray(nearest, np.float32).reshape(-1), structures,
                    np.asarray(prepared.bounds, np.float64), renderer.max_samples, inputs.shape[0],
                    run.field.layout.kernels, bvh)


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
    data = gzip.compress(np.ascontiguousarray(array).tobytes(), compresslevel=9, mtime=0)
    return base64.b64encode(data).decode("ascii")


def _byte_ranges(values: np.ndarray, top: int = 255) -> tuple[np.ndarray, np.ndarray]:
    """Values (N, C) as one byte each (two where ``top`` is 65535) over each column's own range: the codes and
    the (C, 2) ranges, code b standing for low + b / top · (high − low)."""
    low, high = values.min(axis=0), values.max(axis=0)
    span = np.where(high > low, high - low, 1.0)
    codes = np.rint((values - low) / span * top).astype(np.uint8 if top <= 255 else np.uint16)
    return codes, np.stack([low, high], axis=1).astype(np.float64)


def _from_bytes(codes: np.ndarray, ranges: np.ndarray, top: int = 255) -> np.ndarray:
    """What the page makes of :func:`_byte_ranges`' codes (float32, as it computes them)."""
    low, high = ranges[:, 0].astype(np.float32), ranges[:, 1].astype(np.float32)
    return (low + codes.astype(np.float32) / np.float32(top) * (high - low)).astype(np.float32)


def table_columns(layout: FieldLayout) -> list[np.ndarray]:
    """The positions of the hash grid's entries in the parameters, one array per level and feature (a level's
    entries hold their features side by side: hash_encoding.slang)."""
    features = layout.config.encoding.features
    return [level.offset + np.arange(level.size) * features + f for level in layout.levels for f in range(features)]


def quantised_parameters(parameters: np.ndarray, layout: FieldLayout) -> dict[str, Any]:
    """The field's parameters as the page stores them: every hash-grid entry as one byte over its level's and
    feature's range (``tableRanges``, in :func:`table_columns`' order), the networks in float16. The entries are
    the bulk of the field; evenly spaced bytes compress to about 0.7 byte an entry (a level's values cluster
    near zero) where float16 takes 1.9, and keep the picture far above 40 dB (docs/share.md); the networks
    are a few thousand values whose errors every sample sees."""
    parameters = np.asarray(parameters, np.float32)
    columns = table_columns(layout)
    codes, ranges = zip(*(_byte_ranges(parameters[c][:, None]) for c in columns), strict=True)
    return {"table": _packed(np.concatenate([c.reshape(-1) for c in codes])),
            "tableRanges": [r[0].tolist() for r in ranges],
            "tableColumns": [[int(c[0]), int(c.size), layout.config.encoding.features] for c in columns],
            "networks": _packed(parameters[layout.geometry_offset:].astype(np.float16)),
            "parameterCount": int(parameters.size)}


def page_parameters(parameters: np.ndarray, layout: FieldLayout) -> np.ndarray:
    """The parameters the page renders with (float32): :func:`quantised_parameters` decoded as the page
    decodes them, so the desktop renderer can show the page's field."""
    parameters = np.asarray(parameters, np.float32)
    out = parameters.astype(np.float16).astype(np.float32)
    for column in table_columns(layout):
        codes, ranges = _byte_ranges(parameters[column][:, None])
        out[column] = _from_bytes(codes, ranges).reshape(-1)
    return out


def read_corners(occupancy) -> np.ndarray:
    """The corners of the occupancy grid whose ``nearest`` the kernel reads: those of occupied cells
    (ray_samples.slang's Occupancy.occupied interpolates only there)."""
    return marked_corners(occupancy.cells)


def quantised_inputs(inputs: np.ndarray, count: int) -> dict[str, Any]:
    """The local inputs (each voxel's ``count`` values in turn) as one byte each, over each input's own range
    (``inputRanges``: low and high, the page maps byte b back to low + b / 255 · (high − low)). They are
    normalised intensities read trilinearly: a 256th of their range is far below what the appearance
    network's colours resolve, and the page holds half the bytes of float16."""
    quantised, ranges = _byte_ranges(np.asarray(inputs, np.float32).reshape(-1, count))
    return {"inputs": _packed(quantised), "inputRanges": ranges.tolist()}


def quantised_nearest(nearest: np.ndarray) -> dict[str, Any]:
    """The occupancy's distances to the nearest surface (mm) as one byte each over their range. The kernel
    compares them, interpolated, with its reach, which lies a quarter of a cell beyond the band where the
    smooth step changes (occupancy.py): a 510th of the range moves that border far less than the margin, in
    a place where nothing is drawn."""
    codes, ranges = _byte_ranges(np.asarray(nearest, np.float32).reshape(-1, 1))
    return {"nearest": _packed(codes), "nearestRange": ranges[0].tolist()}


def bvh_offsets(bvh) -> tuple[int, int, int]:
    """Where the links, corners and meshes start in the page's one BVH buffer, after the nodes' boxes (6
    floats a node; links 2 a node, corners 9 a triangle, meshes 1 a triangle)."""
    if bvh is None:
        return 0, 0, 0
    nodes, triangles = len(bvh.links), len(bvh.corners)
    return 6 * nodes, 8 * nodes, 8 * nodes + 9 * triangles


CORNER_TOP = 65535  # the triangles' corners are two bytes an axis over the meshes' box
PAGE_LEAF_TRIANGLES = 16  # triangles a leaf of the page's BVH holds at most


def leafier_bvh(bvh):
    """A BVH over the same triangles with leaves of up to :data:`PAGE_LEAF_TRIANGLES`: the same hits (a BVH
    only decides which triangles a ray tests) from a quarter of the desktop's nodes, whose links the page
    would otherwise carry."""
    from ..mesh.bvh import build_bvh
    from ..mesh.mesh import Mesh

    corners = np.asarray(bvh.corners, np.float32)
    meshes = np.asarray(bvh.triangle_meshes)
    parts = []
    for m in range(int(meshes.max()) + 1):
        mine = corners[meshes == m].reshape(-1, 3).astype(np.float64)
        parts.append(Mesh(mine, np.arange(len(mine)).reshape(-1, 3), np.zeros((0, 3)), str(m), (1.0, 1.0, 1.0)))
    return build_bvh(parts, leaf_size=PAGE_LEAF_TRIANGLES)


def bvh_arrays(bvh) -> dict[str, Any]:
    """The page's BVH (:func:`leafier_bvh`'s) as the page stores it (``meshShadows`` false and nothing else
    without it): the links, the triangles' meshes, and their corners as two bytes an axis over the meshes'
    box (a 65535th of it, far below the shadow rays' offset from the surface they leave); the page computes
    the nodes' boxes from the corners it decodes (:func:`page_bvh`), so every triangle lies in its boxes."""
    if bvh is None:
        return {"meshShadows": False}
    codes, ranges = _byte_ranges(np.asarray(bvh.corners, np.float32).reshape(-1, 3), CORNER_TOP)
    return {"meshShadows": True, "links": _packed(np.asarray(bvh.links, np.int32)),
            "corners": _packed(codes), "cornerRanges": ranges.tolist(),
            "meshes": _packed(np.asarray(bvh.triangle_meshes, np.uint8))}


def page_bvh(bvh):
    """The BVH the page renders with (mesh/bvh.py's Bvh): :func:`leafier_bvh`'s, the corners decoded as the
    page decodes them, each node's box the bounds of its triangles' (a leaf) or of its children's boxes."""
    bvh = leafier_bvh(bvh)
    codes, ranges = _byte_ranges(np.asarray(bvh.corners, np.float32).reshape(-1, 3), CORNER_TOP)
    corners = _from_bytes(codes, ranges, CORNER_TOP).reshape(-1, 3, 3)
    links = np.asarray(bvh.links, np.int32)
    low, high = np.empty((len(links), 3), np.float32), np.empty((len(links), 3), np.float32)
    for node in range(len(links) - 1, -1, -1):  # children come after their parents
        first, second = links[node]
        if second < 0:
            triangles = corners[first:first - second].reshape(-1, 3)
            low[node], high[node] = triangles.min(axis=0), triangles.max(axis=0)
        else:
            low[node], high[node] = np.minimum(low[first], low[second]), np.maximum(high[first], high[second])
    return dataclasses.replace(bvh, box_min=low, box_max=high, corners=corners)


def page_data(scene: WebScene, wgsl: str) -> dict[str, Any]:
    """The page's model: the WGSL, its bindings, the arrays (float16 or bytes where they are large), the
    structures."""
    return {
        "wgsl": wgsl,
        "bindings": wgsl_bindings(wgsl),
        "scene": _packed(scene.scene.astype(np.float32)),
        **quantised_parameters(scene.parameters, scene.layout),
        **quantised_inputs(scene.inputs, scene.input_count),
        "inputCount": scene.input_count,
        "cells": _packed(scene.cells.astype(np.uint8)),
        **quantised_nearest(scene.nearest),
        "structures": scene.structures,
        "bounds": scene.bounds.tolist(),
        **bvh_arrays(scene.bvh),
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
    data = page_data(scene, wgsl)
    template = (Path(__file__).parent / "share_page.html").read_text()
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    html = template.replace("__CONTENT_POLICY__", CONTENT_POLICY).replace("__MODEL_JSON__", payload)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(html, encoding="utf-8")
    partial.replace(out)
    return out


def view_floats(camera, shadows: bool = True) -> np.ndarray:
    """A camera (render/camera.py) as the page's view (web_render.slang's readView), every structure shown,
    the meshes' shadows where the run has them and ``shadows``."""
    right, up, forward = camera.basis()
    values = [*camera.position, *right, *up, *forward, np.tan(np.radians(camera.view_angle) / 2),
              camera.width, camera.height, (1 << STYLE_STRUCTURES) - 1, float(shadows)]
    view = np.asarray(values, np.float32)
    assert view.size == VIEW_FLOATS
    return view
