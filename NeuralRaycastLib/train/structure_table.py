"""The per-structure results as tables (columns and rows), for the Slicer module's table nodes and scripts.

Two tables: one row per structure (Dice, surface distances, the label's and the learned surface's volumes and
their difference, connected pieces kept and not), and one row per piece of a label that the surface does not
hold as drawn: left out or kept apart as too small, holes filled (``PreparedStudy.label_notes``), and pieces the
learned surface does not reach (``evaluate.geometry_metrics``), each with its size and where it is. Nothing is
smoothed away unsaid.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..study.drawn_labels import LabelNote


@dataclass(frozen=True)
class Column:
    """A table column: its key in the rows, its title, its unit ("" for none), whether it holds numbers, and
    what it means (a tooltip)."""

    key: str
    title: str
    unit: str
    numeric: bool
    description: str


STRUCTURE_COLUMNS = (
    Column("segment", "Segment", "", False, "the segment the structure was learned from"),
    Column("dice", "Dice", "", True, "overlap of the learned surface's inside with the label, on the study's grid"),
    Column("mean_surface_distance_mm", "Mean surface distance", "mm", True,
           "mean distance between the learned surface and the label's surface, both ways"),
    Column("hd95_mm", "Hausdorff 95%", "mm", True,
           "95th percentile of the distances between the learned surface and the label's surface, both ways"),
    Column("label_volume_ml", "Label volume", "ml", True,
           "the voxels of the label's pieces in the surface (small pieces left out are in the pieces table)"),
    Column("learned_volume_ml", "Learned volume", "ml", True, "what the learned surface encloses"),
    Column("volume_difference_percent", "Volume difference", "%", True, "learned volume against the label's"),
    Column("left_out_volume_ml", "Volume left out", "ml", True,
           "the small pieces left out of the surface and of the label volume"),
    Column("volume_level_mm", "Volume level", "mm", True,
           "the level of the learned distance at which a drawn label's surface holds the label volume"),
    Column("ceiling_dice", "Dice of the exact surface", "", True,
           "where the exact surface is known (the phantom): its own Dice against the label, the most a faithful "
           "surface scores on a drawn label"),
    Column("label_pieces", "Label pieces", "", True, "connected pieces of the label (26-connected)"),
    Column("pieces_kept", "Pieces kept", "", True, "pieces of the label the learned surface holds"),
    Column("pieces_not_reached", "Pieces not reached", "", True,
           "pieces of the label the learned surface does not reach (listed in the pieces table)"),
    Column("pieces_left_out", "Small pieces left out", "", True,
           "pieces smaller than the minimum piece size, left out of the surface before training"),
    Column("pieces_kept_apart", "Small pieces kept apart", "", True,
           "pieces smaller than the minimum piece size, kept as surfaces of their own"),
    Column("holes_filled", "Holes filled", "", True, "holes smaller than the minimum piece size, filled"),
    Column("drawn", "Smoothed as drawn", "", False,
           "whether the label was taken as drawn by hand and its surface smoothed over about a voxel"),
)

PIECE_COLUMNS = (
    Column("segment", "Segment", "", False, "the segment the piece belongs to"),
    Column("what", "What", "", False, "what happened to the piece"),
    Column("voxels", "Voxels", "", True, "the piece's voxels on the study's grid"),
    Column("volume_ml", "Volume", "ml", True, "the piece's volume"),
    Column("r_mm", "R", "mm", True, "the piece's centre, Right"),
    Column("a_mm", "A", "mm", True, "the piece's centre, Anterior"),
    Column("s_mm", "S", "mm", True, "the piece's centre, Superior"),
)

#: What happened to a piece, by where it is listed.
LEFT_OUT, KEPT_APART, HOLE_FILLED, NOT_REACHED = (
    "left out (smaller than the minimum piece size)", "kept apart (smaller than the minimum piece size)",
    "hole filled (smaller than the minimum piece size)", "not reached by the learned surface")


def _number(value: Any) -> float:
    """A metric as a float; NaN where it is missing (there is no surface to measure)."""
    return math.nan if value is None else float(value)


def structure_rows(metrics: Mapping[str, Mapping[str, Any]], notes: Mapping[str, LabelNote],
                   segment_names: Mapping[str, str]) -> list[dict[str, Any]]:
    """One row per structure of ``metrics`` (``evaluate.geometry_metrics``'s result), in its order.

    :param notes: ``PreparedStudy.label_notes`` (structures without one had nothing done to their label).
    :param segment_names: structure name -> the segment's name (others keep their structure name).
    """
    rows = []
    for name, values in metrics.items():
        note = notes.get(name, LabelNote())
        rows.append({
            "segment": segment_names.get(name, name),
            "dice": _number(values.get("dice")),
            "mean_surface_distance_mm": _number(values.get("mean_surface_distance_mm")),
            "hd95_mm": _number(values.get("hd95_mm")),
            "label_volume_ml": _number(values.get("label_volume_ml")),
            "learned_volume_ml": _number(values.get("learned_volume_ml")),
            "volume_difference_percent": _number(values.get("volume_difference_percent")),
            "left_out_volume_ml": _number(values.get("left_out_volume_ml")),
            "volume_level_mm": _number(values.get("volume_level_mm")),
            "ceiling_dice": _number(values.get("ceiling_dice")),
            "label_pieces": _number(values.get("label_pieces")),
            "pieces_kept": _number(values.get("pieces_kept")),
            "pieces_not_reached": float(len(values.get("pieces_dropped", []))),
            "pieces_left_out": float(len(note.left_out)),
            "pieces_kept_apart": float(len(note.kept_apart)),
            "holes_filled": float(len(note.holes_filled)),
            "drawn": "yes" if note.drawn else "no",
        })
    return rows


def _piece_row(segment: str, what: str, piece: Mapping[str, Any]) -> dict[str, Any]:
    r, a, s = (float(v) for v in piece["centre_ras"])
    return {"segment": segment, "what": what, "voxels": float(piece["voxels"]),
            "volume_ml": float(piece["volume_ml"]), "r_mm": r, "a_mm": a, "s_mm": s}


def piece_rows(metrics: Mapping[str, Mapping[str, Any]], notes: Mapping[str, LabelNote],
               segment_names: Mapping[str, str]) -> list[dict[str, Any]]:
    """One row per piece a structure's surface does not hold as drawn, structure by structure (the
    structures of ``metrics`` first, in its order, then any other with a note), largest first within each
    kind."""
    rows = []
    for name in list(metrics) + [name for name in notes if name not in metrics]:
        segment = segment_names.get(name, name)
        note = notes.get(name, LabelNote())
        for what, pieces in ((LEFT_OUT, note.left_out), (KEPT_APART, note.kept_apart),
                             (HOLE_FILLED, note.holes_filled)):
            rows += [_piece_row(segment, what, piece.as_dict()) for piece in pieces]
        rows += [_piece_row(segment, NOT_REACHED, piece) for piece in metrics.get(name, {}).get("pieces_dropped", [])]
    return rows
