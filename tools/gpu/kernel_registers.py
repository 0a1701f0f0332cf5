"""Registers, spills and occupancy of the CUDA kernels in the shader cache whose entry names contain a word
(``ptxas -v`` on the PTX the cache keeps, as ``bench --suite kernels`` does for the largest): run it after the
commands whose kernels it should see. A word matches a kernel whose PTX names it anywhere (its entry, or a function
it calls that was not inlined).

    python3 tools/gpu/kernel_registers.py [--match renderCamera] [--match marchBackward]
"""

from __future__ import annotations

import argparse
import re
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", action="append", default=[],
                        help="report the kernels whose PTX contains this (all kernels without it)")
    parser.add_argument("--architecture", default="sm_90")
    args = parser.parse_args()

    from NeuralRaycastLib.bench.kernel_resources import find_ptxas, ptx_programs, ptxas_resources
    from NeuralRaycastLib.gpu.device import shader_cache_path

    ptxas = find_ptxas()
    if ptxas is None:
        print("no ptxas on this machine (the CUDA toolkit's)", file=sys.stderr)
        return 1
    for ptx in ptx_programs(shader_cache_path("cuda")):
        entry = re.search(r"\.entry\s+(\S+?)\s*\(", ptx)
        name = entry.group(1) if entry else "?"
        words = [word for word in args.match if word in ptx]
        if args.match and not words:
            continue
        try:
            kernel = ptxas_resources(ptx, args.architecture, ptxas)
        except RuntimeError as error:  # a fragment of the cache that is not a whole program
            print(f"{name}: not assembled ({' '.join(str(error).split())[:120]})")
            continue
        print(f"{name} {words}: {kernel.registers} registers, spills {kernel.spill_stores}/{kernel.spill_loads} bytes, "
              f"{kernel.warps_per_sm()} of 64 warps per SM, PTX {kernel.ptx_bytes / 1024:.0f} KB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
