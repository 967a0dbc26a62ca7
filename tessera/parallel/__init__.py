"""Parallelism applied to a plain model from outside: data, tensor (1D/2D), ZeRO; see apply.py for the order."""
