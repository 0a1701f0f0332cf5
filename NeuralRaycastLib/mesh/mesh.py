"""Triangle meshes of signed distance grids: marching cubes, SDF normals, smoothing, export.

Meshes are what goes back into Slicer (one model per structure) and what secondary rays are traced
against (``bvh.py``). Any signed distance grid works: the boundary maps of a prepared study now, the
learned field resampled onto a grid (``resample_sdf``) later. Vertices are RAS millimetres; triangles
are wound counter-clockwise seen from outside, whatever the handedness of the grid's IJK→RAS matrix;
vertex normals are the normalised SDF gradient, so they point outward.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ..files import FileSet, atomic_files
from ..grid import interpolate_ijk, voxel_box

EXPORT_FORMATS = ("vtp", "stl", "obj", "ply")


class Named(Protocol):
    """What a mesh is named and coloured after: a study's structure (study/structures.py), say."""

    name: str
    color: tuple[float, float, float]


@dataclass
class Mesh:
    """One structure's surface. ``faces`` index ``vertices``; winding is counter-clockwise from outside."""

    vertices: np.ndarray  # (V, 3) float64, RAS mm
    faces: np.ndarray  # (F, 3) int64
    normals: np.ndarray  # (V, 3) float64, outward unit vectors; (0, 3) where not computed (mesh_structure)
    name: str
    color: tuple[float, float, float]

    def face_normals(self) -> np.ndarray:
        """Unnormalised face normals (twice the area, pointing to the side the winding says is outside)."""
        a, b, c = (self.vertices[self.faces[:, i]] for i in range(3))
        return np.cross(b - a, c - a)

    def enclosed_volume(self) -> float:
        """Signed volume (mm³) by the divergence theorem; positive when the faces point outward."""
        a, b, c = (self.vertices[self.faces[:, i]] for i in range(3))
        return float(np.einsum("ij,ij->i", a, np.cross(b, c)).sum() / 6.0)

    def polydata(self):
        """The mesh as a vtkPolyData in RAS millimetres with point normals (what a Slicer model node takes)."""
        return _polydata(self.vertices, self.faces, self.normals)


