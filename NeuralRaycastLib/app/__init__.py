"""The command line (``neuralraycast``), the demo and its HTML report."""
