"""Registers, spills and occupancy of every CUDA kernel in the shader cache, largest first (``ptxas -v`` on the PTX
the cache keeps, as ``bench --suite kernels`` does for the ten largest): run it after the commands whose kernels it
should see. slangpy names every entry ``compute_main``, so a kernel is told apart by its size and by what was
compiled before.

    python3 tools/gpu/kernel_registers.py [--architecture sm_90]
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architecture", default="sm_90")
    args = parser.parse_args()

    from NeuralRaycastLib.bench.kernel_resources import find_ptxas, ptx_programs, ptxas_resources
    from NeuralRaycastLib.gpu.device import shader_cache_path

    ptxas = find_ptxas()
    if ptxas is None:
        print("no ptxas on this machine (the CUDA toolkit's)", file=sys.stderr)
        return 1
    for ptx in ptx_programs(shader_cache_path("cuda")):
        try:
            kernel = ptxas_resources(ptx, args.architecture, ptxas)
        except RuntimeError as error:  # a fragment of the cache that is not a whole program
            print(f"not assembled: {' '.join(str(error).split())[:120]}")
            continue
        print(f"{kernel.registers} registers, spills {kernel.spill_stores}/{kernel.spill_loads} bytes, "
              f"{kernel.warps_per_sm()} of 64 warps per SM, PTX {kernel.ptx_bytes / 1024:.0f} KB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
