"""Ray-traced anisotropic Gaussians (RayGauss), beside the neural field: the scene, its training and files."""
