"""Helpers for testing ftrun and programs built on it (shipped, not test-only fakes)."""

from ftrun.testing.clock import FakeClock

__all__ = ["FakeClock"]
