"""Helpers shared by the test files (no test file imports another test file)."""
