"""Benchmarks: speed and memory figures printed as tables (never asserted in tests)."""
