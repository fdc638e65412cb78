"""Helpers shared by the test layers (tests import these, never each other)."""
