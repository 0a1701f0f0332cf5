"""The one place that opens the slangpy device.

Order of preference: CUDA where it works, else Vulkan (on a machine without a GPU that is Mesa's
lavapipe, a CPU implementation). slangpy's own CPU device is not used: it cannot dispatch in 0.43.x.
The choice can be forced with ``--device`` on the command line or ``NEURALRAYCAST_DEVICE``
(``auto``, ``cuda``, ``vulkan``). Every device gets a persistent shader cache in the user cache
directory, so kernels compile once per machine rather than once per process, and a cache of Slang's
parsed modules (module_cache_path), so a new process does not parse them again.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..files import write_text
from ..paths import SHADER_CACHE_BYTES, cache_folder, shader_dir
from .compiler_log import route_slangpy_messages
from .memory_budget import MemoryBudget, resolve_budget

DEVICE_ENV = "NEURALRAYCAST_DEVICE"
BACKENDS = ("cuda", "vulkan")  # auto's order, best first
MAC_BACKENDS = ("metal", "vulkan")  # auto's order on macOS: slangpy has no CUDA there
CHOICES = ("auto", *BACKENDS, "metal")

INSTALL_HINT = (
    "Install one of: an NVIDIA driver (for CUDA or Vulkan), or Mesa's Vulkan drivers version 23 or newer "
    "(lavapipe, runs on the CPU; on Debian bookworm: enable bookworm-backports and "
    "`apt-get install -t bookworm-backports mesa-vulkan-drivers libvulkan1`; `make demo` does this for you)."
)


class GpuUnavailableError(RuntimeError):
    """No slangpy device could be opened; the message says what was tried and what to install."""


class GpuMemoryError(RuntimeError):
    """The device could not hold the buffers some work needs; the message says which and how large."""


@contextmanager
def device_memory(what: str) -> Iterator[None]:
    """Allocations on the device for ``what``: a buffer the device could not create (out of memory, or
    larger than one buffer may be) raises :class:`GpuMemoryError` naming it, instead of the driver's message
    alone."""
    try:
        yield
    except RuntimeError as error:
        message = str(error)
        if isinstance(error, GpuMemoryError) or not ("createBuffer" in message or "memory" in message.lower()):
            raise
        raise GpuMemoryError(f"the GPU could not hold {what} ({message.splitlines()[0][-120:]})") from error


@dataclass
class DeviceReport:
    """What ``neuralraycast info`` prints: enough to reproduce and to file a bug."""

    backend: str
    adapter: str
    software: bool
    features: list[str]
    cooperative_vector: bool
    cooperative_matrix: bool
    slangpy_version: str
    python_version: str
    shader_cache: str
    shader_dir: str
    tried: dict[str, str] = field(default_factory=dict)
    module_cache: str = ""  # Slang's parsed modules on disk ("" where slangpy ships no standard modules)
    compute_capability: int | None = None  # CUDA: 10 * major + minor (90 on an H100); None elsewhere
    tensor_cores: str = ""  # whether fields run their networks on tensor cores here (tensor_core_networks)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def as_text(self) -> str:
        lines = [
            f"backend            {self.backend}{' (software, runs on the CPU)' if self.software else ''}",
            f"adapter            {self.adapter}",
            f"cooperative vector {'yes' if self.cooperative_vector else 'no'}",
            f"cooperative matrix {'yes' if self.cooperative_matrix else 'no'}",
            f"tensor-core MLPs   {self.tensor_cores}",
            f"features           {', '.join(self.features)}",
            f"slangpy            {self.slangpy_version}",
            f"python             {self.python_version}",
            f"shader cache       {self.shader_cache}",
            f"module cache       {self.module_cache or 'not kept on this backend'}",
            f"shaders            {self.shader_dir}",
        ]
        lines += [f"not used: {name:9s} {why}" for name, why in self.tried.items()]
        return "\n".join(lines)


#: The structure slots kernels are compiled for (shaders/image_formation.slang's STRUCTURE_SLOTS): the fewest
#: that hold a study's structures. Loops over fewer slots make smaller kernels: the compositing of a neural
#: render of the sample (4 structures) is markedly faster with 4 slots than with 8 (BENCHMARKS.md).
STRUCTURE_SLOTS = (4, 8)


def structure_slots(structures: int | None) -> int:
    """The slots of the kernels for ``structures`` structures (None: the most, for kernels that take any)."""
    if structures is None:
        return STRUCTURE_SLOTS[-1]
    for slots in STRUCTURE_SLOTS:
        if structures <= slots:
            return slots
    raise ValueError(f"at most {STRUCTURE_SLOTS[-1]} structures, got {structures}")


def kernel_floats(value: Any) -> Any:
    """``value`` (a number, or dicts, lists and tuples of them) with every float rounded to the float32 the kernels
    read, other values as they are. slangpy's signature of a call notes whether each Python float is exactly a float32,
    so values that vary with the study (cell sizes, loss weights, the style's optical depths) would otherwise make a
    study of other voxels or structures build the data of every such call again in a process that has made it (a
    worker kept ready: app/standby.py). The kernels see the same numbers either way."""
    if isinstance(value, (float, np.floating)):
        return float(np.float32(value))
    if isinstance(value, dict):
        return {key: kernel_floats(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(kernel_floats(item) for item in value)
    return value


@dataclass
class GpuContext:
    """An open device plus what is needed to load the project's Slang modules on it."""

    device: Any  # slangpy.Device
    backend: str
    report: DeviceReport
    _sessions: dict[tuple[int, tuple[tuple[str, str], ...]], Any] = field(default_factory=dict, repr=False)
    #: The loaded modules by (name, slots): a module keeps the kernels built for its calls, so a second run in
    #: the same process (another study, a second training in Slicer) builds none of them again.
    _modules: dict[tuple[str, int], Any] = field(default_factory=dict, repr=False)
    #: The GPU memory the work may take (memory_budget.py; set by open_device and use_memory_budget).
    memory: MemoryBudget | None = None
    #: (free, total) bytes of the GPU when the device opened (CUDA), the device's own budget's basis; None
    #: where the device cannot say.
    memory_at_open: tuple[int, int] | None = None
    #: Held by work that calls the device from a thread other than the run's own while the run goes on (the
    #: boundary maps' transforms, a field built beside them): a device's calls and its Slang sessions are not
    #: made from two threads at once. Reentrant: such work may call helpers that take it too.
    lock: Any = field(default_factory=threading.RLock, repr=False, compare=False)

    def use_on_this_thread(self) -> bool:
        """Ready the device for calls from the calling thread, and say whether it may take them.

        A CUDA device's context is current only on the thread that opened it; a call from another thread
        aborts the process inside the driver's wrapper. The context is made current here through the driver
        (libcuda's cuCtxSetCurrent); where that cannot be done, False, and the caller does its work elsewhere.
        Vulkan (and the other APIs) take calls from any thread."""
        if self.backend != "cuda":
            return True
        return _make_cuda_context_current(self.device)

    def load_module(self, name: str, structures: int | None = None) -> Any:
        """Load ``shaders/<name>.slang`` for kernels of ``structures`` structures (None: any number; see
        :func:`structure_slots`), compiled once per process by slangpy, cached on disk; the same module object
        for every caller, with the kernels its calls have built."""
        import slangpy as spy

        key = (name, structure_slots(structures))
        if key not in self._modules:
            self._modules[key] = spy.Module.load_from_module(self.device,
                                                             self.session(structures).load_module(f"{name}.slang"))
        return self._modules[key]

    def load_module_from_source(self, name: str, source: str, structures: int | None = None,
                                defines: dict[str, str] | None = None) -> Any:
        """A module of generated source (``name`` unique to it: a digest of ``source``), as :meth:`load_module`;
        ``defines`` for every module of its session (the imported ones too), as :meth:`session`.

        The source is kept as a file among the generated modules (:func:`generated_module_path`, on the include
        path of a device with a module cache), and loaded from there by name: Slang's module cache then serves a
        later process its parsed module, as it does the shader folder's, instead of parsing the source again.
        Where that folder cannot be written, the source is parsed as it is."""
        import slangpy as spy

        session = self.session(structures, defines)
        folder = generated_module_path()
        if folder in map(Path, self.device.desc.compiler_options.include_paths):
            path = folder / f"{name}.slang"
            try:
                if not path.is_file():
                    path.parent.mkdir(parents=True, exist_ok=True)  # (a cleared cache)
                    write_text(path, source)
                return spy.Module.load_from_module(self.device, session.load_module(path.name))
            except OSError:
                pass
        return spy.Module.load_from_module(self.device, session.load_module_from_source(name, source))

    def session(self, structures: int | None = None, defines: dict[str, str] | None = None) -> Any:
        """The Slang session whose modules are compiled for ``structures`` structures: the device's own for
        the most slots, else one made on first use with STRUCTURE_SLOTS defined (its parsed modules cached
        apart, as they depend on it). ``defines`` (e.g. FIELD_COOPVEC) get a session of their own likewise: the
        modules they change are never those the device's other sessions hold."""
        slots = structure_slots(structures)
        extra = tuple(sorted((defines or {}).items()))
        if slots == STRUCTURE_SLOTS[-1] and not extra:
            return self.device.slang_session
        if (slots, extra) not in self._sessions:
            import slangpy as spy

            options = self.device.desc.compiler_options
            all_defines = {**dict(options.defines), "STRUCTURE_SLOTS": str(slots), **dict(extra)}
            cache = None
            if self.device.desc.module_cache_path:
                suffix = "".join(f"_{name}{value}" for name, value in extra)
                cache = Path(self.device.desc.module_cache_path) / f"slots{slots}{suffix}"
                cache.mkdir(parents=True, exist_ok=True)
            self._sessions[(slots, extra)] = self.device.create_slang_session(
                spy.SlangCompilerOptions({"include_paths": list(options.include_paths), "defines": all_defines}),
                cache_path=None if cache is None else str(cache))
        return self._sessions[(slots, extra)]


#: Bytes of stack a CUDA thread gets (cuCtxSetLimit), where set; the driver's default otherwise.
CUDA_STACK_ENV = "NEURALRAYCAST_CUDA_STACK_BYTES"


def _set_cuda_stack_bytes(context: GpuContext, size: int) -> bool:
    """Give each CUDA thread ``size`` bytes of stack (kernels whose calls keep large arrays need more than the
    driver's default)."""
    import ctypes

    with _cuda_context(context) as driver:
        try:
            return driver is not None and driver.cuCtxSetLimit(0, ctypes.c_size_t(size)) == 0  # CU_LIMIT_STACK_SIZE
        except (AttributeError, ctypes.ArgumentError):
            return False


def _cuda_context_handle(device: Any) -> int | None:
    """The CUDA context of a slangpy ``device``, or None where it names none."""
    import slangpy as spy

    handles = [handle.value for handle in device.native_handles if handle.type == spy.NativeHandleType.CUcontext]
    return int(handles[0]) if handles else None


def _make_cuda_context_current(device: Any) -> bool:
    """Make ``device``'s CUDA context current on the calling thread, and keep it so (see
    GpuContext.use_on_this_thread; :func:`_cuda_context` makes it current only for a while)."""
    import ctypes

    handle = _cuda_context_handle(device)
    driver = _cuda_driver() if handle is not None else None
    try:
        return driver is not None and driver.cuCtxSetCurrent(ctypes.c_void_p(handle)) == 0
    except (AttributeError, ctypes.ArgumentError):
        return False


def requested_backend(choice: str | None = None) -> str:
    """The backend asked for: the explicit argument, else (none, or ``auto``: the Slicer module's default)
    ``$NEURALRAYCAST_DEVICE``, else ``auto``."""
    if choice is not None and choice.strip().lower() in ("", "auto"):
        choice = None
    value = (choice or os.environ.get(DEVICE_ENV) or "auto").strip().lower()
    if value not in CHOICES:
        raise ValueError(f"unknown device '{value}': choose one of {', '.join(CHOICES)}")
    return value


def backend_order(wanted: str, system: str) -> tuple[str, ...]:
    """The backends to try, best first, for ``wanted`` (auto, or one by name) on ``system`` (platform.system()):
    a name alone; auto tries Metal, then Vulkan on macOS, and CUDA, then Vulkan elsewhere."""
    if wanted != "auto":
        return (wanted,)
    return MAC_BACKENDS if system == "Darwin" else BACKENDS


def shader_cache_path(backend: str) -> Path:
    return cache_folder("shaders") / backend


# Every device also keeps Slang's parsed modules on disk: a new process then loads them in a fraction of a
# second instead of parsing slangpy's and our modules again, which takes seconds of every start and most of
# the time opening a device takes. Slang checks each cached module against its sources and imports. It needs
# the folder of Slang's standard modules among the include paths, or a module importing one of them
# (`import slang.neural`) fails to resolve; a slangpy without that folder gets no module cache.
def module_cache_path(backend: str) -> Path:
    return cache_folder("modules") / backend


def generated_module_path() -> Path:
    """Where the modules of generated source (the field's, the latent appearance's) are kept as files, each named
    by a digest of its source (GpuContext.load_module_from_source): for every backend's module cache."""
    return cache_folder("modules") / "generated"


def _standard_module_dirs() -> list[str]:
    """Where slangpy ships Slang's standard modules (``slang/neural.slang`` among them)."""
    import slangpy as spy

    return sorted(str(p) for p in Path(spy.__file__).parent.glob("slang-standard-module-*") if p.is_dir())


def _quiet_slangpy_logs():
    """slangpy logs an ERROR line for every backend that is merely absent; probing should be silent."""
    import slangpy as spy

    logger = spy.Logger.get()
    previous = logger.level
    logger.level = spy.LogLevel.fatal
    return logger, previous


def _cuda_driver():
    """The CUDA driver library, or None: checked without asking slangpy (which prints to the console)."""
    import ctypes

    names = {"Windows": ["nvcuda.dll"], "Darwin": []}.get(platform.system(), ["libcuda.so.1", "libcuda.so"])
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _cuda_compute_capability(driver) -> int | None:
    """The first GPU's compute capability as 10 * major + minor (90 on an H100), or None.

    The shaders use it to pick instructions that only newer GPUs have (see ``addGradientPair``).
    """
    import ctypes

    major, minor, handle = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    try:
        if driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(handle), 0) != 0:
            return None
        # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76
        if driver.cuDeviceGetAttribute(ctypes.byref(major), 75, handle) != 0:
            return None
        if driver.cuDeviceGetAttribute(ctypes.byref(minor), 76, handle) != 0:
            return None
    except AttributeError:
        return None
    return 10 * major.value + minor.value


