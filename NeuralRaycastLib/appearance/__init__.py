"""Pretrained appearance: an encoder into a per-study fp16 latent grid and a decoder shared by every study."""
