"""Every kernel the project dispatches, compiled offline for each shader target the Slang compiler can emit
without a device: SPIR-V (Vulkan), CUDA source, Metal source and HLSL (Direct3D 12).

slangpy builds a kernel around a Slang function when Python first calls it, on the device's own target
only, so a construct another platform lacks (a float atomic Metal has no form of, a 64-bit type, a pointer
cast) shows up on a user's machine, not here. This module gives each kernel function a compute entry point
of its own (its parameters as the entry point's uniforms, as slangpy passes them; its result stored in a
buffer) and compiles every entry point of a module for one target in one request of the compiler library
slangpy ships (app/share.py's route to WGSL). No device is opened and nothing is cached.

What each target proves: SPIR-V is the binary a Vulkan driver takes; for CUDA, Metal and HLSL the Slang
compiler makes source that NVRTC, Apple's Metal compiler or DXC would compile on the user's machine (none of
them runs here), so the constructs Slang rejects for a target are caught, not those its compiler might.
"""

from __future__ import annotations

import ctypes
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..paths import shader_dir

#: Slang's names of the targets, and the platform each one stands for.
TARGETS = {"spirv": "Vulkan", "cuda": "CUDA", "metal": "Metal", "hlsl": "Direct3D 12"}
#: The CUDA compute capability the CUDA target is compiled for: tensor-core networks and float2 atomics on.
CUDA_SM = 90

#: The kernels Python calls on each module it loads by name (gpu.load_module), and the tests' sphere scene.
MODULE_KERNELS: dict[str, tuple[str, ...]] = {
    "adam": ("adamStep", "adamWidth"),
    "bvh": ("traceClosest", "occluded"),
    "composite": ("compositeRay", "compositeSegmentBackward", "finishPixel", "packPicture"),
    "device_check": ("deviceCheck",),
    "distance_transform": ("distanceLine",),
    "mesh_distance": ("meshDistance",),
    "image_loss": ("imageLossPixel", "imageLossPatchSums", "imageLossGradient"),
    "view_score": ("viewScorePixel", "viewScoreRows"),
    "mesh_shadows": ("meshKeyVisibility", "meshKeyVisibilityByGrid", "meshAmbientVisibility"),
    "ray_samples": ("cameraRays", "patchRays", "clearLists", "countSamples", "reserveTiles", "placeSamples"),
    "reference_render": ("renderReference", "renderReferenceMeshShadows"),
    "segment_lists": ("listSegments",),
    "segment_shadows": ("segmentVisibility",),
    "volume_upload": ("interleaveVolumes",),
    "sphere_scene": ("sphereDistances", "sphereSurface", "sphereBackwardDistances", "sphereBackwardSurface"),
    "gaussians": ("renderRays", "renderRaysBackward", "renderCamera", "occupancyAt", "occupancyBackward",
                  "gridClear", "gridCount", "gridScanBlocks", "gridScanTotals", "gridScanAdd", "gridFill",
                  "gaussianPatchRays", "accumulatePositionGradients", "renderCameraPacked", "occupancyLossBackward",
                  "gaussianFrames", "renderCameraPlanes"),
}
#: The pretrained appearance's modules (appearance/latent.py, latent_scene.py), built from source as the field's.
LATENT_KERNELS = ("latentEncodeGrid", "latentShadeAt", "latentPretrainStep", "latentSumRows", "latentGridAdam",
                  "latentParameterAdam", "latentBricksNear")
LATENT_SCENE_KERNELS = ("latentFieldDistances", "latentFieldSurface", "latentAppearanceBackward")
#: Those the latent scene's module has only with the field's geometry network on tensor cores (CUDA's), whose
#: forward passes decode on them too.
COOPERATIVE_LATENT_SCENE_KERNELS = ("latentDecoderToTiled", "latentDecoderTiledCount")
#: The kernels of a field module (field/field.py's field_source: sdf_fit, then field_render).
FIELD_KERNELS = ("fitEikonalWaves", "fitPlainWaves", "fitLoss", "distancesAt", "nearestOnGrid", "gradientsAt",
                 "fieldDistances", "fieldSurface", "fieldBackwardDistances", "fieldBackwardSurface",
                 "fieldAppearanceBackward")
