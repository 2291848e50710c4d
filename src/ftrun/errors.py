"""Errors a user of ftrun can act on.

Every error derives from :class:`FtrunError` and carries a message that names
what was wrong and how to fix it. Nothing is printed and dropped: the CLI is
the only place that turns an error into a message and an exit code.
"""

from __future__ import annotations


class FtrunError(Exception):
    """Root of every error ftrun raises on purpose."""


class ConfigError(FtrunError):
    """A flag, option or environment value is invalid.

    The CLI prints it as one line and exits 2 before anything is started.
    """

    def __init__(self, flag: str, problem: str, fix: str) -> None:
        self.flag = flag
        self.problem = problem
        self.fix = fix
        super().__init__(f"{flag}: {problem}; {fix}")


class SpawnError(FtrunError):
    """A worker process could not be started (missing binary, bad cwd, ...)."""


class ErrorFileError(FtrunError):
    """A worker's error file exists but is not a valid error record."""
