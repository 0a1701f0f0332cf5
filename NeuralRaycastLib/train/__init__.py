"""Training: presets, the staged trainer, the single training entry, run folders, warm-up, evaluation."""