COOPERATIVE_ENV = "NEURALRAYCAST_COOPERATIVE"  # 0: never use the tensor-core networks
#: The tensor-core networks' oldest GPUs: compute capability 8.0 (A100), whose half-precision m16n8k16
#: instruction shaders/tensor_core.slang uses.
TENSOR_CORE_CAPABILITY = 80


def tensor_core_networks(backend: str, capability: int | None, setting: str) -> tuple[bool, str]:
    """Whether fields run their networks on tensor cores here, and the reason: on CUDA GPUs of compute
    capability 8.0 and newer (capability: 10 * major + minor, None where unknown), unless the
    NEURALRAYCAST_COOPERATIVE ``setting`` is "0". Elsewhere the per-thread networks compute the same."""
    if backend != "cuda":
        return False, "CUDA only; the per-thread networks run here"
    if capability is None:
        return False, "the GPU's compute capability is unknown"
    if capability < TENSOR_CORE_CAPABILITY:
        return False, f"compute capability {capability / 10:.1f}; they need {TENSOR_CORE_CAPABILITY / 10:.1f}"
    if setting == "0":
        return False, f"{COOPERATIVE_ENV}=0"
    return True, f"compute capability {capability / 10:.1f}"


COOPVEC_ENV = "NEURALRAYCAST_COOPVEC"  # 0: never; float: the weights' gradients summed in float (default half)
#: coopvec_mlp.slang's Kind of each NEURALRAYCAST_COOPVEC setting: where the weights' gradients are summed.
COOPVEC_KINDS = {"float": 2, "half": 1}