#: Those a field module has only with its geometry network on tensor cores (FIELD_COOPERATIVE, CUDA's).
COOPERATIVE_FIELD_KERNELS = ("networksToTiled", "networkGradientsFromTiled", "geometryTiledCount",
                             "geometryGradientLength", "appearanceTiledCount")
#: Those a field module has only with its networks on cooperative vectors (the SDF fit's and renderer's, on Vulkan;
#: compiled with field.py's COOPVEC_DEFINES, which no other variant sees).
COOPVEC_FIELD_KERNELS = ("coopVecToHalves", "coopVecAddNetworkGradients", "coopVecHalfCount")
#: The structure slots the named modules are compiled for (the device's own session's).
STRUCTURE_SLOTS = 8
#: The modules whose kernels HLSL cannot express, and why: Direct3D 12 is out of reach for training and for
#: the neural renderer (the reference renderer, the meshes' shadows and the image loss compile for it).
HLSL_UNREACHABLE = {
    "adam": "vector loads and stores through cast pointers (*(float4*)p)",
    "composite": "float atomics through pointers; Slang's HLSL emitter fails on compositeRay (internal error)",
    "ray_samples": "Slang's HLSL emitter fails on placeSamples (internal error: unexpected IR opcode)",
    "sphere_scene": "float atomics through pointers (the gradients' addGradient)",
    "gaussians": "float atomics through pointers (the gradients' addGradient)",
    "field": "vector loads through cast pointers (params.slang's readPair), float atomics through pointers",
}
#: Parameter modifiers that do not change how an argument is passed.
PLAIN_MODIFIERS = ("no_diff", "in", "uniform", "const")


class ShaderTargetError(RuntimeError):
    """A kernel could not be given an entry point (its function not found in the module's source)."""


@dataclass(frozen=True)
class TargetFailure:
    """One entry point that did not compile for one target, with the compiler's first error line."""

    module: str
    entry: str
    target: str
    error: str

    def __str__(self) -> str:
        return f"{self.module}: {self.entry} does not compile for {self.target} ({TARGETS[self.target]}): {self.error}"


def _split_parameters(text: str) -> list[str]:
    """A parameter list split at its top-level commas (generic arguments and array sizes kept whole)."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "<(["
        depth -= char in ">)]"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current)
    return [" ".join(part.split()) for part in parts]


def _function_signature(source: str, name: str) -> tuple[str, list[tuple[str, str, str]]]:
    """(return type, [(modifier, type, name)]) of the top-level function ``name`` in ``source``."""
    found = re.search(rf"^(?!\s)(?:\[[^\]]*\]\s*)*([\w<>:, ]+?)\s+{name}\s*\(([^)]*)\)\s*\{{", source, re.M)
    if found is None:
        raise ShaderTargetError(f"no function {name} at the top level of its module's source")
    parameters = []
    for part in _split_parameters(found.group(2)):
        words = part.split(" ")
        modifiers = [w for w in words[:-1] if w in PLAIN_MODIFIERS + ("inout", "out")]
        kind = "inout" if {"inout", "out"} & set(modifiers) else ""
        declared = " ".join(w for w in words[:-1] if w not in modifiers)
        variable, _, array = words[-1].partition("[")
        parameters.append((kind, declared + (f"[{array}" if array else ""), variable))
    return found.group(1).strip(), parameters


def entry_name(kernel: str) -> str:
    return f"entry_{kernel}"


def entry_points(source: str, kernels: tuple[str, ...]) -> str:
    """A compute entry point for each kernel function of ``source``: its arguments the entry point's uniforms
    (an ``inout`` one a local copy), its result stored in a buffer, as slangpy's generated kernels do."""
    lines = []
    for kernel in kernels:
        result, parameters = _function_signature(source, kernel)
        uniforms, arguments, locals_ = [], [], []
        for index, (kind, declared, _) in enumerate(parameters):
            base, _, array = declared.partition("[")
            suffix = f"[{array}" if array else ""
            uniforms.append(f"uniform {base} a{index}{suffix}")
            if kind:
                locals_.append(f"    {base} v{index}{suffix} = a{index};")
                arguments.append(f"v{index}")
            else:
                arguments.append(f"a{index}")
        call = f"{kernel}({', '.join(arguments)})"
        if result != "void":
            uniforms.append(f"uniform RWStructuredBuffer<{result}> result")
            call = f"result[0] = {call}"
        lines += ['[shader("compute")]', "[numthreads(32, 1, 1)]",
                  f"void {entry_name(kernel)}({', '.join(uniforms)})", "{", *locals_, f"    {call};", "}", ""]
    return "\n".join(lines)


