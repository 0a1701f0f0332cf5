"""NeuralRaycast: neural intrinsic fields for brain MRI, trained through a differentiable Slang raycaster.

The backend of the SlicerNeuralRaycast extension. It never imports ``slicer`` or ``qt``; the Slicer
module and the ``neuralraycast`` command line are thin layers over it.
"""

__version__ = "0.1.0"
