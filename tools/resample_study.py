"""Resample a study folder (manifest.json + NIfTI files) to another voxel size, to make large and thin-sliced
test volumes from the sample: channels trilinear, labels nearest, written uncompressed.

    python tools/resample_study.py STUDY OUT 0.5,0.5,5    # or one number for isotropic voxels
"""

import argparse
import json
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage


def resample(source: Path, target: Path, spacing: np.ndarray) -> None:
    target.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((source / "manifest.json").read_text())
    renamed = {}
    for name in [*manifest["channels"].values(), manifest["labels"]]:
        image = nib.load(source / name)
        old = np.array(image.header.get_zooms()[:3], float)
        data = np.asarray(image.dataobj)
        is_label = name == manifest["labels"]
        out = ndimage.zoom(data if is_label else data.astype(np.float32), old / spacing, order=0 if is_label else 1)
        affine = image.affine.copy()
        affine[:3, :3] = affine[:3, :3] / old * spacing
        renamed[name] = name.replace(".nii.gz", ".nii")
        nib.save(nib.Nifti1Image(out.astype(data.dtype), affine), target / renamed[name])
        print(name, data.shape, "->", out.shape)
    manifest["channels"] = {key: renamed[value] for key, value in manifest["channels"].items()}
    manifest["labels"] = renamed[manifest["labels"]]
    (target / "manifest.json").write_text(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("spacing", help="voxel size in mm: one number, or three for i, j, k")
    args = parser.parse_args()
    resample(args.study, args.out, np.array([float(v) for v in args.spacing.split(",")]))
