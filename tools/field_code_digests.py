"""Digests of the code the Slang compiler makes of every field module a device loads without cooperative vectors
(CUDA source and SPIR-V), compiled offline from the tree this script is run from, one line a variant and target.
Run it from two trees (two checkouts, or the tree before and after a change) and compare the lines: equal
digests mean the CUDA and per-thread kernels are byte for byte what they were. It uses only the helpers of
NeuralRaycastLib/gpu/shader_targets.py that older trees have too, so either tree may be the older one.

Usage: PYTHONPATH=<tree> python <tree>/tools/field_code_digests.py [cuda] [spirv]"""

import ctypes
import hashlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from NeuralRaycastLib.gpu import shader_targets as st  # noqa: E402
from NeuralRaycastLib.gpu.device import structure_slots  # noqa: E402
from NeuralRaycastLib.paths import shader_dir  # noqa: E402


def code(target: str, variant) -> bytes:
    """The compiler's ``target`` code of every kernel Python calls on the field module ``variant``, made without
    line directives (which name the temporary file) in a folder of the same name on every run."""
    import slangpy as spy

    kernels = st.FIELD_KERNELS + (st.COOPERATIVE_FIELD_KERNELS if variant.cooperative in (1, 2) else ())
    source = st.field_module_source(variant)
    lib = st._library()
    with tempfile.TemporaryDirectory() as name:
        path = Path(name) / f"{variant.name}_{target}.slang"
        path.write_text(source + "\n" + st.entry_points(source, kernels))
        args = [str(path), "-target", target, "-I", str(spy.SHADER_PATH), "-I", str(shader_dir()),
                "-line-directive-mode", "none"]
        for key, value in st.module_defines(target, structure_slots(variant.structures)).items():
            args += ["-D", f"{key}={value}"]
        for kernel in kernels:
            args += ["-entry", st.entry_name(kernel), "-stage", "compute"]
        session = lib.spCreateSession(None)
        request = lib.spCreateCompileRequest(session)
        try:
            argv = (ctypes.c_char_p * len(args))(*[a.encode() for a in args])
            if lib.spProcessCommandLineArguments(request, argv, len(args)) < 0 or lib.spCompile(request) < 0:
                raise RuntimeError((lib.spGetDiagnosticOutput(request) or b"").decode(errors="replace"))
            return st._target_code(lib, request, len(kernels))
        finally:
            lib.spDestroyCompileRequest(request)
            lib.spDestroySession(session)


def main(targets: list[str]) -> None:
    for target in targets:
        for variant in st.field_variants(target):
            if variant.cooperative >= 3:  # the cooperative vectors' own variants: new, nothing to compare
                continue
            data = code(target, variant)
            print(f"{target} {variant.name} {len(data)} bytes sha256 {hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["cuda", "spirv"])
