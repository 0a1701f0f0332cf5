"""Where a fit's GPU memory goes: the memory in use on the device at each new progress message of a fit, and
the peak with the stage it came in (sampled every 5 ms). CUDA only.

    python tools/fit_memory_trace.py STUDY OUT [BUDGET]     # e.g. 4G
"""

import argparse
import threading
import time

from NeuralRaycastLib.gpu.device import device_memory_in_use, open_device
from NeuralRaycastLib.train.run import train_study

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study")
    parser.add_argument("out")
    parser.add_argument("budget", nargs="?", default=None)
    args = parser.parse_args()
    gpu = open_device("cuda", gpu_memory=args.budget)
    peak, stage, last = [0, "start"], ["start"], [None]

    def sample() -> None:
        while True:
            used = device_memory_in_use(gpu) or 0
            if used > peak[0]:
                peak[:] = [used, stage[0]]
            time.sleep(0.005)

    def progress(message: str, fraction: float) -> None:
        stage[0] = message.split(",")[0].split(":")[0]
        if stage[0] != last[0]:
            last[0] = stage[0]
            used = (device_memory_in_use(gpu) or 0) / GIB
            print(f"{used:6.2f} GiB  peak so far {peak[0] / GIB:5.2f} ({peak[1]})  {message}", flush=True)

    threading.Thread(target=sample, daemon=True).start()
    train_study(gpu, args.study, args.out, progress=progress, overwrite=True)
    print(f"peak {peak[0] / GIB:.2f} GiB during: {peak[1]}")
    print("budget", gpu.memory)


if __name__ == "__main__":
    main()
