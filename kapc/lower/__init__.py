"""Lowering: a compacted module becomes a `.kapb` plan (format in kapb.py)."""