def module_defines(target: str, structure_slots: int) -> dict[str, str]:
    """The defines gpu/device.py gives every module, as a GPU of ``target`` would (on SPIR-V a GPU's Vulkan driver,
    not a CPU one's)."""
    return {"NEURALRAYCAST_CUDA_SM": str(CUDA_SM if target == "cuda" else 0), "STRUCTURE_SLOTS": str(structure_slots),
            "NEURALRAYCAST_GPU_DRIVER": "1"}


def _first_error(diagnostics: str) -> str:
    """The compiler's first error as one line: its message, where (file:line:column) and its label."""
    lines = diagnostics.splitlines()
    first = next((i for i, line in enumerate(lines) if re.match(r"\s*(internal )?error", line)), None)
    if first is None:
        return next((line.strip() for line in lines if "error" in line.lower()), "no diagnostics") \
            if lines else "no diagnostics"
    message, where, label = lines[first].strip(), "", ""
    for line in lines[first + 1:first + 8]:
        if re.match(r"\s*(internal )?(error|warning)", line):
            break
        if found := re.match(r"\s*-->\s*(.+)", line):
            where = found.group(1).strip()
        elif found := re.match(r"\s*\|\s*\^+\s*(.+)", line):
            label = found.group(1).strip()
    return message + (f" at {where}" if where else "") + (f": {label}" if label else "")


def _blob_bytes(blob: int) -> bytes:
    """The bytes of a Slang ``ISlangBlob`` (its interface: getBufferPointer, getBufferSize), released after."""
    table = ctypes.cast(ctypes.c_void_p.from_address(blob).value, ctypes.POINTER(ctypes.c_void_p))
    pointer = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(table[3])(blob)
    size = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)(table[4])(blob)
    data = ctypes.string_at(pointer, size) if pointer else b""
    ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_void_p)(table[2])(blob)
    return data


def _target_code(lib: ctypes.CDLL, request: int, entries: int) -> bytes:
    """The code the request made: the target's one program (SPIR-V, CUDA, Metal), else every entry point's
    own (HLSL) joined."""
    blob = ctypes.c_void_p()
    if lib.spGetTargetCodeBlob(request, 0, ctypes.byref(blob)) >= 0 and blob.value:
        return _blob_bytes(blob.value)
    parts = []
    for index in range(entries):
        size = ctypes.c_size_t()
        code = lib.spGetEntryPointCode(request, index, ctypes.byref(size))
        parts.append(ctypes.string_at(code, size.value) if code else b"")
    return b"\n".join(parts)


