"""Evaluation that needs no training run: standalone-generator RTD scoring of discriminators."""
