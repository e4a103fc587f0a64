"""pytest: helper modules and benchmarks/ come from ``pythonpath`` in pyproject.toml."""
