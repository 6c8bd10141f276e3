"""Shared test helpers, imported as `tests.support.<module>` (pyproject's pytest `pythonpath`
puts the repository root on `sys.path`; no test inserts paths of its own). See tests/README.md.
"""
