"""Test helpers, imported by the test modules and workers (never collected as tests)."""
