"""Helpers for tools/train_demo.py (torch; not part of the ds4tools package)."""
