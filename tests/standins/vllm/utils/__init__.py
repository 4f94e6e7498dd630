"""Stand-in package (see tests/standins/__init__.py)."""
