"""Rendering: cameras and style, the reference raycaster and its views, the differentiable neural renderer,
its image loss and training patches, image metrics, and shadows from meshes."""
