"""Measurement: ``neuralraycast bench`` and the peers it compares against. Not part of the runtime: the
Slicer extension does not install this folder."""