def coop_vector_networks(backend: str, cooperative_vector: bool, setting: str) -> tuple[int | None, str]:
    """The networks on cooperative vectors (the SDF fit's geometry network, and both in the renderer's kernels):
    coopvec_mlp.slang's Kind where it runs on them, else None, and the reason. On Vulkan devices that report
    them, unless the NEURALRAYCAST_COOPVEC ``setting`` is "0". The weights' gradients are summed in half unless
    it is "float": on an H100 the driver's float sums came back wrong (docs/shader-targets.md), its half sums
    right within half precision. Slang emits their instructions for every Vulkan device, so one without them
    (lavapipe) keeps the per-thread network."""
    if backend != "vulkan":
        return None, "Vulkan only"
    if not cooperative_vector:
        return None, "the Vulkan device has no cooperative vectors"
    value = setting.strip().lower()
    if value == "0":
        return None, f"{COOPVEC_ENV}=0"
    kind = COOPVEC_KINDS.get(value, COOPVEC_KINDS["half"])
    return kind, f"cooperative vectors, the weights' gradients summed in {'half' if kind == 1 else 'float'}"


@contextmanager
def _cuda_context(gpu: GpuContext) -> Iterator[Any]:
    """The CUDA driver with the device's own context current (popped after), or None where there is none
    (other backends, no driver, a driver without these entry points)."""
    import ctypes

    driver = _cuda_driver() if gpu.backend == "cuda" else None
    handle = _cuda_context_handle(gpu.device) if driver is not None else None
    try:
        pushed = handle is not None and driver.cuCtxPushCurrent_v2(ctypes.c_void_p(handle)) == 0
    except (AttributeError, ctypes.ArgumentError):
        pushed = False
    try:
        yield driver if pushed else None
    finally:
        if pushed:
            driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