def _compile(lib: ctypes.CDLL, path: Path, target: str, entries: list[str], defines: dict[str, str],
             code_out: list[bytes] | None = None) -> tuple[bool, str]:
    """Whether the compiler made ``target`` code holding every entry point of ``path``, and its diagnostics
    (a missing entry point's name where it made code without it); the code appended to ``code_out`` where
    given (made without line directives, so it names no file)."""
    import slangpy as spy

    args = [str(path), "-target", target, "-I", str(spy.SHADER_PATH), "-I", str(shader_dir())]
    if code_out is not None:
        args += ["-line-directive-mode", "none"]
    for name, value in defines.items():
        args += ["-D", f"{name}={value}"]
    for entry in entries:
        args += ["-entry", entry, "-stage", "compute"]
    session = lib.spCreateSession(None)
    request = lib.spCreateCompileRequest(session)
    try:
        argv = (ctypes.c_char_p * len(args))(*[a.encode() for a in args])
        if lib.spProcessCommandLineArguments(request, argv, len(args)) < 0:
            return False, (lib.spGetDiagnosticOutput(request) or b"").decode(errors="replace") or f"refused {args}"
        failed = lib.spCompile(request) < 0
        diagnostics = (lib.spGetDiagnosticOutput(request) or b"").decode(errors="replace")
        if failed:
            return False, diagnostics
        code = _target_code(lib, request, len(entries))
        missing = [entry for entry in entries if entry.encode() not in code]
        if missing:
            return False, f"error: no {target} code for {', '.join(missing)}\n{diagnostics}"
        if code_out is not None:
            code_out.append(code)
        return True, diagnostics
    finally:
        lib.spDestroyCompileRequest(request)
        lib.spDestroySession(session)


def _library() -> ctypes.CDLL:
    from ..app.share import _slang_library

    lib = _slang_library()
    lib.spGetEntryPointCode.restype = ctypes.c_void_p
    lib.spGetEntryPointCode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
    lib.spGetTargetCodeBlob.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
    return lib


def _failures(lib: ctypes.CDLL, folder: Path, unit: str, source: str, kernels: tuple[str, ...], target: str,
              defines: dict[str, str], signatures: str | None = None) -> list[TargetFailure]:
    """Every kernel of ``source`` (declared in ``signatures``, by default ``source`` itself) compiled for
    ``target`` in one request; where that fails, each entry point alone, to name the ones that fail (one
    failure naming none where the module fails without them)."""
    path = folder / f"{unit}_{target}.slang"
    path.write_text(source + "\n" + entry_points(signatures or source, kernels))
    entries = [entry_name(kernel) for kernel in kernels]
    ok, diagnostics = _compile(lib, path, target, entries, defines)
    if ok:
        return []
    failures = []
    for entry in entries:
        alone, output = _compile(lib, path, target, [entry], defines)
        if not alone:
            failures.append(TargetFailure(unit, entry.removeprefix("entry_"), target, _first_error(output)))
    return failures or [TargetFailure(unit, "(all together)", target, _first_error(diagnostics))]


def compile_named_modules(target: str, modules: dict[str, tuple[str, ...]] | None = None) -> list[TargetFailure]:
    """The kernels of every module the project loads by name, compiled for ``target``: in one request that
    imports them all (the modules they share parsed once); where it fails, each module on its own."""
    modules = MODULE_KERNELS if modules is None else modules
    lib = _library()
    defines = module_defines(target, STRUCTURE_SLOTS)
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        source = "\n".join(f"import {module};" for module in modules)
        wrappers = "\n".join(entry_points(named_module_source(module), kernels) for module, kernels in modules.items())
        path = folder / f"modules_{target}.slang"
        path.write_text(source + "\n" + wrappers)
        entries = [entry_name(kernel) for kernels in modules.values() for kernel in kernels]
        if _compile(lib, path, target, entries, defines)[0]:
            return []
        failures = []
        for module, kernels in modules.items():
            failures += _failures(lib, folder, module, f"import {module};", kernels, target, defines,
                                  signatures=named_module_source(module))
        return failures


def compile_source(unit: str, source: str, kernels: tuple[str, ...], target: str, defines: dict[str, str]) \
        -> list[TargetFailure]:
    """The ``kernels`` of Slang ``source`` (named ``unit`` in failures) compiled for ``target``."""
    with tempfile.TemporaryDirectory() as name:
        return _failures(_library(), Path(name), unit, source, kernels, target, defines)


@dataclass(frozen=True)
class FieldVariant:
    """One field module a device loads: its network sizes (``small``: a software device's; else a GPU's),
    structures (and so its structure slots), hash and geometry network (``cooperative``: 0 per thread, 1 on
    tensor cores, 2 on tensor cores with frozen weights, 3 to 5 on cooperative vectors: field.py's
    COOPVEC_GEOMETRY plus coopvec_mlp.slang's Kind)."""

    small: bool
    structures: int
    hash: str = "x_added"
    cooperative: int = 0

    @property
    def name(self) -> str:
        kind = ("field", "cooperative_field", "frozen_field", "coopvec_fallback_field", "coopvec_half_field",
                "coopvec_float_field")[self.cooperative]
        return f"{kind}_{'small' if self.small else 'full'}_{self.structures}_{self.hash}"