def grid_points(affine: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """RAS coordinates (I, J, K, 3) of the voxel centres of a grid."""
    ijk = np.stack(np.meshgrid(*[np.arange(n, dtype=np.float64) for n in shape], indexing="ij"), axis=-1)
    return ijk @ np.asarray(affine)[:3, :3].T + np.asarray(affine)[:3, 3]


def refined_grid(affine: np.ndarray, shape: Sequence[int], factor: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """A grid ``factor`` times finer over the same box: the same corner voxel centres, same orientation."""
    fine = np.array(affine, dtype=np.float64)
    fine[:3, :3] /= factor
    return fine, tuple((int(n) - 1) * factor + 1 for n in shape)


def coarsened_grid(affine: np.ndarray, shape: Sequence[int], stride: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """Every ``stride``-th voxel centre of a grid along each axis: the same first voxel centre, same
    orientation (the counterpart of :func:`refined_grid`)."""
    coarse = np.array(affine, dtype=np.float64)
    coarse[:3, :3] *= stride
    return coarse, tuple(-(-int(n) // stride) for n in shape)


def resample_sdf(
    sdf: Callable[[np.ndarray], np.ndarray],
    affine: np.ndarray,
    shape: Sequence[int],
    chunk: int = 1 << 18,
) -> np.ndarray:
    """Evaluate an SDF callable on a grid: (S, I, J, K) float32.

    ``sdf`` maps RAS points (N, 3) to distances (N,) or (N, S), e.g. the learned field's ``distances``;
    it is called on chunks of points so a fine grid never needs all its points in memory at once.
    """
    shape = tuple(int(n) for n in shape)
    matrix, offset = np.asarray(affine, np.float64)[:3, :3], np.asarray(affine, np.float64)[:3, 3]
    # The points of one i-slice, less the slice's own step: every chunk of whole slices adds its steps to it
    # (cheaper than the (I·J·K, 3) index array of every voxel, which each re-extraction while training would pay).
    jk = np.indices(shape[1:], dtype=np.float64).reshape(2, -1).T
    plane = jk @ matrix[:, 1:].T + offset
    slices = max(1, chunk // max(len(plane), 1))
    columns = []
    for first in range(0, shape[0], slices):
        steps = np.arange(first, min(first + slices, shape[0]), dtype=np.float64)[:, None] * matrix[:, 0]
        points = (steps[:, None, :] + plane[None]).reshape(-1, 3)
        values = np.asarray(sdf(points), dtype=np.float32)
        columns.append(values.reshape(len(points), -1))
    values = np.concatenate(columns)
    return np.ascontiguousarray(values.T.reshape(-1, *shape))


def sdf_normals(volume: np.ndarray, affine: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Outward unit normals at RAS points: the gradient of the trilinearly interpolated grid.

    Central differences of half a voxel in index space, mapped to RAS by the inverse transpose of the
    affine (the same rule as ``VolumeStack.gradient`` in shaders/volume.slang).
    """
    ras_to_ijk = np.linalg.inv(np.asarray(affine, np.float64))
    ijk = points @ ras_to_ijk[:3, :3].T + ras_to_ijk[:3, 3]
    gradient = np.empty_like(ijk)
    for axis in range(3):
        step = np.zeros(3)
        step[axis] = 0.5
        gradient[:, axis] = interpolate_ijk(volume, ijk + step) - interpolate_ijk(volume, ijk - step)
    gradient = gradient @ ras_to_ijk[:3, :3]  # d/dRAS = (d ijk / d RAS)^T d/d ijk
    length = np.linalg.norm(gradient, axis=-1, keepdims=True)
    return np.where(length > 1e-12, gradient / np.maximum(length, 1e-12), np.array([0.0, 0.0, 1.0]))


def _weld(vertices: np.ndarray, faces: np.ndarray, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge identical vertices among ``candidates`` (indices: the only ones that can repeat) and drop the
    triangles that collapse and the vertices no triangle keeps, so every export format reads back with the
    same counts. Vertices keep their order."""
    _, first, group = np.unique(vertices[candidates], axis=0, return_index=True, return_inverse=True)
    keeper = np.arange(len(vertices))
    keeper[candidates] = candidates[first[group.reshape(-1)]]
    faces = keeper[faces]
    keep = (faces[:, 0] != faces[:, 1]) & (faces[:, 1] != faces[:, 2]) & (faces[:, 0] != faces[:, 2])
    faces = faces[keep]
    used = np.zeros(len(vertices), bool)
    used[faces] = True
    return vertices[used], (np.cumsum(used) - 1)[faces]


def extract_surface(volume: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Marching cubes at level 0 of one SDF grid: (vertices in RAS mm, outward-wound faces).

    Only the box around the inside is processed (fast for small structures), padded with outside
    values so the surface is closed even where a structure touches the edge of the grid.
    """
    from skimage.measure import marching_cubes

    inside = volume < 0
    if not inside.any() or inside.all():
        return np.zeros((0, 3)), np.zeros((0, 3), np.int64)
    first, last = voxel_box(inside)
    low = np.maximum(first - 1, 0)
    high = np.minimum(last + 2, volume.shape)
    crop = volume[low[0] : high[0], low[1] : high[1], low[2] : high[2]].astype(np.float32)
    outside = max(float(np.abs(crop).max()), 1.0)
    padded = np.pad(crop, 1, constant_values=outside)
    # skimage's default winding ('descent') faces the triangles towards increasing values: outward for an SDF.
    vertices, faces, _, _ = marching_cubes(padded, level=0.0, allow_degenerate=False)
    ijk = vertices.astype(np.float64) + low - 1
    ras = ijk @ np.asarray(affine, np.float64)[:3, :3].T + np.asarray(affine, np.float64)[:3, 3]
    faces = faces.astype(np.int64)
    if np.linalg.det(np.asarray(affine, np.float64)[:3, :3]) < 0:  # a mirroring affine flips the winding
        faces = faces[:, ::-1].copy()
    # Marching cubes shares each edge's vertex between its cubes; it repeats a vertex only where it lies on a
    # voxel centre (the SDF exactly 0 there), so only those are welded: none on a learned SDF, whose values
    # are never exactly 0, and a sort of the whole mesh's vertices would take most of its time.
    on_voxel = np.flatnonzero(np.all(vertices == np.floor(vertices), axis=1))
    if len(on_voxel) == 0:
        return ras, faces
    return _weld(ras, faces, on_voxel)


def _polydata(vertices: np.ndarray, faces: np.ndarray, normals: np.ndarray | None = None):
    import vtk
    from vtk.util.numpy_support import numpy_to_vtk, numpy_to_vtkIdTypeArray

    polydata = vtk.vtkPolyData()
    points = vtk.vtkPoints()
    points.SetData(numpy_to_vtk(np.ascontiguousarray(vertices, np.float64), deep=True))
    polydata.SetPoints(points)
    cells = vtk.vtkCellArray()
    offsets = np.arange(0, 3 * len(faces) + 1, 3, dtype=np.int64)
    cells.SetData(
        numpy_to_vtkIdTypeArray(offsets, deep=True),
        numpy_to_vtkIdTypeArray(np.ascontiguousarray(faces, np.int64).reshape(-1), deep=True),
    )
    polydata.SetPolys(cells)
    if normals is not None:
        array = numpy_to_vtk(np.ascontiguousarray(normals, np.float32), deep=True)
        array.SetName("Normals")
        polydata.GetPointData().SetNormals(array)
    return polydata


def _arrays(polydata) -> tuple[np.ndarray, np.ndarray]:
    from vtk.util.numpy_support import vtk_to_numpy

    vertices = vtk_to_numpy(polydata.GetPoints().GetData()).astype(np.float64)
    faces = vtk_to_numpy(polydata.GetPolys().GetConnectivityArray()).astype(np.int64).reshape(-1, 3)
    return vertices, faces


def smooth(vertices: np.ndarray, faces: np.ndarray, iterations: int = 20, passband: float = 0.1):
    """Windowed-sinc smoothing (Taubin), as Slicer's closed-surface conversion does: removes terraces
    without shrinking the surface. Returns (vertices, faces)."""
    import vtk

    smoother = vtk.vtkWindowedSincPolyDataFilter()
    smoother.SetInputData(_polydata(vertices, faces))
    smoother.SetNumberOfIterations(iterations)
    smoother.SetPassBand(passband)
    smoother.BoundarySmoothingOff()
    smoother.FeatureEdgeSmoothingOff()
    smoother.NonManifoldSmoothingOn()
    smoother.NormalizeCoordinatesOn()
    smoother.Update()
    return _arrays(smoother.GetOutput())


def decimate(vertices: np.ndarray, faces: np.ndarray, reduction: float):
    """Quadric decimation removing the fraction ``reduction`` of the triangles. Returns (vertices, faces)."""
    import vtk

    decimator = vtk.vtkQuadricDecimation()
    decimator.SetInputData(_polydata(vertices, faces))
    decimator.SetTargetReduction(float(reduction))
    decimator.VolumePreservationOn()
    decimator.Update()
    return _arrays(decimator.GetOutput())


def mesh_structure(
    volume: np.ndarray,
    affine: np.ndarray,
    name: str,
    color: tuple[float, float, float],
    smoothing_iterations: int = 0,
    decimation: float = 0.0,
    normals: bool = True,
) -> Mesh:
    """The mesh of one SDF grid (I, J, K): marching cubes, optional smoothing and decimation, normals
    from the SDF at the final vertex positions (so they stay exact whatever moved the vertices); without
    ``normals``, none (a (0, 3) array: meshes that only shadow rays see)."""
    vertices, faces = extract_surface(volume, affine)
    if len(faces) and smoothing_iterations > 0:
        vertices, faces = smooth(vertices, faces, smoothing_iterations)
    if len(faces) and decimation > 0:
        vertices, faces = decimate(vertices, faces, decimation)
    vertex_normals = sdf_normals(volume, affine, vertices) if normals and len(vertices) else np.zeros((0, 3))
    return Mesh(vertices, faces, vertex_normals, name, tuple(float(c) for c in color))


def mesh_sdf_grid(
    sdf: np.ndarray,
    affine: np.ndarray,
    structures: Sequence[Named],
    smoothing_iterations: int = 0,
    decimation: float = 0.0,
    normals: bool = True,
) -> list[Mesh]:
    """One mesh per structure of an (S, I, J, K) signed distance grid (structures without a surface
    give empty meshes, so indices keep matching the structures; ``normals`` as for mesh_structure)."""
    if len(sdf) != len(structures):
        raise ValueError(f"{len(sdf)} distance volumes for {len(structures)} structures")
    return [
        mesh_structure(volume, affine, structure.name, structure.color, smoothing_iterations, decimation, normals)
        for volume, structure in zip(sdf, structures, strict=True)
    ]


def mesh_prepared(prepared, smoothing_iterations: int = 0, decimation: float = 0.0) -> list[Mesh]:
    """Meshes of a PreparedStudy's boundary maps B_k (the classic route, before a field is learned)."""
    return mesh_sdf_grid(prepared.boundary, prepared.affine, prepared.structures, smoothing_iterations, decimation)


def _mesh_writer(mesh: Mesh, kind: str):
    """The VTK writer of one format, with the mesh as its input."""
    import vtk

    polydata = mesh.polydata()
    if kind == "vtp":
        name = vtk.vtkStringArray()
        name.SetName("Name")
        name.InsertNextValue(mesh.name)
        color = vtk.vtkFloatArray()
        color.SetName("Color")
        color.SetNumberOfComponents(3)
        color.InsertNextTuple3(*mesh.color)
        polydata.GetFieldData().AddArray(name)
        polydata.GetFieldData().AddArray(color)
        writer = vtk.vtkXMLPolyDataWriter()
        writer.SetDataModeToAppended()
    elif kind == "stl":
        writer = vtk.vtkSTLWriter()
        writer.SetFileTypeToBinary()
    elif kind == "obj":
        writer = vtk.vtkOBJWriter()
    else:  # ply
        writer = vtk.vtkPLYWriter()
        writer.SetFileTypeToBinary()
        writer.SetColorModeToUniformCellColor()
        writer.SetColor(*(int(round(255 * c)) for c in mesh.color))
    writer.SetInputData(polydata)
    return writer


def _mesh_kind(path: Path) -> str:
    kind = path.suffix.lower().lstrip(".")
    if kind not in EXPORT_FORMATS:
        raise ValueError(f"{path}: unknown mesh format '{kind}' (use one of {', '.join(EXPORT_FORMATS)})")
    return kind


#: Bytes of each PLY property type.
_PLY_SIZES = {"char": 1, "uchar": 1, "int8": 1, "uint8": 1, "short": 2, "ushort": 2, "int16": 2, "uint16": 2,
              "int": 4, "uint": 4, "int32": 4, "uint32": 4, "float": 4, "float32": 4, "double": 8, "float64": 8}
#: How each VTK writer's file ends: a file cut off at its last bytes still reads back whole.
_MESH_ENDINGS = {"vtp": b"</VTKFile>\n", "obj": b"\n"}


def _incomplete(detail: str) -> OSError:
    return OSError(errno.EIO, f"written incompletely: {detail}")


def _check_binary_ply(path: Path, points: int, triangles: int) -> None:
    """A binary PLY of triangles by its header: the counts it declares and the bytes they take."""
    with open(path, "rb") as handle:
        head = handle.read(1 << 16)
    end = head.find(b"end_header\n")
    if end < 0:
        raise _incomplete("no complete PLY header")
    size, counts, element = end + len(b"end_header\n"), {}, ""
    try:
        for words in (line.split() for line in head[:end].decode("ascii").splitlines()):
            if words[:1] == ["element"]:
                element, counts[words[1]] = words[1], int(words[2])
            elif words[:2] == ["property", "list"]:  # a face: its vertex count, then three indices
                size += counts[element] * (_PLY_SIZES[words[2]] + 3 * _PLY_SIZES[words[3]])
            elif words[:1] == ["property"]:
                size += counts[element] * _PLY_SIZES[words[1]]
    except (ValueError, KeyError, IndexError, UnicodeDecodeError) as error:
        raise _incomplete(f"damaged PLY header ({error})") from error
    declared = (counts.get("vertex"), counts.get("face"))
    if declared != (points, triangles) or path.stat().st_size != size:
        raise _incomplete(f"{path.stat().st_size} of {size} bytes, {declared[0]} of {points} points and "
                          f"{declared[1]} of {triangles} triangles")


def check_mesh_file(path: Path, kind: str, points: int, triangles: int) -> None:
    """Raise OSError unless the mesh file at ``path`` holds ``points`` and ``triangles``: VTK's writers can
    report success on a full disk and leave an empty or cut-off file. Binary STL and PLY are checked by their
    sizes (VTK's PLY reader crashes on a cut-off file), VTP and OBJ read back and by how they end."""
    import vtk

    if kind == "stl":
        size, expected = path.stat().st_size, 84 + 50 * triangles
        if size != expected:
            raise _incomplete(f"{size} of {expected} bytes")
        return
    if kind == "ply":
        _check_binary_ply(path, points, triangles)
        return
    ending = _MESH_ENDINGS[kind]
    with open(path, "rb") as handle:
        handle.seek(max(path.stat().st_size - len(ending), 0))
        if handle.read() != ending:
            raise _incomplete("the file is cut off")
    shown = vtk.vtkObject.GetGlobalWarningDisplay()
    vtk.vtkObject.GlobalWarningDisplayOff()  # a cut-off file is reported here, not by the reader on stderr
    try:
        polydata = read_mesh_polydata(path, kind)
    finally:
        vtk.vtkObject.SetGlobalWarningDisplay(shown)
    read = (polydata.GetNumberOfPoints(), polydata.GetNumberOfCells())
    if read != (points, triangles):
        raise _incomplete(f"{read[0]} of {points} points and {read[1]} of {triangles} triangles read back")


def _write_mesh(files: FileSet, mesh: Mesh, path: Path) -> Path:
    kind = _mesh_kind(path)
    writer = _mesh_writer(mesh, kind)

    def check(written: Path) -> None:
        check_mesh_file(written, kind, len(mesh.vertices), len(mesh.faces))

    with files.path(path, check) as temporary:
        writer.SetFileName(str(temporary))
        if not writer.Write() or writer.GetErrorCode():
            import vtk

            code = vtk.vtkErrorCode.GetStringFromErrorCode(writer.GetErrorCode()) or "unknown error"
            raise OSError(errno.EIO, f"VTK could not write it ({code})")
    return path


def write_mesh(mesh: Mesh, path: str | Path) -> Path:
    """Write a mesh as VTP, STL, OBJ or PLY (chosen by the suffix), with normals where the format has them;
    atomically, and checked (see :func:`check_mesh_file`): files.WriteError names ``path`` otherwise.

    VTP also carries the name and colour (field data ``Name`` and ``Color``); PLY carries the colour per face.
    """
    path = Path(path)
    _mesh_kind(path)
    with atomic_files() as files:
        _write_mesh(files, mesh, path)
    return path


def write_meshes(meshes: Sequence[Mesh], folder: str | Path, formats: Sequence[str] = ("vtp",)) -> list[Path]:
    """Write every non-empty mesh as ``<folder>/<name>.<format>`` for each format, all or none: each file is
    written and checked beside its place, and they are put in place together once all are."""
    paths = [Path(folder) / f"{mesh.name}.{kind}" for mesh in meshes if len(mesh.faces) for kind in formats]
    for path in paths:
        _mesh_kind(path)
    with atomic_files() as files:
        for mesh in meshes:
            for kind in formats if len(mesh.faces) else ():
                _write_mesh(files, mesh, Path(folder) / f"{mesh.name}.{kind}")
    return paths


def read_mesh_polydata(path: str | Path, kind: str | None = None):
    """Read a mesh file back with VTK (a vtkPolyData), e.g. to check an export; ``kind``: its format when the
    suffix does not say."""
    import vtk

    path = Path(path)
    readers = {
        "vtp": vtk.vtkXMLPolyDataReader,
        "stl": vtk.vtkSTLReader,
        "obj": vtk.vtkOBJReader,
        "ply": vtk.vtkPLYReader,
    }
    kind = kind or path.suffix.lower().lstrip(".")
    if kind not in readers:
        raise ValueError(f"{path}: unknown mesh format '{kind}'")
    reader = readers[kind]()
    reader.SetFileName(str(path))
    reader.Update()
    return reader.GetOutput()
