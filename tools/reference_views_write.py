"""How long a run's reference views take to write (``save_reference_views`` without the arrays, as ``fit`` writes
them into the run folder): the icbm sample's views rendered once (kept in the view cache), then written three times
into a temporary folder, with the PNGs' bytes.

    python tools/reference_views_write.py [--views 24] [--size 512]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--views", type=int, default=24)
    parser.add_argument("--size", type=int, default=512)
    args = parser.parse_args()

    from NeuralRaycastLib.gpu.device import open_device
    from NeuralRaycastLib.render.reference_views import render_reference_views, save_reference_views
    from NeuralRaycastLib.study.preprocess import prepare
    from NeuralRaycastLib.study.sample import cached_sample
    from NeuralRaycastLib.study.study import load_study

    gpu = open_device()
    prepared = prepare(load_study(cached_sample("icbm")))
    start = time.perf_counter()
    views = render_reference_views(gpu, prepared, args.views, args.size, args.size)
    print(f"{args.views} views of {args.size}² rendered or read from the view cache in "
          f"{time.perf_counter() - start:.1f} s")
    for _ in range(3):
        with tempfile.TemporaryDirectory() as folder:
            start = time.perf_counter()
            save_reference_views(views, Path(folder) / "reference", arrays=False)
            seconds = time.perf_counter() - start
            pictures = list((Path(folder) / "reference").rglob("*.png"))
            sheet = (Path(folder) / "reference" / "contact_sheet.png").stat().st_size
            total = sum(p.stat().st_size for p in pictures)
            print(f"written in {seconds:.3f} s: {len(pictures)} PNGs, {total / 1e6:.1f} MB (contact sheet "
                  f"{sheet / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
