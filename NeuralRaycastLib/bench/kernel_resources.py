"""What the compiled CUDA kernels hold per thread (registers, spills, shared memory) and the occupancy that
follows: ``ptxas -v`` run on the PTX that the shader cache keeps for every kernel.

Nsight Compute crashes on these kernels, so hardware counters are not to be had; register pressure is what
this shows instead. It matters here: slangpy launches groups of 32 threads, and a kernel at 255 registers a
thread fits 8 of them (8 warps of 64) on an SM (BENCHMARKS.md, "What bounds each figure").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

#: An SM of compute capability 9.0 (H100, H200): what bounds how many thread groups it holds at once.
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256  # registers are given to a warp in units of this many
SHARED_BYTES_PER_SM = 228 * 1024
SHARED_BYTES_RESERVED_PER_GROUP = 1024
MAX_WARPS_PER_SM = 64
MAX_GROUPS_PER_SM = 32
WARP = 32


@dataclass(frozen=True)
class KernelResources:
    """One kernel as ``ptxas -v`` reports its entry function."""

    ptx_bytes: int
    registers: int  # per thread
    spill_stores: int  # bytes per thread
    spill_loads: int
    shared_bytes: int  # per thread group

    def warps_per_sm(self, threads_per_group: int = WARP) -> int:
        return resident_warps(self.registers, self.shared_bytes, threads_per_group)


def resident_warps(registers: int, shared_bytes: int = 0, threads_per_group: int = WARP) -> int:
    """Warps an SM holds at once for a kernel of ``registers`` per thread and ``shared_bytes`` per group of
    ``threads_per_group`` threads (slangpy's groups are 32 threads: one warp)."""
    warps_per_group = -(-threads_per_group // WARP)
    per_warp = -(-registers * WARP // REGISTER_UNIT) * REGISTER_UNIT
    groups = min(MAX_GROUPS_PER_SM, REGISTERS_PER_SM // max(per_warp * warps_per_group, 1))
    if shared_bytes:
        groups = min(groups, SHARED_BYTES_PER_SM // (shared_bytes + SHARED_BYTES_RESERVED_PER_GROUP))
    return min(MAX_WARPS_PER_SM, groups * warps_per_group)


_PTX_START = re.compile(rb"(?m)^\.version \d+\.\d+")


def ptx_programs(folder: str | Path) -> list[str]:
    """Every PTX program stored in the files under ``folder`` (the shader cache's database holds each
    kernel's PTX as text, ended by a NUL byte or the file's end), largest first, each once."""
    found: set[str] = set()
    for path in Path(folder).rglob("*"):
        if not path.is_file():
            continue
        data = path.read_bytes()
        for match in _PTX_START.finditer(data):
            end = data.find(b"\0", match.start())
            text = data[match.start(): end if end >= 0 else len(data)]
            if b".entry" in text:
                found.add(text.decode("latin-1"))
    return sorted(found, key=len, reverse=True)


def find_ptxas() -> str | None:
    """The CUDA toolkit's PTX assembler, if this machine has one."""
    candidates = [shutil.which("ptxas")]
    if home := os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        candidates.append(str(Path(home) / "bin" / "ptxas"))
    candidates.append("/usr/local/cuda/bin/ptxas")
    return next((c for c in candidates if c and Path(c).is_file() and os.access(c, os.X_OK)), None)


def ptxas_resources(ptx: str, architecture: str, ptxas: str) -> KernelResources:
    """Assemble ``ptx`` for ``architecture`` (``sm_90``, say) and read its entry function's resources."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx, encoding="latin-1")
        result = subprocess.run([ptxas, f"-arch={architecture}", "-v", str(source), "-o", os.devnull],
                                capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"ptxas failed: {(result.stderr or result.stdout).strip()[-300:]}")
    return parse_ptxas_report(result.stdout + result.stderr, len(ptx))


def parse_ptxas_report(report: str, ptx_bytes: int) -> KernelResources:
    """The entry function's figures in a ``ptxas -v`` report (the first function compiled as an entry)."""
    entry = re.search(r"Compiling entry function '([^']+)'", report)
    if entry is None:
        raise RuntimeError("ptxas compiled no entry function")
    name = re.escape(entry.group(1))
    used = re.search(rf"Function properties for {name}\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                     rf"(\d+) bytes spill loads\s*\n.*?Used (\d+) registers(.*)", report[entry.start():])
    if used is None:
        raise RuntimeError("no register count for the entry function in ptxas's report")
    shared = re.search(r"(\d+) bytes smem", used.group(5))
    return KernelResources(ptx_bytes, int(used.group(4)), int(used.group(2)), int(used.group(3)),
                           int(shared.group(1)) if shared else 0)
