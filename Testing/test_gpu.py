"""Device selection: a working device here (lavapipe without a GPU), forced backends, clear failures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from NeuralRaycastLib.gpu import device as gpu
from NeuralRaycastLib.gpu import device as gpu_module


def test_default_device_runs_a_kernel(gpu):
    assert gpu.backend in ("cuda", "vulkan")
    module = gpu.load_module("device_check")
    values = np.linspace(-3, 3, 1000).astype(np.float32)
    np.testing.assert_allclose(module.deviceCheck(values, -0.5, _result="numpy"), values * -0.5 + 1.0, rtol=1e-6)


def test_a_change_in_the_shader_folder_leaves_open_work_alone(gpu):
    """Files written into the shader folder while a device is open (an update of the extension) must not
    reload its modules under a training: that would leave its tensors unusable."""
    import time

    import slangpy as spy

    from NeuralRaycastLib.paths import shader_dir

    module = gpu.load_module("device_check")
    tensor = spy.Tensor.from_numpy(gpu.device, np.arange(4, dtype=np.float32))
    probe = shader_dir() / f"changed_{id(tensor)}.slang"
    try:
        probe.write_text("// written while a device is open\n")
    except OSError:
        pytest.skip("the shader folder is read-only here")
    probe.unlink()
    values = np.arange(8, dtype=np.float32)
    for _ in range(15):  # slangpy's watcher reacts within about a second, on a later dispatch
        time.sleep(0.2)
        np.testing.assert_allclose(module.deviceCheck(values, 2.0, _result="numpy"), values * 2.0 + 1.0)
        np.testing.assert_array_equal(tensor.to_numpy(), np.arange(4, dtype=np.float32))


def test_report_names_adapter_backend_features_and_cache(gpu):
    report = gpu.report
    assert report.adapter and report.backend == gpu.backend
    assert isinstance(report.cooperative_vector, bool) and report.features
    assert report.shader_cache.endswith(gpu.backend)
    text = report.as_text()
    for word in ("backend", "adapter", "cooperative vector", "slangpy", "shader cache"):
        assert word in text


def test_backend_choice_from_argument_and_environment(monkeypatch):
    monkeypatch.setenv(gpu.DEVICE_ENV, "Vulkan")
    assert gpu.requested_backend() == "vulkan"
    assert gpu.requested_backend("cuda") == "cuda"  # the explicit option wins
    assert gpu.requested_backend("auto") == "vulkan"  # auto (the Slicer module's default) defers to it
    monkeypatch.setenv(gpu.DEVICE_ENV, "Metal")
    assert gpu.requested_backend() == "metal"  # macOS's (gpu/platforms.py)
    monkeypatch.setenv(gpu.DEVICE_ENV, "directx")
    with pytest.raises(ValueError, match="unknown device 'directx'"):
        gpu.requested_backend()


def test_forcing_cuda_without_a_driver_says_what_to_install():
    if gpu._cuda_driver() is not None:
        pytest.skip("this machine has an NVIDIA driver")
    with pytest.raises(gpu.GpuUnavailableError, match="no NVIDIA driver.*Mesa's Vulkan drivers"):
        gpu.open_device("cuda")


def test_shader_cache_lives_in_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("NEURALRAYCAST_CACHE", str(tmp_path))
    assert gpu.shader_cache_path("vulkan") == tmp_path / "shaders" / "vulkan"
    assert gpu.module_cache_path("vulkan") == tmp_path / "modules" / "vulkan"


def test_the_shader_cache_has_room_for_the_tensor_core_kernels(gpu):
    """At slangpy's default size (128 MiB) the database, once full, could neither keep new kernels nor make room
    for them, so they were compiled again in every run; the device opens it larger (BENCHMARKS.md)."""
    from NeuralRaycastLib.paths import SHADER_CACHE_BYTES

    assert gpu.device.desc.shader_cache_size == SHADER_CACHE_BYTES >= 1 << 30


def test_modules_load_where_parsed_modules_are_cached(gpu):
    """With Slang's module cache kept, the project's modules (here the tensor-core network's, with its
    imports) load and are cached on disk for the next process."""
    cache = Path(gpu.report.module_cache)
    assert cache == gpu_module.module_cache_path(gpu.backend)
    assert gpu.load_module("mma_mlp") is not None
    assert any(path.is_file() for path in cache.rglob("*"))


def test_a_module_of_generated_source_is_kept_for_the_next_process_or_parsed_where_it_cannot_be(gpu, monkeypatch):
    """A module made from generated source (the field's kernels for its sizes) is kept as a file named by its
    source's digest, which Slang's module cache then serves to later processes; where that file cannot be written
    (a full or read-only cache), the module is parsed from its source and works the same."""
    import hashlib

    def generated(offset: float) -> tuple[str, str]:
        source = f"float shifted(float x) {{ return x + {offset:.1f}; }}\n"
        return "check_" + hashlib.sha256(source.encode()).hexdigest()[:16], source

    values = np.linspace(-3, 3, 64).astype(np.float32)
    name, source = generated(1.5)
    module = gpu.load_module_from_source(name, source)
    np.testing.assert_allclose(module.shifted(values, _result="numpy"), values + 1.5, rtol=1e-6)
    kept = gpu_module.generated_module_path() / f"{name}.slang"
    assert kept.read_text() == source

    def full_disk(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gpu_module, "write_text", full_disk)
    name, source = generated(2.5)
    module = gpu.load_module_from_source(name, source)
    np.testing.assert_allclose(module.shifted(values, _result="numpy"), values + 2.5, rtol=1e-6)
    assert not (gpu_module.generated_module_path() / f"{name}.slang").exists()


FAKE_TORCH = "FAKE = True\n\nclass Tensor:\n    pass\n"
PROBE = """
import json, sys
{imports}
result = {{"torch_loaded_with_slangpy": "torch" in sys.modules}}
import torch
result["torch_importable_after"] = getattr(torch, "FAKE", False)
print(json.dumps(result))
"""


def run_with_installed_torch(tmp_path: Path, imports: str) -> dict:
    """Run ``imports`` in a fresh process where a stand-in ``torch`` package is installed; what was loaded."""
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "torch").mkdir(exist_ok=True)
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    done = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], capture_output=True, text=True,
                          env=env, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_slangpy_is_loaded_without_torch_where_torch_is_installed(tmp_path):
    """slangpy alone imports an installed torch (seconds); opening the device through NeuralRaycast does not,
    and the device works and torch stays importable."""
    plain = run_with_installed_torch(tmp_path, "import slangpy")
    assert plain["torch_loaded_with_slangpy"]  # the cost being avoided (a newer slangpy may drop it)
    ours = run_with_installed_torch(tmp_path, "from NeuralRaycastLib.gpu.device import open_device\n"
                                              "open_device().load_module('device_check')")
    assert not ours["torch_loaded_with_slangpy"]
    assert ours["torch_importable_after"]


def test_a_buffer_the_device_cannot_create_is_named_in_the_error():
    """A failed buffer creation becomes GpuMemoryError naming what was being allocated (the CLI prints it as
    one line); other errors pass through as they are."""
    from NeuralRaycastLib.app.cli import USER_ERRORS
    from NeuralRaycastLib.gpu.device import GpuMemoryError, device_memory

    failed = "m_device->rhi_device()->createBuffer(rhi_desc) failed with error: -2147467259"
    with pytest.raises(GpuMemoryError, match=r"could not hold the frame \(.*createBuffer"), device_memory("the frame"):
        raise RuntimeError(failed)
    with pytest.raises(RuntimeError, match="unrelated") as caught, device_memory("the frame"):
        raise RuntimeError("unrelated")
    assert not isinstance(caught.value, GpuMemoryError)
    assert issubclass(GpuMemoryError, USER_ERRORS)


def test_read_back_arrays_stay_as_read_when_the_buffer_is_used_again(gpu):
    """A renderer reads every frame through one kept host buffer; the arrays of an earlier frame (views of its
    read-back, render.image_from_planes) must not change when the next one is read, of any size."""
    import slangpy as spy

    reader = gpu_module.ReadBack(gpu)
    reader.kept = True  # (what every device but CUDA does; CUDA reads large ones into pinned memory)
    rng = np.random.default_rng(0)
    first, second, third = (rng.random(n, dtype=np.float32) for n in (1000, 1000, 24))
    tensor = spy.Tensor.from_numpy(gpu.device, first)
    a = reader.read(tensor)
    tensor.copy_from_numpy(second)
    b = reader.read(tensor)
    c = reader.read(spy.Tensor.from_numpy(gpu.device, third))
    np.testing.assert_array_equal(a, first)
    np.testing.assert_array_equal(b, second)
    np.testing.assert_array_equal(c, third)


def test_a_large_read_gives_the_tensors_values_in_a_new_array_each_time(gpu):
    """A 1024² G-buffer (32 MiB) is read this device's way: on CUDA into pinned host memory that the array is a
    view of (an earlier frame's arrays stay as read); elsewhere as in the test above."""
    import slangpy as spy

    reader = gpu_module.ReadBack(gpu)
    rng = np.random.default_rng(1)
    first, second = (rng.random(1024 * 1024 * 8, dtype=np.float32) for _ in range(2))
    tensor = spy.Tensor.from_numpy(gpu.device, first)
    a = reader.read(tensor)
    tensor.copy_from_numpy(second)
    b = reader.read(tensor)
    np.testing.assert_array_equal(a, first)
    np.testing.assert_array_equal(b, second)
    if gpu.backend == "cuda":
        assert len(reader._lent) == 2, "CUDA gave the read-back buffers no host address"


class _HostBuffer:
    """A stand-in for a pinned CUDA buffer: host memory, its size, and its address (the host's, here)."""

    def __init__(self, size: int) -> None:
        self.memory = np.zeros(size // 4, np.float32)
        self.size = size
        self.device_address = self.memory.ctypes.data


def test_pinned_read_back_lends_a_buffer_until_its_arrays_are_gone(monkeypatch):
    """CUDA reads hand out views of pinned buffers: a buffer is read into again only once no array of its last
    read is alive (views of it included), at most PINNED_FRAMES are lent, and with all of them held a read
    copies into a new array, so no array a caller holds ever changes."""
    import gc

    made: list[_HostBuffer] = []

    def host_buffer(self, size):
        made.append(_HostBuffer(size))
        return made[-1]

    def copy_into(self, buffer, tensor, size):
        buffer = buffer if buffer is not None and buffer.size == size else host_buffer(self, size)
        buffer.memory[:] = tensor.values
        return buffer

    monkeypatch.setattr(gpu_module.ReadBack, "_host_buffer", host_buffer)
    monkeypatch.setattr(gpu_module.ReadBack, "_copy_into", copy_into)
    monkeypatch.setattr(gpu_module, "cuda_host_pointer", lambda gpu, address: address)
    cuda = type("Gpu", (), {"backend": "cuda", "report": type("Report", (), {"software": False})()})()
    reader = gpu_module.ReadBack(cuda)
    n = gpu_module.PINNED_READ_BYTES // 4

    class Tensor:
        shape = (n,)

        def __init__(self, value: float) -> None:
            self.values = np.full(n, value, np.float32)

    held = [reader.read(Tensor(i))[:16].reshape(4, 4) for i in range(gpu_module.PINNED_FRAMES)]  # views only
    assert len(made) == gpu_module.PINNED_FRAMES
    extra = reader.read(Tensor(7.0))  # every buffer held: a copy into a fresh array
    assert len(made) == gpu_module.PINNED_FRAMES + 1 and extra.base is None and np.all(extra == 7.0)
    for i, array in enumerate(held):
        assert np.all(array == i), "a later read changed an array a caller holds"
    del held[0]
    gc.collect()
    again = reader.read(Tensor(9.0))  # the first buffer is free again: read into, no new buffer
    assert len(made) == gpu_module.PINNED_FRAMES + 1 and np.all(again == 9.0)
    assert again.ctypes.data == made[0].memory.ctypes.data
    for i, array in enumerate(held, start=1):
        assert np.all(array == i)


def test_device_memory_in_use_is_read_on_cuda_and_none_elsewhere(gpu):
    """The bench reports the GPU memory in use (CUDA's total less free); devices that cannot tell give None."""
    import slangpy as spy

    before = gpu_module.device_memory_in_use(gpu)
    if gpu.backend != "cuda":
        assert before is None
        return
    tensor = spy.Tensor.zeros(gpu.device, shape=(64 << 20,), dtype=float)  # 256 MiB
    gpu.device.wait()
    after = gpu_module.device_memory_in_use(gpu)
    assert before > 0 and after - before >= 200 << 20
    del tensor


def test_tensor_core_networks_only_on_cuda_gpus_that_have_their_instruction():
    """The fit and the renderer pick the tensor-core networks on CUDA GPUs of compute capability 8.0 and newer
    (their m16n8k16 half instruction), never on older ones, other backends or an unknown GPU, and not where
    NEURALRAYCAST_COOPERATIVE is 0: there the per-thread networks run instead of kernels that cannot load.
    The reason is what `neuralraycast info` prints."""
    from NeuralRaycastLib.gpu.device import tensor_core_networks

    assert tensor_core_networks("cuda", 90, "1") == (True, "compute capability 9.0")
    assert tensor_core_networks("cuda", 80, "1")[0]
    assert tensor_core_networks("cuda", 75, "1") == (False, "compute capability 7.5; they need 8.0")
    assert not tensor_core_networks("cuda", None, "1")[0]
    assert tensor_core_networks("cuda", 90, "0") == (False, "NEURALRAYCAST_COOPERATIVE=0")
    assert tensor_core_networks("vulkan", None, "1") == (False, "CUDA only; the per-thread networks run here")


def test_tensor_core_networks_need_hidden_widths_of_whole_tiles():
    """Hidden widths that are not multiples of 16 keep a field on the per-thread networks (its tensor-core
    kernels work on 16-wide tiles of the hidden layers)."""
    from NeuralRaycastLib.field.field import NetworkConfig, field_config_for

    assert NetworkConfig().tile_sized and field_config_for(1.0, small=True).network.tile_sized
    assert not NetworkConfig(hidden=24).tile_sized and not NetworkConfig(appearance_hidden=40).tile_sized


def test_a_field_asked_for_tensor_cores_where_they_cannot_run_says_why(gpu):
    """Asking for the tensor-core networks on a device without them fails at once with the reason, rather
    than with kernels that do not compile or load."""
    from field_reference import tiny_config

    from NeuralRaycastLib.field.field import FieldConfigError, FieldLayout, NeuralField

    if tensor_core_networks_here(gpu):
        pytest.skip("this device runs the tensor-core networks")
    layout = FieldLayout.build(tiny_config(), np.array([[0.0, 0.0, 0.0], [40.0, 40.0, 40.0]]), 2, 1)
    with pytest.raises(FieldConfigError, match="cannot run on this device"):
        NeuralField(gpu, layout, cooperative=True)


def tensor_core_networks_here(gpu) -> bool:
    from NeuralRaycastLib.gpu.device import tensor_core_networks

    return tensor_core_networks(gpu.backend, gpu.report.compute_capability, "1")[0]


def test_kernel_clock_times_each_launch_and_restores_slangpy(gpu):
    """The benchmark's kernel clock brackets every slangpy call of its block with device timestamps: each launch
    is counted under its kernel's name with a positive time inside the block's span, and slangpy's calls are
    left as they were afterwards, also when the block raises."""
    import slangpy as spy

    from NeuralRaycastLib.bench.kernel_clock import kernel_clock

    module = gpu.load_module("device_check")
    a = spy.Tensor.from_numpy(gpu.device, np.arange(1 << 16, dtype=np.float32))
    call = spy.Function.__call__
    with kernel_clock(gpu) as times:
        for _ in range(3):
            out = module.deviceCheck(a, 2.0, _result="numpy")
    assert spy.Function.__call__ is call
    np.testing.assert_allclose(out, np.arange(1 << 16) * 2.0 + 1.0)
    assert times.launches == {"deviceCheck": 3}
    assert times.milliseconds["deviceCheck"] > 0 and times.total_ms <= times.span_ms + 1e-6
    assert times.per(3).launches == {"deviceCheck": 1}
    assert "deviceCheck" in times.summary()
    with pytest.raises(RuntimeError, match="stop"), kernel_clock(gpu):
        raise RuntimeError("stop")
    assert spy.Function.__call__ is call


def test_the_vulkan_kernels_take_a_gpus_forms_only_where_every_adapter_is_a_gpu():
    """A CPU driver takes minutes to compile the wave-aggregated gradients and reads the hash table no faster
    without its branch: any software adapter listed (it may be the one that opens) keeps the plain atomics and the
    branch."""
    from NeuralRaycastLib.gpu.device import gpu_driver

    assert gpu_driver(["NVIDIA H200"])
    assert gpu_driver(["AMD Radeon RX 7900 XTX (RADV NAVI31)", "Intel(R) Arc(tm) A770 Graphics (DG2)"])
    assert not gpu_driver(["llvmpipe (LLVM 15.0.6, 256 bits)"])
    assert not gpu_driver(["NVIDIA H200", "llvmpipe (LLVM 15.0.6, 256 bits)"])
    assert not gpu_driver(["SwiftShader Device (Subzero)"])
    assert not gpu_driver([])


def test_study_dependent_floats_give_one_call_signature_once_rounded_to_float32(gpu):
    """slangpy's call signature notes whether a Python float is exactly a float32: 0.5 and 0.1 as a kernel's
    argument make two signatures, and so two builds of the call's data. Rounded to float32 first (kernel_floats, as
    the structs of the field, the fit, the style and the march are), any two values share one; ints, bools and
    slangpy's vectors are left as they are, and the kernel reads the same numbers."""
    import slangpy as spy
    from slangpy.core.native import SignatureBuilder

    module = gpu.load_module("device_check")
    values = np.linspace(-3, 3, 16).astype(np.float32)

    def signature(scale: float) -> str:
        builder = SignatureBuilder()
        module.call_data_cache.get_args_signature(builder, module.deviceCheck, values, scale)
        return builder.str

    assert signature(0.5) != signature(0.1)  # what the rounding is for
    assert signature(gpu_module.kernel_floats(0.5)) == signature(gpu_module.kernel_floats(0.1))
    nested = gpu_module.kernel_floats({"a": [0.1, 3, True, np.float64(1 / 3)], "b": (2.5, spy.float3(0.1, 0, 0)),
                                       "c": "name"})
    assert nested["a"] == [float(np.float32(0.1)), 3, True, float(np.float32(1 / 3))]
    assert type(nested["a"][1]) is int and nested["a"][2] is True and type(nested["a"][3]) is float
    assert nested["b"][0] == 2.5 and isinstance(nested["b"][1], spy.float3) and nested["c"] == "name"
    np.testing.assert_allclose(module.deviceCheck(values, gpu_module.kernel_floats(0.1), _result="numpy"),
                               module.deviceCheck(values, 0.1, _result="numpy"), rtol=0, atol=0)
