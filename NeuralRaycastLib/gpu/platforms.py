"""Which platforms NeuralRaycast runs on, and what each gets: a pure table, read before anything is installed.

NeuralRaycast computes through slangpy, a compiled package: where slangpy has no wheel for the interpreter and
the operating system, installing it fails (or builds from source for a long while and fails), so the Slicer
module and ``neuralraycast info`` look the platform up here first and say what is supported. Nothing here
imports slangpy or opens a device.

slangpy 0.43.1 ships wheels for CPython 3.9 to 3.14 (Slicer's Python is 3.12) on Windows x64, Linux x86-64 and
aarch64 with glibc 2.34 or newer (manylinux_2_34), and macOS 26 or newer on Apple silicon. Of slangpy's
devices NeuralRaycast opens CUDA, then Vulkan, and on macOS Metal, then Vulkan (gpu/device.py's order); no
device has been opened on a Mac yet, so there the device must be asked for by name.
"""

from __future__ import annotations

import platform
import re
import sys
import sysconfig
from dataclasses import dataclass

SLANGPY_VERSION = "0.43.1"
#: The CPython versions slangpy's wheels are built for (cp39 to cp314).
PYTHON_VERSIONS = ((3, 9), (3, 10), (3, 11), (3, 12), (3, 13), (3, 14))
#: manylinux_2_34: the oldest glibc the Linux wheels run on.
GLIBC_MINIMUM = (2, 34)
#: macosx_26_0_arm64: the oldest macOS the Mac wheels install on.
MACOS_MINIMUM = (26, 0)

#: What a GPU gets where CUDA opens, and what Vulkan gets (gpu/device.py tries CUDA first).
CUDA_DEVICES = ("CUDA on NVIDIA GPUs (tensor-core networks from compute capability 8.0; the per-thread "
                "networks on older GPUs)")
VULKAN_DEVICES = ("Vulkan on NVIDIA, AMD and Intel GPUs (the per-thread networks; on cooperative vectors where "
                  "the GPU has them: the SDF fit's geometry network, and both networks in the renders)")
LAVAPIPE = "Mesa's lavapipe on the CPU (Vulkan, the per-thread networks; slow, the quick preset)"
METAL_UNTRIED = ("slangpy installs, and NeuralRaycast tries Metal, then Vulkan (a driver over Metal, MoltenVK), but "
                 "has not been run on a Mac: set the device to metal or vulkan to try them")
#: The devices that may be asked for by name where none is known to open (a Mac's).
UNTRIED_DEVICES = ("metal", "vulkan")


@dataclass(frozen=True)
class WheelPlatform:
    """One platform slangpy has a wheel for: the wheel's platform tag, its name in words, and its devices."""

    system: str   # platform.system()
    machine: str  # the interpreter's architecture, normalised (x86_64, aarch64, arm64)
    tag: str
    name: str
    devices: tuple[str, ...]  # what NeuralRaycast opens there, best first; empty: none known to open
    note: str = ""


#: The wheels of slangpy 0.43.1, one a platform, with what NeuralRaycast gets on each.
WHEEL_PLATFORMS = (
    WheelPlatform("Windows", "x86_64", "win_amd64", "Windows x64", (CUDA_DEVICES, VULKAN_DEVICES)),
    WheelPlatform("Linux", "x86_64", "manylinux_2_34_x86_64", "Linux x86-64",
                  (CUDA_DEVICES, VULKAN_DEVICES, LAVAPIPE)),
    WheelPlatform("Linux", "aarch64", "manylinux_2_34_aarch64", "Linux aarch64",
                  (CUDA_DEVICES, VULKAN_DEVICES, LAVAPIPE), note="not yet run on such a machine"),
    WheelPlatform("Darwin", "arm64", "macosx_26_0_arm64", "macOS 26 or newer on Apple silicon", (),
                  note=METAL_UNTRIED),
)


@dataclass(frozen=True)
class Platform:
    """What the wheel tags depend on: the interpreter and the system it runs on."""

    system: str                                # Windows, Linux, Darwin, ...
    machine: str                               # the interpreter's architecture
    python: tuple[int, int]
    implementation: str = "CPython"
    libc: tuple[str, tuple[int, ...]] | None = None  # Linux: ("glibc", version), ("musl", ()) or None (unknown)
    macos: tuple[int, ...] | None = None       # macOS version

    def describe(self) -> str:
        system = {"Darwin": "macOS"}.get(self.system, self.system)
        parts = [f"{system} {normalised_machine(self.machine)}"]
        if self.macos:
            parts.append(f"macOS {_dotted(self.macos)}")
        if self.libc:
            parts.append(f"{self.libc[0]} {_dotted(self.libc[1])}".strip())
        parts.append(f"{self.implementation} {_dotted(self.python)}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Support:
    """Whether NeuralRaycast can run here and what it gets; ``reason`` says why not, naming the platform and
    what is supported."""

    platform: Platform
    wheel: WheelPlatform | None  # the slangpy wheel that installs here; None: none does
    runs: bool                    # a wheel installs and a device is known to open with the device asked for
    reason: str                   # empty where it runs

    def describe(self) -> str:
        """One line for ``neuralraycast info`` and the module: the platform, its wheel and its devices."""
        if not self.runs:
            return self.reason
        devices = "; else ".join(self.wheel.devices) or "the device asked for"
        note = f" ({self.wheel.note})" if self.wheel.note else ""
        return (f"{self.platform.describe()}: slangpy {SLANGPY_VERSION} wheel {self.wheel.tag}; devices tried: "
                f"{devices}{note}")


class UnsupportedPlatformError(RuntimeError):
    """NeuralRaycast cannot run on this platform; the message names it and what is supported."""


def _dotted(version) -> str:
    return ".".join(str(part) for part in version)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text or "")[:3])


