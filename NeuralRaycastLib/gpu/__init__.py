"""The GPU device: which backend opens (CUDA, Vulkan, lavapipe on a CPU), its memory, read-back."""
