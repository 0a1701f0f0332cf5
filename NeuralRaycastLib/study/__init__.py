"""Studies: loading and checking co-registered channels and labels, the study cache, the structures to learn,
preprocessing (brain mask, boundary maps, tumour probability) and the built-in sample cases."""
