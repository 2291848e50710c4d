"""Files only their owner reads: what a run writes (worker output, events, reports, stacks) may hold secrets.

Directories ftrun makes are 0700 and files 0600 (the umask can only make them stricter), and nothing is opened
through a symbolic link: in a shared directory such as /tmp another user could plant one to send the writes
elsewhere. The default log directory is per user, and refused when it is not a directory of the user's own.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from ftrun.errors import ConfigError

DIR_MODE = 0o700
FILE_MODE = 0o600
NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def own_dir(path: Path) -> Path:
    """``path`` as a directory of this user's, made (0700) if missing; an existing one must be a real directory
    (not a symlink) owned by this user, and is made private (0700) if it was not."""
    make_dir(path)
    st = os.lstat(path)
    fix = "remove it, or pass --log-dir DIR (a directory of your own)"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise ConfigError("--log-dir", f"the default log directory {path} is {what}: ftrun writes nothing there", fix)
    if st.st_uid != os.geteuid():
        raise ConfigError(
            "--log-dir", f"the default log directory {path} belongs to another user (uid {st.st_uid})", fix
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, DIR_MODE, follow_symlinks=False)
    return path


def make_dir(path: Path) -> None:
    """A new directory (0700) and its missing parents (0700: ``Path.mkdir`` would make them with the default
    mode); an existing one is left as it is."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            d.mkdir(mode=DIR_MODE)


def open_fd(path: Path, flags: int) -> int:
    """``os.open`` never through a symlink, a file it creates 0600."""
    return os.open(path, flags | NO_FOLLOW, FILE_MODE)


def append_fd(path: Path) -> int:
    """A file to append to (created 0600)."""
    return open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)


def write_atomically(path: Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` at once (a reader sees the old file or the new, whole): a new file 0600
    written beside it, then renamed over it (a rename replaces a planted symlink, never follows it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):  # left by an earlier writer that was killed
        os.unlink(tmp)
    fd = open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    os.replace(tmp, path)
