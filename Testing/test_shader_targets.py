"""Every kernel the project dispatches compiles for each platform's shader target, offline (no device): SPIR-V
for Vulkan, CUDA source, Metal source (macOS), and HLSL (Direct3D 12) for the modules it can express, with the
defines each module is loaded with there. A failure names the module, the kernel, the target and the
compiler's first error line (docs/shader-targets.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("slangpy")

from NeuralRaycastLib.gpu import shader_targets  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def assert_compiles(failures) -> None:
    assert not failures, "\n".join(str(failure) for failure in failures)


@pytest.mark.parametrize("target", ["spirv", "cuda", "metal"])
def test_every_kernel_compiles_for_the_target(target):
    """The modules loaded by name, the field modules (a software device's and a GPU's; on CUDA also its two
    tensor-core variants, on SPIR-V its geometry network on cooperative vectors, everywhere that network's
    per-thread fallback) and the pretrained appearance's."""
    failures = shader_targets.compile_named_modules(target)
    for variant in shader_targets.field_variants(target):
        failures += shader_targets.compile_field_module(target, variant)
    failures += shader_targets.compile_latent_modules(target)
    assert_compiles(failures)


def test_the_kernels_hlsl_can_express_compile_for_direct3d():
    """The modules HLSL can express compile for Direct3D 12 (the others are listed, with the reason, in
    shader_targets.HLSL_UNREACHABLE)."""
    reachable = {name: kernels for name, kernels in shader_targets.MODULE_KERNELS.items()
                 if name not in shader_targets.HLSL_UNREACHABLE}
    assert_compiles(shader_targets.compile_named_modules("hlsl", reachable))


def test_every_kernel_python_calls_is_compiled():
    """A kernel called from Python but missing from the tables would escape the compile tests."""
    called = set()
    for path in (ROOT / "NeuralRaycastLib").rglob("*.py"):
        text = path.read_text()
        called |= set(re.findall(r"module\.([a-z]\w*)\b", text))
        called |= set(re.findall(r"_query\(\"(\w+)\"", text))
    compiled = {kernel for kernels in shader_targets.MODULE_KERNELS.values() for kernel in kernels}
    compiled |= set(shader_targets.FIELD_KERNELS + shader_targets.COOPERATIVE_FIELD_KERNELS
                    + shader_targets.COOPVEC_FIELD_KERNELS + shader_targets.LATENT_KERNELS
                    + shader_targets.LATENT_SCENE_KERNELS + shader_targets.COOPERATIVE_LATENT_SCENE_KERNELS)
    assert called, "no kernel calls found: the pattern no longer matches the code"
    assert sorted(called - compiled) == []


BROKEN = """
RWStructuredBuffer<int> counts;

int countTaking(int lane)
{
    return int(WavePrefixCountBits(lane > 3));
}

int doubled(int lane)
{
    return 2 * lane;
}
"""


def test_a_failure_names_the_module_kernel_target_and_first_error():
    """Metal has no prefix count of a ballot: the kernel using one is named, with the compiler's error and its
    place; the other kernel of the module is not."""
    failures = shader_targets.compile_source("probe", BROKEN, ("countTaking", "doubled"), "metal", {})
    assert [(f.module, f.entry, f.target) for f in failures] == [("probe", "countTaking", "metal")]
    message = str(failures[0])
    assert message.startswith("probe: countTaking does not compile for metal (Metal): error")
    assert "\n" not in message and re.search(r"probe_metal\.slang:\d+:\d+", message), message
    assert shader_targets.compile_source("probe", BROKEN, ("doubled",), "metal", {}) == []


@pytest.mark.parametrize("small", [True, False])
def test_the_shared_pages_renderer_compiles_to_wgsl(small):
    """The page's kernel (app/share.py: field_render and web_render with NEURALRAYCAST_WEB) for WebGPU, at a
    software device's network sizes and a GPU's."""
    import numpy as np

    from NeuralRaycastLib.app.share import compile_wgsl, web_source, wgsl_bindings
    from NeuralRaycastLib.field.field import FieldLayout, field_config_for

    layout = FieldLayout.build(field_config_for(2.0, small=small), np.array([[0, 0, 0], [180, 220, 180]], float), 4, 2)
    wgsl = compile_wgsl(web_source(layout), layout.structures)
    assert "renderPixel" in wgsl and set(wgsl_bindings(wgsl)) >= {"webScene", "webView", "webPixels"}


#: What the cooperative vectors' Slang is named in the code made of it (shaders/coopvec_mlp.slang's network and
#: operations, neural_field.slang's member of the field); CUDA's prelude has OptiX's own, which these leave out.
COOPVEC_NAMES = re.compile(r"CoopVecNetwork|CoopVecMlp|CoopVecLayout|coopVec[A-Z]\w*|coopGeometry|coopAppearance")


def test_the_cuda_and_per_thread_field_modules_hold_no_cooperative_vector_code():
    """Only the cooperative vectors' own field variants are compiled with FIELD_COOPVEC: every other one (CUDA's
    tensor-core kernels among them, which crashed while compiling with that code in) is made into code that
    names none of it, in the field struct every kernel takes or anywhere else; their fallback variant does."""
    kernels = ("fitLoss", "fieldDistances")
    for variant in shader_targets.field_variants("cuda"):
        coop = variant.cooperative >= 3
        assert ("FIELD_COOPVEC" in shader_targets.field_defines("cuda", variant)) == coop, variant.name
        if not coop:
            code = shader_targets.field_module_code("cuda", variant, kernels).decode(errors="replace")
            assert COOPVEC_NAMES.findall(code) == [], variant.name
    fallback = shader_targets.field_module_code("cuda", shader_targets.COOPVEC_FALLBACK_VARIANT, kernels)
    assert COOPVEC_NAMES.search(fallback.decode(errors="replace"))


#: Calls of CUDA's warp-synchronous intrinsics: votes, shuffles, matches, reductions and the warp barrier.
WARP_SYNC_CALL = re.compile(r"\b__(?:ballot|any|all|uni|shfl(?:_up|_down|_xor)?|match_(?:any|all)|reduce_\w+)_sync\s*\("
                            r"|\b__syncwarp\s*\(")

#: A kernel that needs nothing of the Slang module beyond the CUDA prelude every module's code starts with.
PRELUDE_ONLY = """
void doubleIt(int i, float* values)
{
    values[i] = 2.0f * values[i];
}
"""


def test_the_gaussian_kernels_make_no_warp_synchronous_call_on_cuda():
    """The Gaussians' backward march loops over each ray's own samples and cell lists, with early exits. Where its
    gradients took wave-aggregated atomics, Slang's CUDA code passed each thread's active mask down through
    those loops into warp-synchronous votes that threads reached with masks naming threads elsewhere: on an H100
    the gradient test hung and the fit stopped with an illegal instruction. Beyond the prelude's own helpers,
    the code of the Gaussians' kernels holds no such call."""
    prelude = shader_targets.source_code("prelude", PRELUDE_ONLY, ("doubleIt",), "cuda",
                                         shader_targets.module_defines("cuda", 8)).decode(errors="replace")
    code = shader_targets.named_module_code("cuda", "gaussians").decode(errors="replace")
    assert "entry_renderRaysBackward" in code and "entry_occupancyLossBackward" in code
    assert len(WARP_SYNC_CALL.findall(prelude)) > 0, "the pattern no longer matches the prelude's helpers"
    assert len(WARP_SYNC_CALL.findall(code)) == len(WARP_SYNC_CALL.findall(prelude))
