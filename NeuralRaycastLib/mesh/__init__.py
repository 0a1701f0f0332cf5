"""Meshes: marching cubes on signed distances, smoothing, mesh files, signed distance to a mesh, the BVH."""
