"""What a worker kept ready leaves a job to build: the standby's warm-up (``app/standby.py``'s warm_first_calls on
its 4 mm phantom) in this process, then a ``fit`` of another study (the phantom at SPACING mm, ``--appearance`` as
given), counting the call data slangpy builds in each (a kernel's call of a signature this process has not made
yet; on a GPU each takes tens of milliseconds).

    python tools/standby_call_data.py SPACING [--preset quick] [--appearance pretrained|network]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spacing", type=float, help="the job's phantom's voxel size in mm")
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--appearance", choices=("pretrained", "network"), default="pretrained",
                        help="the job's appearance (fit --appearance)")
    args = parser.parse_args()

    import slangpy.core.calldata as calldata

    from NeuralRaycastLib.app.cli import main as cli
    from NeuralRaycastLib.app.standby import warm_first_calls
    from NeuralRaycastLib.gpu.device import open_device
    from NeuralRaycastLib.paths import clear_cache
    from NeuralRaycastLib.study.sample import cached_sample

    built: list[str] = []
    build = calldata.CallData.__init__

    def counted(self, *call, **options):
        built.append(str(getattr(call[0], "name", "?")) if call else "?")
        return build(self, *call, **options)

    calldata.CallData.__init__ = counted
    gpu = open_device()
    quiet = contextlib.redirect_stderr(io.StringIO())
    with quiet:
        warmed = warm_first_calls(gpu, args.preset, "yes")
    print(f"warm-up ({warmed}): {len(built)} call data built")
    built.clear()
    clear_cache(["prepared", "views"])
    study = str(cached_sample("phantom", spacing=args.spacing))
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = cli(["fit", study, "--out", str(Path(tempfile.mkdtemp()) / "job"), "--preset", args.preset,
                    "--appearance", args.appearance])
    seconds = time.perf_counter() - start
    print(f"{args.appearance} job on the {args.spacing:g} mm phantom: exit {code}, {seconds:.1f} s, "
          f"{len(built)} call data built: {', '.join(sorted(built)) or 'none'}", file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
