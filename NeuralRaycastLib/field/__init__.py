"""The neural field: hash encoding and networks, the SDF fit (stage 1), model files, the field as a scene."""
