"""Helpers shared by the tests (tests/ is on sys.path through pytest's pythonpath)."""
