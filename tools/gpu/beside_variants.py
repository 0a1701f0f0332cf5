"""Which of the work made beside the boundary maps pays: one `fit` in this process (its prepared-study and view
caches cleared first, so the maps are computed) with a chosen part of that work beside the maps, the rest where
the run would otherwise do it. Slangpy's native calls keep the interpreter lock for their whole length, so each
one made beside the maps holds up their Python for as long (tools/gpu/beside_contention.py shows where).

    python3 tools/gpu/beside_variants.py VARIANT STUDY [fit options...]

VARIANT: all (everything beside: NEURALRAYCAST_FIELD_BESIDE_MAPS=1), serial (nothing beside, the run's default),
field (the field alone), field-modules (the field and the modules the run loads next, the fit's calls set up on its
first step), kernels (the maps' kernels' first calls alone, the field made after the maps). Prints the fit's own
lines.
"""

from __future__ import annotations

import os
import sys

VARIANTS = ("all", "serial", "field", "field-modules", "kernels")


def main() -> int:
    variant, study, *options = sys.argv[1:]
    if variant not in VARIANTS:
        raise SystemExit(f"variant {variant!r}: choose from {', '.join(VARIANTS)}")
    os.environ["NEURALRAYCAST_FIELD_BESIDE_MAPS"] = "0" if variant == "serial" else "1"
    from NeuralRaycastLib.app.entry import main as entry
    from NeuralRaycastLib.train import field_ahead

    if variant in ("field", "field-modules"):
        field_ahead.set_up_fit_calls = lambda *a, **k: None  # the fit's first step sets its calls up
    if variant == "field":
        field_ahead.RENDERER_MODULES = ()
        original = field_ahead.FieldAhead._beside

        def without_appearance(self, outline):
            appearance, self.appearance = self.appearance, None
            try:
                return original(self, outline)
            finally:
                self.appearance = appearance

        field_ahead.FieldAhead._beside = without_appearance
    if variant == "kernels":
        field_ahead.FieldAhead.start = lambda self, outline: None
    entry(["cache", "--clear", "prepared", "views"])
    print(f"variant {variant}")
    return entry(["fit", study, *options])


if __name__ == "__main__":
    raise SystemExit(main())
