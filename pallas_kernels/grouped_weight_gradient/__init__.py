"""Grouped weight gradient: for each expert, its rows transposed times their gradients (no communication)."""
