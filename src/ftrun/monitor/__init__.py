"""Hang detection: the shared-memory table, the worker client and the pure watchdog."""