def _cuda_memory(gpu: GpuContext) -> tuple[int, int] | None:
    """(free, total) bytes of the GPU a CUDA device runs on, or None (other backends, no driver)."""
    import ctypes

    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    with _cuda_context(gpu) as driver:
        try:
            if driver is None or driver.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
                return None
        except (AttributeError, ctypes.ArgumentError):  # a driver without this entry point, or another signature
            return None
    return free.value, total.value


def device_memory_in_use(gpu: GpuContext) -> int | None:
    """Bytes in use on the GPU a CUDA device runs on (total less free, every process's, this one's context
    included), or None where it cannot be read (other backends, no driver)."""
    memory = _cuda_memory(gpu)
    return None if memory is None else memory[1] - memory[0]


def use_memory_budget(gpu: GpuContext, explicit: str | int | None = None,
                      option: str = "--gpu-memory") -> MemoryBudget:
    """Set and return the GPU memory budget of ``gpu``'s work: ``explicit`` (given as ``option``), else
    $NEURALRAYCAST_GPU_MEMORY, else the device's (memory_budget.py). ValueError for a bad value."""
    at_open = getattr(gpu, "memory_at_open", None) or (None, None)
    gpu.memory = resolve_budget(explicit, *at_open, gpu.report.software, option, gpu.backend == "cuda")
    return gpu.memory


