"""The platform table: where slangpy has a wheel and a device is known to open, and the one line that refuses
the others (the Slicer module before it installs anything, ``neuralraycast info``, a failed device open)."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest

from NeuralRaycastLib.gpu import platforms
from NeuralRaycastLib.gpu.platforms import Platform, UnsupportedPlatformError, check_platform, platform_support

SUPPORTED = "Windows x64, Linux x86-64 and Linux aarch64 (Linux: glibc 2.34 or newer), with CPython 3.9 to 3.14"

#: Each platform slangpy 0.43.1 has a wheel for, as the interpreter there reports itself, and that wheel's tag.
WHEELS = [
    (Platform("Windows", "AMD64", (3, 12)), "win_amd64"),
    (Platform("Linux", "x86_64", (3, 12), libc=("glibc", (2, 35))), "manylinux_2_34_x86_64"),
    (Platform("Linux", "aarch64", (3, 12), libc=("glibc", (2, 39))), "manylinux_2_34_aarch64"),
    (Platform("Darwin", "arm64", (3, 12), macos=(26, 0)), "macosx_26_0_arm64"),
]


@pytest.mark.parametrize(("here", "tag"), WHEELS)
def test_each_platform_with_a_wheel_finds_its_tag(here, tag):
    assert platform_support(here, "vulkan").wheel.tag == tag


@pytest.mark.parametrize(("here", "why"), [
    (Platform("Windows", "ARM64", (3, 12)), "Windows arm64, CPython 3.12: slangpy 0.43.1 has no wheel for Windows "
                                            "on arm64"),
    (Platform("Darwin", "x86_64", (3, 12), macos=(15, 4)), "macOS x86_64, macOS 15.4, CPython 3.12: slangpy 0.43.1 "
                                                           "has no wheel for macOS on x86_64"),
    (Platform("Linux", "x86_64", (3, 12), libc=("glibc", (2, 31))), "Linux x86_64, glibc 2.31, CPython 3.12: "
                                                                    "slangpy's Linux wheels need glibc 2.34 or newer "
                                                                    "(this system has 2.31)"),
    (Platform("Linux", "x86_64", (3, 12), libc=("musl", (1, 2))), "slangpy's Linux wheels need glibc (this "
                                                                  "system's C library is musl)"),
    (Platform("Linux", "x86_64", (3, 8), libc=("glibc", (2, 36))), "slangpy 0.43.1 has no wheel for Python 3.8"),
    (Platform("Linux", "x86_64", (3, 15), libc=("glibc", (2, 36))), "slangpy 0.43.1 has no wheel for Python 3.15"),
    (Platform("Linux", "x86_64", (3, 12), "PyPy", ("glibc", (2, 36))), "slangpy's wheels are for CPython, not PyPy"),
    (Platform("Darwin", "arm64", (3, 12), macos=(15, 6)), "slangpy's macOS wheels need macOS 26.0 or newer"),
])
def test_a_platform_without_a_wheel_is_refused_naming_it_and_what_is_supported(here, why):
    support = platform_support(here)
    assert not support.runs and support.wheel is None
    assert why in support.reason
    assert support.reason.endswith(SUPPORTED)
    with pytest.raises(UnsupportedPlatformError, match="^" + re.escape(here.describe())):
        check_platform(here=here)


def test_a_mac_installs_slangpy_but_no_device_is_known_to_open_unless_metal_or_vulkan_is_asked_for():
    """slangpy has a wheel for macOS 26 on Apple silicon, and NeuralRaycast tries Metal, then Vulkan there, but
    has not been run on a Mac: the module refuses unless the device is set to metal or vulkan."""
    mac = Platform("Darwin", "arm64", (3, 12), macos=(26, 1))
    for device in ("auto", "cuda"):
        support = platform_support(mac, device)
        assert not support.runs and support.wheel.tag == "macosx_26_0_arm64"
        assert support.reason.startswith("macOS arm64, macOS 26.1, CPython 3.12: slangpy installs, and NeuralRaycast "
                                         "tries Metal, then Vulkan (a driver over Metal, MoltenVK), but has not been "
                                         "run on a Mac: set the device to metal or vulkan to try them")
    for device in ("metal", "vulkan"):
        assert platform_support(mac, device).runs
        assert platform_support(mac, device).describe().startswith(
            "macOS arm64, macOS 26.1, CPython 3.12: slangpy 0.43.1 wheel macosx_26_0_arm64; devices tried: the "
            "device asked for (slangpy installs")


def test_what_each_platform_gets():
    """CUDA gets the tensor-core networks, Vulkan (GPUs and lavapipe) the per-thread ones; lavapipe is listed
    where Mesa's Linux drivers are."""
    linux = platform_support(Platform("Linux", "x86_64", (3, 12), libc=("glibc", (2, 36)))).describe()
    assert linux.startswith("Linux x86_64, glibc 2.36, CPython 3.12: slangpy 0.43.1 wheel manylinux_2_34_x86_64; "
                            "devices tried: CUDA on NVIDIA GPUs (tensor-core networks from compute capability 8.0")
    assert ("else Vulkan on NVIDIA, AMD and Intel GPUs (the per-thread networks; on cooperative vectors where the GPU "
            "has them: the SDF fit's geometry network, and both networks in the renders); else Mesa's lavapipe"
            ) in linux
    windows = platform_support(Platform("Windows", "AMD64", (3, 12))).describe()
    assert "CUDA on NVIDIA GPUs" in windows and "lavapipe" not in windows
    summary = platforms.platforms_summary()
    assert summary.startswith(f"NeuralRaycast runs where slangpy 0.43.1 has a wheel and a device opens: {SUPPORTED}.")
    assert "macOS 26 or newer on Apple silicon: slangpy installs, and NeuralRaycast tries Metal, then Vulkan" \
        in summary


