"""Structures: the named surfaces the field learns, each a set of label values (or the brain mask).

BraTS label conventions: 1 necrotic core, 2 oedema, 3 enhancing tumour (releases before 2023 used 4
for enhancing; both are accepted). The default structures follow the BraTS evaluation regions.
"""

from __future__ import annotations

from dataclasses import dataclass

BRAIN = "brain"


@dataclass(frozen=True)
class Structure:
    """One surface of the study: its label values (empty for the brain, which comes from a mask)."""

    name: str
    labels: tuple[int, ...]
    color: tuple[float, float, float]

    @property
    def from_mask(self) -> bool:
        return not self.labels


#: RGB colours in [0, 1], close to the colours Slicer's segment editor uses for these tissues.
DEFAULT_COLORS: dict[str, tuple[float, float, float]] = {
    BRAIN: (0.89, 0.80, 0.74),
    "whole_tumor": (0.94, 0.85, 0.35),
    "tumor_core": (0.90, 0.45, 0.25),
    "enhancing_tumor": (0.85, 0.15, 0.20),
}

#: BraTS regions: whole tumour {1, 2, 3|4}, tumour core {1, 3|4}, enhancing tumour {3|4}.
BRATS_STRUCTURES: dict[str, tuple[int, ...]] = {
    "whole_tumor": (1, 2, 3, 4),
    "tumor_core": (1, 3, 4),
    "enhancing_tumor": (3, 4),
}

_EXTRA_COLORS = [(0.35, 0.65, 0.90), (0.45, 0.80, 0.45), (0.70, 0.50, 0.85), (0.95, 0.60, 0.75)]


def color_for(name: str, index: int) -> tuple[float, float, float]:
    return DEFAULT_COLORS.get(name, _EXTRA_COLORS[index % len(_EXTRA_COLORS)])


def make_structures(label_sets: dict[str, tuple[int, ...]], include_brain: bool = True,
                    colors: dict[str, tuple[float, float, float]] | None = None) -> list[Structure]:
    """Structures in rendering order: the brain (context surface) first, then the label structures;
    ``colors`` (e.g. the segments' colours in Slicer) override the defaults by name."""
    colors = colors or {}
    result = [Structure(BRAIN, (), colors.get(BRAIN, DEFAULT_COLORS[BRAIN]))] if include_brain else []
    for index, (name, labels) in enumerate(label_sets.items()):
        result.append(Structure(name, tuple(int(v) for v in labels), colors.get(name, color_for(name, index))))
    return result