def memory_budget(gpu: GpuContext) -> MemoryBudget:
    """The budget every consumer sizes its work to (resolved on first use where nothing set it)."""
    return getattr(gpu, "memory", None) or use_memory_budget(gpu)


def device_memory_total(gpu: GpuContext) -> int | None:
    """Bytes of memory of the GPU a CUDA device runs on, or None where it cannot be read."""
    memory = _cuda_memory(gpu)
    return None if memory is None else memory[1]


def cuda_host_pointer(gpu: GpuContext, address: int) -> int | None:
    """Where the host reads CUDA memory at device ``address`` that is host memory (a read-back buffer), or
    None: other memory, other backends, no driver."""
    import ctypes

    kind, host = ctypes.c_uint(), ctypes.c_void_p()
    with _cuda_context(gpu) as driver:
        try:
            # CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2 (CU_MEMORYTYPE_HOST = 1), CU_POINTER_ATTRIBUTE_HOST_POINTER = 4
            if driver is None or driver.cuPointerGetAttribute(ctypes.byref(kind), 2, ctypes.c_uint64(address)) != 0:
                return None
            if kind.value != 1 or driver.cuPointerGetAttribute(ctypes.byref(host), 4, ctypes.c_uint64(address)) != 0:
                return None
        except (AttributeError, ctypes.ArgumentError):
            return None
    return host.value or None


#: Names a CPU implementation of Vulkan gives its adapter.
SOFTWARE_ADAPTERS = ("llvmpipe", "lavapipe", "swiftshader", "software")


def gpu_driver(adapter_names: list[str]) -> bool:
    """Whether the Vulkan kernels take the forms that pay on a GPU (NEURALRAYCAST_GPU_DRIVER): gradient atomics
    aggregated over a wave (shaders/params.slang) and the hash table read without a branch per pair of entries
    (shaders/hash_encoding.slang). Only where every adapter the driver lists is a GPU: a CPU driver (lavapipe)
    takes minutes to compile the first and runs the second no faster; where one is listed it may be the device
    that opens."""
    return bool(adapter_names) and not any(
        word in name.lower() for name in adapter_names for word in SOFTWARE_ADAPTERS)


