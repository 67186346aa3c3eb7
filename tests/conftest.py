"""Puts tests/ on sys.path (pytest inserts a conftest's folder) so suites share tests/tiny.py and reference.py."""
