"""Human-readable and JSON summaries of a prepared study, and a slice preview picture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .drawn_labels import LabelNote
from .pieces import label_pieces
from .preprocess import PreparedStudy, structure_mask

#: Pieces beside each structure's largest listed in a summary (the count says how many there are in all).
LISTED_PIECES = 20


def study_summary(prepared: PreparedStudy) -> dict[str, Any]:
    study = prepared.study
    voxel_ml = float(np.prod(study.spacing)) / 1000.0
    structures = []
    for structure, boundary in zip(prepared.structures, prepared.boundary, strict=True):
        inside = boundary < 0
        drawn = (structure_mask(structure, study.labels, prepared.mask)
                 if study.labels is not None or structure.from_mask else inside)
        _, pieces = label_pieces(drawn, study.affine)
        note = prepared.label_notes.get(structure.name, LabelNote())
        structures.append({
            "name": structure.name,
            "labels": list(structure.labels) or "mask",
            "volume_ml": round(float(inside.sum()) * voxel_ml, 2),
            "color": list(structure.color),
            # specks and fragments as drawn, said here since a smooth learned surface may leave them out
            "pieces": len(pieces),
            "smaller_pieces": [piece.as_dict() for piece in pieces[1:1 + LISTED_PIECES]],
            # what the surface leaves out or keeps apart (below min_piece_ml), and whether it was smoothed as drawn
            **note.as_dict(),
        })
    return {
        "name": study.name,
        "shape_ijk": list(study.shape),
        "spacing_mm": [round(float(s), 4) for s in study.spacing],
        "channels": prepared.channel_names,
        "has_labels": study.labels is not None,
        "probability": "given" if study.probability is not None else "derived from labels",
        "structures": structures,
        "bounds_ras_mm": prepared.bounds.round(2).tolist(),
        "occupied_blocks": f"{int(prepared.occupancy.sum())}/{prepared.occupancy.size}",
        "min_piece_ml": prepared.min_piece_ml,
    }


def summary_text(summary: dict[str, Any]) -> str:
    lines = [
        f"study       {summary['name']}",
        f"grid        {' x '.join(map(str, summary['shape_ijk']))} voxels at "
        f"{' x '.join(f'{s:g}' for s in summary['spacing_mm'])} mm",
        f"channels    {', '.join(summary['channels'])}",
        f"P(x)        {summary['probability']}",
        f"bounds      {summary['bounds_ras_mm'][0]} .. {summary['bounds_ras_mm'][1]} mm (RAS)",
        "structures",
    ]
    for s in summary["structures"]:
        labels = s["labels"] if isinstance(s["labels"], str) else ",".join(map(str, s["labels"]))
        lines.append(f"  {s['name']:16s} labels {labels:10s} {s['volume_ml']:9.2f} ml  {s['pieces']} piece"
                     + ("s" if s["pieces"] != 1 else ""))
        if s["smaller_pieces"]:
            sizes = [piece["volume_ml"] for piece in s["smaller_pieces"]]
            largest = s["smaller_pieces"][0]
            span = f"{max(sizes):.3f} ml" if len(sizes) == 1 else f"{min(sizes):.3f} to {max(sizes):.3f} ml"
            listed = " (of those listed)" if s["pieces"] - 1 > len(sizes) else ""
            voxels = f"{largest['voxels']} voxel{'s' if largest['voxels'] != 1 else ''}"
            lines.append(f"    {s['pieces'] - 1} beside the largest, {span}{listed}; the largest of them {voxels} "
                         f"at RAS {largest['centre_ras']} mm")
        lines += _tidied_lines(s, summary.get("min_piece_ml", 0.0))
    return "\n".join(lines)


def _tidied_lines(structure: dict[str, Any], min_piece_ml: float) -> list[str]:
    """What the structure's surface leaves out, keeps apart or fills, and whether it was smoothed as drawn."""
    lines = []
    for key, what in (("left_out", "left out of the surface"), ("kept_apart", "kept as surfaces of their own"),
                      ("holes_filled", "holes filled")):
        pieces = structure.get(key, [])
        if pieces:
            total = sum(piece["volume_ml"] for piece in pieces)
            where = "; ".join(f"{p['voxels']} at RAS {p['centre_ras']}" for p in pieces[:3])
            more = f"; {len(pieces) - 3} more" if len(pieces) > 3 else ""
            noun = "hole" if key == "holes_filled" else "piece"
            lines.append(f"    {what}: {len(pieces)} {noun}{'s' if len(pieces) != 1 else ''} under "
                         f"{min_piece_ml:g} ml ({total:.3f} ml in all; voxels and centre: {where}{more})")
    if structure.get("drawn"):
        lines.append(f"    drawn label (ragged or thick-sliced: {structure['disagreement']:.0%} of its boundary "
                     "voxels off its smoothed surface): surface smoothed, volume kept")
    return lines


def save_preview(prepared: PreparedStudy, path: str | Path) -> Path:
    """Axial, coronal and sagittal slices through the lesion (or centre): each channel, then the contours."""
    from PIL import Image

    inside = prepared.boundary[1:] < 0 if len(prepared.structures) > 1 else prepared.boundary[:1] < 0
    target = np.argwhere(inside.any(axis=0))
    centre = (target.mean(axis=0) if len(target) else np.array(prepared.mask.shape) / 2).astype(int)
    rows = []
    for axis in (2, 1, 0):  # axial (k), coronal (j), sagittal (i)
        tiles = []
        for channel in prepared.channels:
            gray = np.clip(np.take(channel, centre[axis], axis=axis), 0.0, 1.2) / 1.2
            tiles.append(np.repeat(gray[..., None], 3, axis=-1))
        overlay = tiles[0].copy()
        for structure, boundary in zip(prepared.structures, prepared.boundary, strict=True):
            band = np.abs(np.take(boundary, centre[axis], axis=axis)) < 0.6 * float(prepared.spacing.min())
            overlay[band] = structure.color
        tiles.append(overlay)
        tiles = [np.rot90(t) for t in tiles]  # RAS arrays -> anterior/superior up
        rows.append(tiles)
    height = max(t.shape[0] for row in rows for t in row)
    width = max(t.shape[1] for row in rows for t in row)
    grid = np.zeros((height * 3, width * len(rows[0]), 3))
    for r, row in enumerate(rows):
        for c, tile in enumerate(row):
            grid[r * height: r * height + tile.shape[0], c * width: c * width + tile.shape[1]] = tile
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray((grid * 255).astype(np.uint8)).save(path)
    return path