def _open(backend: str) -> tuple[Any, int | None]:
    """The device, proven to run a kernel, and (CUDA) its GPU's compute capability."""
    import slangpy as spy

    # The CUDA compute capability (shaders/params.slang), 0 on other backends, and whether the device is a GPU
    # (CUDA's always; Vulkan's where its driver lists only GPUs): always defined, so the shader compiler has no
    # undefined name in `#if` to warn about.
    defines = {"NEURALRAYCAST_CUDA_SM": "0", "NEURALRAYCAST_GPU_DRIVER": "1" if backend == "cuda" else "0"}
    capability = None
    if backend == "vulkan":
        adapters = [adapter.name for adapter in spy.Device.enumerate_adapters(spy.DeviceType.vulkan)]
        defines["NEURALRAYCAST_GPU_DRIVER"] = "1" if gpu_driver(adapters) else "0"
    if backend == "cuda":
        if (driver := _cuda_driver()) is None:
            raise RuntimeError("no NVIDIA driver (CUDA driver library not found)")
        if capability := _cuda_compute_capability(driver):
            defines["NEURALRAYCAST_CUDA_SM"] = str(capability)

    cache = shader_cache_path(backend)
    cache.mkdir(parents=True, exist_ok=True)
    include_paths = [spy.SHADER_PATH, str(shader_dir())]
    modules: dict[str, str] = {}
    if standard := _standard_module_dirs():
        include_paths += standard
        module_cache_path(backend).mkdir(parents=True, exist_ok=True)
        modules["module_cache_path"] = str(module_cache_path(backend))
        with contextlib.suppress(OSError):  # without it, generated modules are parsed from their source each time
            generated_module_path().mkdir(parents=True, exist_ok=True)
            include_paths.append(str(generated_module_path()))
    device = spy.Device(
        type=getattr(spy.DeviceType, backend),
        compiler_options={
            "include_paths": include_paths,
            "enable_experimental_features": True,  # `import slang.neural;` in a user's own modules
            "defines": defines,
        },
        shader_cache_path=str(cache),
        shader_cache_size=SHADER_CACHE_BYTES,
        # slangpy's default reloads every module when a file in a shader folder changes, and that leaves
        # every tensor and module made before unusable ("Reflection object has been invalidated"): an
        # extension update writing there would break a training under way.
        enable_hot_reload=False,
        **modules,
    )
    # A device can open and still fail on its first dispatch (old Mesa, broken driver): prove it works.
    module = spy.Module.load_from_file(device, "device_check.slang")
    a = np.arange(8, dtype=np.float32)
    got = module.deviceCheck(a, 2.0, _result="numpy")
    if not np.allclose(got, a * 2.0 + 1.0):
        raise RuntimeError(f"test kernel returned wrong values {got[:4]}")
    return device, capability


def _report(device, backend: str, capability: int | None, tried: dict[str, str]) -> DeviceReport:
    import slangpy as spy

    names = sorted(str(f).split(".")[-1] for f in device.features)
    tensor_cores, why = tensor_core_networks(backend, capability, os.environ.get(COOPERATIVE_ENV, "1"))
    return DeviceReport(
        backend=backend,
        adapter=device.info.adapter_name,
        software="software_device" in names or "llvmpipe" in device.info.adapter_name.lower(),
        features=names,
        cooperative_vector="cooperative_vector" in names,
        cooperative_matrix="cooperative_matrix" in names,
        slangpy_version=spy.__version__,
        python_version=platform.python_version(),
        shader_cache=str(shader_cache_path(backend)),
        module_cache=str(device.desc.module_cache_path or ""),
        shader_dir=str(shader_dir()),
        tried=tried,
        compute_capability=capability,
        tensor_cores=f"{'yes' if tensor_cores else 'no'} ({why})",
    )


_CONTEXTS: dict[str, GpuContext] = {}