def test_this_interpreter_is_read_as_the_wheel_tags_read_it():
    here = platforms.this_platform()
    assert here.python == tuple(sys.version_info[:2])
    if sys.platform.startswith("linux"):
        assert here.system == "Linux" and here.libc is not None and here.libc[0] == "glibc"


def test_info_refuses_an_unsupported_platform_in_one_line(monkeypatch, capsys):
    from NeuralRaycastLib.app.cli import main

    monkeypatch.setattr(platforms, "this_platform", lambda: Platform("Windows", "ARM64", (3, 12)))
    assert main(["info"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "Windows arm64, CPython 3.12: slangpy 0.43.1 has no wheel for Windows on arm64" in err
    assert err.endswith(SUPPORTED)


def on_linux_with_glibc(monkeypatch, version: tuple[int, int]) -> None:
    """The platform read as Linux x86_64 with CPython 3.12 and this glibc."""
    monkeypatch.setattr(platforms, "this_platform", lambda: Platform("Linux", "x86_64", (3, 12),
                                                                     libc=("glibc", version)))


def test_without_slangpy_an_unsupported_platform_says_installing_would_not_help(monkeypatch):
    import NeuralRaycastLib.gpu.device as device

    monkeypatch.setitem(sys.modules, "slangpy", None)  # importing it fails
    monkeypatch.setattr(device, "_CONTEXTS", {})
    on_linux_with_glibc(monkeypatch, (2, 28))
    with pytest.raises(device.GpuUnavailableError) as raised:
        device.open_device("auto")
    assert str(raised.value).startswith("slangpy cannot be installed on Linux x86_64, glibc 2.28, CPython 3.12: "
                                        "slangpy's Linux wheels need glibc 2.34 or newer")
    on_linux_with_glibc(monkeypatch, (2, 36))
    with pytest.raises(device.GpuUnavailableError, match="slangpy is not installed"):
        device.open_device("auto")


def test_where_no_device_opens_the_message_names_the_platform(monkeypatch):
    import NeuralRaycastLib.gpu.device as device

    def fails(backend):
        raise RuntimeError(f"no {backend} here")

    monkeypatch.setattr(device, "_CONTEXTS", {})
    monkeypatch.setattr(device, "_open", fails)
    on_linux_with_glibc(monkeypatch, (2, 36))
    with pytest.raises(device.GpuUnavailableError) as raised:
        device.open_device("auto")
    assert str(raised.value).startswith("no GPU device works on Linux x86_64, glibc 2.36, CPython 3.12 (cuda: no "
                                        "cuda here; vulkan: no vulkan here). Install one of:")
    monkeypatch.setattr(platforms, "this_platform", lambda: Platform("Darwin", "arm64", (3, 12), macos=(26, 0)))
    with pytest.raises(device.GpuUnavailableError) as raised:
        device.open_device("cuda")
    assert "no GPU device works on macOS arm64, macOS 26.0, CPython 3.12 (cuda: no cuda here). macOS arm64" in \
        str(raised.value) and "tries Metal, then Vulkan" in str(raised.value)
    with pytest.raises(device.GpuUnavailableError) as raised:
        device.open_device("auto")
    assert str(raised.value).startswith("no GPU device works on macOS arm64, macOS 26.0, CPython 3.12 (metal: no "
                                        "metal here; vulkan: no vulkan here).")


def test_auto_tries_metal_then_vulkan_on_macos_and_cuda_then_vulkan_elsewhere(monkeypatch):
    """The devices `auto` opens, best first, on each system; a device asked for by name is the only one tried,
    and the first that opens is the one every later call gets."""
    import NeuralRaycastLib.gpu.device as device

    assert device.backend_order("auto", "Darwin") == ("metal", "vulkan")
    for system in ("Linux", "Windows"):
        assert device.backend_order("auto", system) == ("cuda", "vulkan")
    assert device.backend_order("metal", "Darwin") == ("metal",)
    assert device.backend_order("vulkan", "Darwin") == ("vulkan",)
    assert device.requested_backend("Metal") == "metal"

    tried = []

    def vulkan_only(backend):
        tried.append(backend)
        if backend != "vulkan":
            raise RuntimeError(f"no {backend} here")
        return object(), None

    monkeypatch.setattr(device, "_CONTEXTS", {})
    monkeypatch.setattr(device, "_open", vulkan_only)
    monkeypatch.setattr(device, "_report", lambda *args: SimpleNamespace(backend=args[1]))
    monkeypatch.setattr(device, "_cuda_memory", lambda context: None)
    monkeypatch.setattr(device, "use_memory_budget", lambda context, memory: None)
    monkeypatch.setattr(platforms, "this_platform", lambda: Platform("Darwin", "arm64", (3, 12), macos=(26, 0)))
    assert device.open_device("auto").backend == "vulkan"
    assert tried == ["metal", "vulkan"]