def normalised_machine(machine: str) -> str:
    """An architecture under one name: AMD64 and x64 are x86_64; ARM64 on Linux is aarch64."""
    value = (machine or "").strip().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "x86-64": "x86_64", "arm64": "arm64", "aarch64": "aarch64",
            "win32": "x86", "i386": "x86", "i686": "x86"}.get(value, value)


def supported_platforms() -> str:
    """The platforms NeuralRaycast trains on, in words (the end of every refusal)."""
    runs = [wheel.name for wheel in WHEEL_PLATFORMS if wheel.devices]
    low, high = PYTHON_VERSIONS[0], PYTHON_VERSIONS[-1]
    return (f"NeuralRaycast runs where slangpy {SLANGPY_VERSION} has a wheel and a device opens: "
            f"{', '.join(runs[:-1])} and {runs[-1]} (Linux: glibc {_dotted(GLIBC_MINIMUM)} or newer), with CPython "
            f"{_dotted(low)} to {_dotted(high)}")


def _wheel_for(here: Platform) -> tuple[WheelPlatform | None, str]:
    """The slangpy wheel that installs on ``here``, or None and why none does."""
    if here.implementation != "CPython":
        return None, f"slangpy's wheels are for CPython, not {here.implementation}"
    if here.python not in PYTHON_VERSIONS:
        return None, f"slangpy {SLANGPY_VERSION} has no wheel for Python {_dotted(here.python)}"
    machine = normalised_machine(here.machine)
    if here.system == "Linux" and machine == "arm64":
        machine = "aarch64"
    matches = [wheel for wheel in WHEEL_PLATFORMS if wheel.system == here.system and wheel.machine == machine]
    if not matches:
        system = {"Darwin": "macOS"}.get(here.system, here.system)
        return None, f"slangpy {SLANGPY_VERSION} has no wheel for {system} on {machine}"
    wheel = matches[0]
    if here.system == "Linux":
        if here.libc is not None and here.libc[0] != "glibc":
            return None, f"slangpy's Linux wheels need glibc (this system's C library is {here.libc[0]})"
        if here.libc is not None and here.libc[1] and here.libc[1][:2] < GLIBC_MINIMUM:
            return None, (f"slangpy's Linux wheels need glibc {_dotted(GLIBC_MINIMUM)} or newer (this system has "
                          f"{_dotted(here.libc[1])})")
    if here.system == "Darwin" and here.macos is not None and here.macos[:2] < MACOS_MINIMUM:
        return None, f"slangpy's macOS wheels need macOS {_dotted(MACOS_MINIMUM)} or newer"
    return wheel, ""


def platform_support(here: Platform, device: str = "auto") -> Support:
    """Whether NeuralRaycast runs on ``here`` with ``device`` (auto, cuda, vulkan or metal) asked for, and what
    it gets: a pure function of the table above. Where no device is known to open, one asked for by name
    (UNTRIED_DEVICES) is let through to be tried."""
    wheel, why = _wheel_for(here)
    if wheel is None:
        return Support(here, None, False, f"{here.describe()}: {why}. {supported_platforms()}")
    if not wheel.devices and device not in UNTRIED_DEVICES:
        return Support(here, wheel, False, f"{here.describe()}: {wheel.note}. {supported_platforms()}")
    return Support(here, wheel, True, "")


def _libc() -> tuple[str, tuple[int, ...]] | None:
    name, version = platform.libc_ver()
    if name == "glibc":
        return "glibc", _version(version)
    if name:
        return name, _version(version)
    return None


def this_platform() -> Platform:
    """The running interpreter and system, as the wheel tags read them (the interpreter's architecture: a
    32-bit or emulated Python is what a wheel must match)."""
    system = platform.system()
    machine = platform.machine()
    if system == "Windows":  # the interpreter's own build: win-amd64, win-arm64, win32
        machine = {"win-amd64": "x86_64", "win-arm64": "arm64", "win32": "x86"}.get(sysconfig.get_platform(),
                                                                                      machine)
    elif sys.maxsize <= 2**32 and normalised_machine(machine) == "x86_64":
        machine = "x86"
    return Platform(system=system, machine=machine, python=tuple(sys.version_info[:2]),
                    implementation=platform.python_implementation(),
                    libc=_libc() if system == "Linux" else None,
                    macos=(_version(platform.mac_ver()[0]) or None) if system == "Darwin" else None)


def check_platform(device: str = "auto", here: Platform | None = None) -> Support:
    """This platform's support, or UnsupportedPlatformError naming it and what is supported (before anything is
    installed or a device opened)."""
    support = platform_support(here or this_platform(), device)
    if not support.runs:
        raise UnsupportedPlatformError(support.reason)
    return support


def platforms_summary() -> str:
    """What each platform gets, in a few sentences (the Slicer module's help shows them)."""
    lines = [f"{supported_platforms()}."]
    for wheel in WHEEL_PLATFORMS:
        if wheel.devices:
            note = f" ({wheel.note})" if wheel.note else ""
            lines.append(f"{wheel.name}: {'; else '.join(wheel.devices)}{note}.")
        else:
            lines.append(f"{wheel.name}: {wheel.note}.")
    return " ".join(lines)
