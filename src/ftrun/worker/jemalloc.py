"""jemalloc's background threads: stopped in the zygote before it forks, started again in each warm worker.

pyarrow (which ``datasets``, ``pandas`` and ``scikit-learn`` import) and polars each carry a jemalloc built
with ``background_thread:true``: the first allocation starts a thread (``jemalloc_bg_thd``) that returns freed
memory to the OS. A process with a thread is unsafe to fork (the zygote refuses it), so the zygote turns that
thread off with jemalloc's own switch, the ``background_thread`` control, right after the import that started
it; each warm worker turns it on again before the job's code runs, and has its background thread as a fresh
process has. The switch is jemalloc's ``mallctl``, which these builds keep out of their exported symbols
(``je_arrow_mallctl`` in libarrow, ``_rjem_mallctl`` in polars): it is found in the library's symbol table,
read from the file, among the libraries the import mapped.

Run in the zygote: :func:`stop_background_threads` after each import. In each worker: :func:`start_again`.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import struct

THREAD = "jemalloc_bg_thd"  # what jemalloc names its background threads (/proc/PID/task/TID/comm)
SWITCH = b"background_thread"
_MALLCTL = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t
)
_NAME = re.compile(rb"\x00([A-Za-z0-9_]*mallctl)(?=\x00)")  # je_arrow_mallctl, _rjem_mallctl, je_mallctl, mallctl
SHT_SYMTAB, SHT_DYNSYM = 2, 11  # section types (elf.h)
STOPPED: list[int] = []  # the mallctl of each jemalloc whose background threads the zygote stopped


def thread_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # it ended meanwhile
            continue
    return names


def mapped_libraries() -> set[str]:
    """The shared objects this process has mapped (their files)."""
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and ".so" in line}


def stop_background_threads(known: set[str]) -> bool:
    """If the only threads beside the main one are jemalloc's, turn them off in each jemalloc among the
    libraries mapped that are not in ``known`` (which then has them: each is looked through once), remembered
    for :func:`start_again`. True when this process is single-threaded after."""
    if len(os.listdir("/proc/self/task")) == 1:  # after almost every import: the cheap look first
        return True
    others = thread_names()[1:]
    if not others or any(name != THREAD for name in others):
        return not others
    for path in sorted(mapped_libraries() - known, key=_size):  # the small ones are quick to look through
        known.add(path)
        mallctl = _find_mallctl(path)
        if mallctl is not None and _switch(mallctl, on=False):
            STOPPED.append(mallctl)
            if len(thread_names()) == 1:  # jemalloc joins its threads as it turns them off
                return True
    return len(thread_names()) == 1


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def start_again() -> None:
    """In a warm worker: jemalloc's background threads on again, as a fresh process has them from its first
    allocation."""
    for mallctl in STOPPED:
        _switch(mallctl, on=True)


def _switch(address: int, *, on: bool) -> bool:
    value = ctypes.c_bool(on)
    answer: int = _MALLCTL(address)(SWITCH, None, None, ctypes.byref(value), ctypes.sizeof(value))
    return answer == 0


def _find_mallctl(path: str) -> int | None:
    """The address of jemalloc's mallctl in the loaded library ``path``: exported, or in its symbol table."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as elf:
            offset = _symbol_offset(elf)
    except (OSError, ValueError, struct.error):
        return None
    if offset is None:
        return None
    base = _load_base(path)
    return None if base is None else base + offset


def _load_base(path: str) -> int | None:
    """Where the library's first byte (file offset 0) is mapped."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].strip() == path and int(fields[2], 16) == 0:
                return int(fields[0].split("-")[0], 16)
    return None


def _symbol_offset(elf: mmap.mmap) -> int | None:
    """The value of the first function symbol named ``*mallctl`` in a 64-bit little-endian ELF file's
    symbol tables (.symtab, else .dynsym): for a shared object, its offset from the load base."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        return None  # not a 64-bit little-endian ELF file
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    for kind in (SHT_SYMTAB, SHT_DYNSYM):
        for _, sh_type, _, _, sym_off, sym_size, link, _, _, entsize in sections:
            if sh_type != kind or entsize != 24:
                continue
            str_off, str_size = sections[link][4], sections[link][5]
            names = elf[str_off : str_off + str_size]
            wanted = {m.start(1) for m in _NAME.finditer(names)}
            if not wanted:
                continue
            for st_name, st_info, _, st_shndx, st_value, _ in struct.iter_unpack(
                "<IBBHQQ", elf[sym_off : sym_off + sym_size]
            ):
                if st_name in wanted and st_info & 0xF == 2 and st_shndx != 0 and st_value:  # a defined function
                    return int(st_value)
    return None