#: The field modules compiled for every target: a software device's with few structures, a GPU's with the most
#: and the hash older model files were trained with.
FIELD_VARIANTS = (FieldVariant(small=True, structures=3), FieldVariant(small=False, structures=8, hash="xor"))
#: Those CUDA loads besides (tensor-core networks, on GPUs of compute capability 8.0 and newer).
CUDA_FIELD_VARIANTS = (FieldVariant(small=False, structures=4, cooperative=1),
                       FieldVariant(small=False, structures=4, cooperative=2))
#: Those Vulkan loads besides for the SDF fit and the renders (the networks on cooperative vectors, where the device has
#: them; with the weights' gradients summed in half one operand of one instruction differs), and their per-thread
#: fallback, which every target compiles (the cooperative-vector instructions are SPIR-V's alone).
COOPVEC_FIELD_VARIANTS = (FieldVariant(small=False, structures=4, cooperative=4),
                          FieldVariant(small=False, structures=4, cooperative=5))
COOPVEC_FALLBACK_VARIANT = FieldVariant(small=True, structures=3, cooperative=3)


def field_variants(target: str) -> tuple[FieldVariant, ...]:
    return (FIELD_VARIANTS + (CUDA_FIELD_VARIANTS if target == "cuda" else ())
            + (COOPVEC_FIELD_VARIANTS if target == "spirv" else ()) + (COOPVEC_FALLBACK_VARIANT,))


def field_kernels(variant: FieldVariant) -> tuple[str, ...]:
    """The kernels Python calls on the field module ``variant``."""
    return FIELD_KERNELS + (COOPERATIVE_FIELD_KERNELS if variant.cooperative in (1, 2) else ()) \
        + (COOPVEC_FIELD_KERNELS if variant.cooperative >= 3 else ())


def field_defines(target: str, variant: FieldVariant) -> dict[str, str]:
    """The defines the field module ``variant`` is compiled with on ``target``: the device's, and its session's
    own (field.py's field_session_defines: FIELD_COOPVEC for the cooperative vectors' variants alone)."""
    from ..field.field import COOPVEC_GEOMETRY, field_session_defines
    from .device import structure_slots

    coop_vectors = variant.cooperative - COOPVEC_GEOMETRY if variant.cooperative >= COOPVEC_GEOMETRY else None
    return {**module_defines(target, structure_slots(variant.structures)), **field_session_defines(coop_vectors)}


def compile_field_module(target: str, variant: FieldVariant) -> list[TargetFailure]:
    """The kernels of the field module ``variant`` compiled for ``target``."""
    with tempfile.TemporaryDirectory() as name:
        return _failures(_library(), Path(name), variant.name, field_module_source(variant), field_kernels(variant),
                         target, field_defines(target, variant))


def field_module_code(target: str, variant: FieldVariant, kernels: tuple[str, ...] | None = None) -> bytes:
    """The ``target`` code the compiler makes of the field module ``variant`` (``kernels``, by default every one
    Python calls), for reading what a device would run; a ShaderTargetError where it does not compile."""
    kernels = field_kernels(variant) if kernels is None else kernels
    return source_code(variant.name, field_module_source(variant), kernels, target, field_defines(target, variant))


