"""The per-structure results table and the list of pieces a surface does not hold as drawn."""

from __future__ import annotations

import math

from NeuralRaycastLib.study.drawn_labels import LabelNote
from NeuralRaycastLib.study.pieces import Piece
from NeuralRaycastLib.train.structure_table import (
    HOLE_FILLED,
    KEPT_APART,
    LEFT_OUT,
    NOT_REACHED,
    PIECE_COLUMNS,
    STRUCTURE_COLUMNS,
    piece_rows,
    structure_rows,
)

METRICS = {
    "whole_tumor": {"dice": 0.93, "mean_surface_distance_mm": 0.4, "hd95_mm": 1.1, "label_volume_ml": 20.0,
                    "learned_volume_ml": 19.0, "volume_difference_percent": -5.0, "label_pieces": 3,
                    "pieces_kept": 2, "pieces_dropped": [{"voxels": 4, "volume_ml": 0.004,
                                                          "centre_ras": [1.0, 2.0, 3.0]}],
                    "left_out_volume_ml": 0.011, "volume_level_mm": 0.07, "ceiling_dice": 0.945},
    "tumor_core": {"dice": 0.0, "mean_surface_distance_mm": None, "hd95_mm": None, "label_volume_ml": 0.5,
                   "learned_volume_ml": 0.0, "volume_difference_percent": -100.0, "label_pieces": 1,
                   "pieces_kept": 0, "pieces_dropped": []},
}
NOTES = {"whole_tumor": LabelNote(left_out=[Piece(9, 0.009, (4.0, 5.0, 6.0)), Piece(2, 0.002, (7.0, 8.0, 9.0))],
                                  holes_filled=[Piece(1, 0.001, (0.0, 0.0, 0.0))], drawn=True),
         "enhancing": LabelNote(kept_apart=[Piece(30, 0.03, (-1.0, -2.0, -3.0))])}
NAMES = {"whole_tumor": "Whole tumor", "tumor_core": "Tumor core", "enhancing": "Enhancing"}


def test_one_row_per_structure_named_after_its_segment_with_every_column():
    rows = structure_rows(METRICS, NOTES, NAMES)
    assert [row["segment"] for row in rows] == ["Whole tumor", "Tumor core"]
    assert all(set(row) == {column.key for column in STRUCTURE_COLUMNS} for row in rows)
    whole, core = rows
    assert (whole["dice"], whole["volume_difference_percent"], whole["pieces_kept"]) == (0.93, -5.0, 2.0)
    assert (whole["pieces_not_reached"], whole["pieces_left_out"], whole["holes_filled"]) == (1.0, 2.0, 1.0)
    assert whole["drawn"] == "yes" and core["drawn"] == "no"
    # the volume left out of the label's, the level that holds it, the exact surface's own Dice (the phantom)
    assert (whole["left_out_volume_ml"], whole["volume_level_mm"], whole["ceiling_dice"]) == (0.011, 0.07, 0.945)
    assert math.isnan(core["ceiling_dice"])  # where the exact surface is not known: no figure
    # no learned surface: no distance (NaN, not a number that would read as a result)
    assert math.isnan(core["mean_surface_distance_mm"]) and math.isnan(core["hd95_mm"])


def test_every_piece_left_out_kept_apart_filled_or_not_reached_is_listed_with_where_it_is():
    rows = piece_rows(METRICS, NOTES, NAMES)
    assert all(set(row) == {column.key for column in PIECE_COLUMNS} for row in rows)
    assert [(row["segment"], row["what"], row["voxels"]) for row in rows] == [
        ("Whole tumor", LEFT_OUT, 9.0), ("Whole tumor", LEFT_OUT, 2.0), ("Whole tumor", HOLE_FILLED, 1.0),
        ("Whole tumor", NOT_REACHED, 4.0), ("Enhancing", KEPT_APART, 30.0)]
    assert (rows[0]["r_mm"], rows[0]["a_mm"], rows[0]["s_mm"], rows[0]["volume_ml"]) == (4.0, 5.0, 6.0, 0.009)
    assert piece_rows({}, {}, {}) == []