class _RefuseTorch:
    """An import hook that answers "not installed" for PyTorch (see :func:`import_slangpy`)."""

    def find_spec(self, name: str, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (not loaded with slangpy)", name=name)
        return None


def import_slangpy():
    """Import slangpy without PyTorch, unless PyTorch is already loaded.

    Wherever PyTorch is installed, slangpy's native module imports it while slangpy itself is imported (for
    its torch-tensor interop), and slangpy's first call looks for it again. That makes ``import slangpy``
    many times slower, and adds seconds to a process that opens a device and makes one call. NeuralRaycast
    never hands torch tensors to slangpy, so while slangpy loads, ``import torch`` is refused, and slangpy is
    told it has no torch; ``import torch`` works as usual afterwards. Where torch is already loaded (a Slicer
    session that uses it) nothing is changed: slangpy finds it at no cost.
    """
    if "slangpy" in sys.modules or "torch" in sys.modules:
        import slangpy

        return slangpy
    refuse = _RefuseTorch()
    sys.meta_path.insert(0, refuse)
    try:
        import slangpy
    finally:
        sys.meta_path.remove(refuse)
    try:  # slangpy 0.43's first call imports torch unless told it was looked for
        from slangpy.torchintegration import detection
    except ImportError:  # another slangpy: nothing to tell it
        return slangpy
    if getattr(detection, "_torch_module", False) is None:
        detection._torch_module = False
    return slangpy


def open_device(choice: str | None = None, gpu_memory: str | int | None = None) -> GpuContext:
    """Open (once per process and backend) the best working device, or raise GpuUnavailableError. Every call
    sets its memory budget: ``gpu_memory`` where given (``--gpu-memory``), else as :func:`use_memory_budget`
    finds it, so one caller's budget never outlives its call's work for the next."""
    wanted = requested_backend(choice)
    if wanted in _CONTEXTS:
        context = _CONTEXTS[wanted]
        use_memory_budget(context, gpu_memory)
        return context
    from .platforms import platform_support, this_platform

    here = platform_support(this_platform(), wanted)
    try:
        import_slangpy()
    except ImportError as error:
        if not here.wheel:  # installing would not help: say so, and what is supported
            raise GpuUnavailableError(f"slangpy cannot be installed on {here.reason}") from error
        raise GpuUnavailableError(
            f"slangpy is not installed ({error}); run `make demo` or `pip install slangpy==0.43.1`"
        ) from error
    route_slangpy_messages()  # the compiler's warnings into a log file, not the user's terminal

    order = backend_order(wanted, here.platform.system)
    tried: dict[str, str] = {}
    logger, level = _quiet_slangpy_logs()
    try:
        for backend in order:
            try:
                device, capability = _open(backend)
            except Exception as error:  # each backend fails in its own way; keep the reason
                tried[backend] = " ".join(str(error).split())[:200] or type(error).__name__
                continue
            context = GpuContext(device, backend, _report(device, backend, capability, tried))
            context.memory_at_open = _cuda_memory(context)
            if backend == "cuda" and os.environ.get(CUDA_STACK_ENV):
                _set_cuda_stack_bytes(context, int(os.environ[CUDA_STACK_ENV]))
            _CONTEXTS[wanted] = _CONTEXTS[backend] = context
            break
        else:
            context = None
    finally:
        logger.level = level
    if context is not None:
        use_memory_budget(context, gpu_memory)
        return context
    reasons = "; ".join(f"{name}: {why}" for name, why in tried.items())
    supported = "" if here.runs else f" {here.reason}."
    raise GpuUnavailableError(f"no GPU device works on {here.platform.describe()} ({reasons}).{supported} "
                              f"{INSTALL_HINT}")


class PassClock:
    """Seconds per named pass of GPU work, waiting for the device at each lap; does nothing without a dict."""

    def __init__(self, gpu: GpuContext, timings: dict[str, float] | None) -> None:
        self.gpu, self.timings = gpu, timings
        self.last = time.perf_counter() if timings is not None else 0.0

    def lap(self, name: str) -> None:
        if self.timings is None:
            return
        self.gpu.device.wait()
        now = time.perf_counter()
        self.timings[name] = self.timings.get(name, 0.0) + now - self.last
        self.last = now

    def skip(self) -> None:
        """Start the next lap here without recording this one: the passes in between were timed on their own
        (into the same dict), and a lap over them would count them twice in the sum of the phases."""
        if self.timings is not None:
            self.gpu.device.wait()
            self.last = time.perf_counter()


#: Reads of this size or more take CUDA's pinned-buffer way (ReadBack): frames arrive sooner that way than
#: through the tensor's own read, the larger the frame the more so (BENCHMARKS.md).
PINNED_READ_BYTES = 1 << 20
#: Pinned host buffers a CUDA ReadBack lends out at most: the arrays of that many reads can be held at once
#: before a read copies into a fresh array instead.
PINNED_FRAMES = 3


class _PinnedLease:
    """The owner (numpy ``base``) of the arrays one read returns, a view of pinned host memory: every array
    made from them, views included, keeps it and so the buffer alive; while any lives the buffer is lent."""

    def __init__(self, pinned: _PinnedBuffer) -> None:
        self.buffer = pinned.buffer
        self.__array_interface__ = {"shape": (pinned.size // 4,), "typestr": "<f4",
                                    "data": (pinned.address, False), "version": 3}


@dataclass
class _PinnedBuffer:
    """A CUDA read-back buffer (pinned host memory) and the lease of the last read into it."""

    buffer: Any
    address: int
    size: int
    lease: Any = None  # weakref to a _PinnedLease

    @property
    def free(self) -> bool:
        return self.lease is None or self.lease() is None


class ReadBack:
    """Reads float32 device tensors into numpy. An array one read returns never changes with a later read.

    - Every device but CUDA (Vulkan, Metal, D3D12, software devices): through a host-readable buffer kept
      between reads (made again when the size changes), then its ``to_numpy``; a large G-buffer takes markedly
      less time so than through the tensor's own ``to_numpy``, which makes a staging buffer each read, on
      lavapipe as on a GPU's Vulkan driver (BENCHMARKS.md).
    - CUDA, reads of :data:`PINNED_READ_BYTES` or more: into pinned host memory that the returned array is a
      view of (no copy on the host), one of up to :data:`PINNED_FRAMES` buffers, each read into again once no
      array of its last read is left; while all are held, into a buffer kept for that and copied from there
      into an array numpy allocates. A read into pinned memory is many times faster than the tensor's
      ``to_numpy``, and with that copy (fresh pages fault in one by one) still faster (BENCHMARKS.md).
      Smaller reads take ``to_numpy``.
    """

    def __init__(self, gpu: GpuContext) -> None:
        self.gpu = gpu
        self.kept = gpu.backend != "cuda"
        self._kept: Any = None  # the buffer that is copied from (software devices; CUDA with every lease held)
        self._lent: list[_PinnedBuffer] = []  # CUDA: pinned buffers whose memory arrays are views of
        self._unmapped = False  # CUDA gave a pinned buffer no host address: the tensor's own read

    def read(self, tensor: Any) -> np.ndarray:
        size = int(np.prod(tensor.shape)) * 4
        if self.kept:
            self._kept = self._copy_into(self._kept, tensor, size)
            return self._kept.to_numpy().view(np.float32)
        if self.gpu.backend == "cuda" and size >= PINNED_READ_BYTES and not self._unmapped:
            pinned = self._free_pinned(size)
            if pinned is not None:
                self._copy_into(pinned.buffer, tensor, size)
                lease = _PinnedLease(pinned)
                pinned.lease = weakref.ref(lease)
                return np.asarray(lease)
            self._kept = self._copy_into(self._kept, tensor, size)  # every lease held: copy
            address = cuda_host_pointer(self.gpu, self._kept.device_address)
            if address is not None:
                return np.array(_PinnedLease(_PinnedBuffer(self._kept, address, size)), copy=True)
        return np.asarray(tensor.to_numpy(), np.float32).reshape(-1)

    def _copy_into(self, buffer: Any, tensor: Any, size: int) -> Any:
        """``tensor`` copied into ``buffer`` (a new host-readable one where None or of another size), waited
        for; returns the buffer."""
        if buffer is None or buffer.size != size:
            buffer = self._host_buffer(size)
        encoder = self.gpu.device.create_command_encoder()
        encoder.copy_buffer(buffer, 0, tensor.storage, 0, size)
        self.gpu.device.submit_command_buffer(encoder.finish())
        self.gpu.device.wait()
        return buffer

    def _host_buffer(self, size: int) -> Any:
        import slangpy as spy

        with device_memory(f"a host copy of {size:,} bytes"):
            return self.gpu.device.create_buffer(size=size, memory_type=spy.MemoryType.read_back,
                                                 usage=spy.BufferUsage.copy_destination | spy.BufferUsage.copy_source)

    def _free_pinned(self, size: int) -> _PinnedBuffer | None:
        """A pinned buffer of ``size`` bytes that no live array uses: a lent one, else a new one while fewer than
        PINNED_FRAMES are lent (a free one of another size makes room). None: all held, or no host address."""
        for pinned in self._lent:
            if pinned.size == size and pinned.free:
                return pinned
        if len(self._lent) >= PINNED_FRAMES:
            stale = next((pinned for pinned in self._lent if pinned.free), None)
            if stale is None:
                return None
            self._lent.remove(stale)
        buffer = self._host_buffer(size)
        address = cuda_host_pointer(self.gpu, buffer.device_address)
        if address is None:
            self._unmapped = True
            return None
        self._lent.append(_PinnedBuffer(buffer, address, size))
        return self._lent[-1]