def compile_latent_modules(target: str) -> list[TargetFailure]:
    """The pretrained appearance's kernels for ``target``: its own module, and the field's with its scene (a GPU's
    field sizes, four structures; on CUDA also with the networks and the decoder on tensor cores, on SPIR-V with the
    geometry network on cooperative vectors)."""
    from ..appearance.latent import LatentConfig, latent_source
    from ..appearance.latent_scene import latent_scene_source
    from ..field.field import field_session_defines
    from .device import structure_slots

    config = LatentConfig()
    layout = _field_layout(FieldVariant(small=False, structures=4))
    defines = module_defines(target, structure_slots(4))
    with tempfile.TemporaryDirectory() as name:
        failures = (_failures(_library(), Path(name), "latent", latent_source(config), LATENT_KERNELS, target,
                              defines)
                    + _failures(_library(), Path(name), "latent_scene", latent_scene_source(layout, config),
                                LATENT_SCENE_KERNELS, target, defines))
        if target == "cuda":
            failures += _failures(_library(), Path(name), "latent_scene_cooperative",
                                  latent_scene_source(layout, config, cooperative=True),
                                  LATENT_SCENE_KERNELS + COOPERATIVE_LATENT_SCENE_KERNELS, target, defines)
        if target == "spirv":
            half_sums = 1  # coopvec_mlp.slang's Kind of a GPU's
            failures += _failures(_library(), Path(name), "latent_scene_coopvec",
                                  latent_scene_source(layout, config, coop_vectors=half_sums), LATENT_SCENE_KERNELS,
                                  target, {**defines, **field_session_defines(half_sums)})
        return failures


_EXPORTED_IMPORT = re.compile(r"^__exported import (\w+);", re.M)


def named_module_source(name: str, seen: set[str] | None = None) -> str:
    """A module's source, then those of the project's modules it re-exports (``__exported import``), where some
    of the kernels a caller finds through it are declared; each module once."""
    seen = set() if seen is None else seen
    seen.add(name)
    source = (shader_dir() / f"{name}.slang").read_text()
    parts = [source]
    for imported in _EXPORTED_IMPORT.findall(source):
        if imported not in seen and (shader_dir() / f"{imported}.slang").is_file():
            parts.append(named_module_source(imported, seen))
    return "\n".join(parts)


def source_code(unit: str, source: str, kernels: tuple[str, ...], target: str, defines: dict[str, str],
                signatures: str | None = None) -> bytes:
    """The ``target`` code the compiler makes of the ``kernels`` of Slang ``source`` (declared in ``signatures``,
    by default ``source`` itself), for reading what a device would run; a ShaderTargetError naming ``unit`` where
    it does not compile."""
    code: list[bytes] = []
    with tempfile.TemporaryDirectory() as name:
        path = Path(name) / f"{unit}_{target}.slang"
        path.write_text(source + "\n" + entry_points(signatures or source, kernels))
        ok, diagnostics = _compile(_library(), path, target, [entry_name(k) for k in kernels], defines, code)
    if not ok:
        raise ShaderTargetError(f"{unit} does not compile for {target}: {_first_error(diagnostics)}")
    return code[0]


def named_module_code(target: str, module: str, kernels: tuple[str, ...] | None = None) -> bytes:
    """The ``target`` code of the named ``module`` (``kernels``, by default every one Python calls), with the
    defines a device of ``target`` loads it with."""
    return source_code(module, f"import {module};", MODULE_KERNELS[module] if kernels is None else kernels, target,
                       module_defines(target, STRUCTURE_SLOTS), signatures=named_module_source(module))


def field_module_source(variant: FieldVariant) -> str:
    """The field module's source (field/field.py's field_source) of ``variant``, for a study of two channels."""
    from ..field.field import COOPVEC_GEOMETRY, field_source

    coop_vectors = variant.cooperative - COOPVEC_GEOMETRY if variant.cooperative >= COOPVEC_GEOMETRY else None
    return field_source(_field_layout(variant), cooperative=variant.cooperative == 1,
                        frozen_geometry=variant.cooperative == 2, coop_vectors=coop_vectors)


def _field_layout(variant: FieldVariant):
    """The field layout of ``variant`` for a study of two channels."""
    import dataclasses

    from ..field.field import FieldConfig, FieldLayout, field_config_for

    config = field_config_for(2.0, small=variant.small)
    config = FieldConfig(dataclasses.replace(config.encoding, hash=variant.hash), config.network)
    return FieldLayout.build(config, np.array([[0, 0, 0], [180, 220, 180]], float), variant.structures, 2)
