"""A page as a person sees it: headless chromium draws it to a PNG, and the test reads the PNG's pixels."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None:
        pytest.skip("chromium is not installed (scripts/test installs it)")
    return found


def screenshot(page: Path, out: Path, width: int = 1250, height: int = 400) -> Path:
    """``page`` drawn by headless chromium into ``out`` (PNG)."""
    subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={out}",
         f"--window-size={width},{height}", page.absolute().as_uri()],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    return out


def colors(png: Path) -> dict[tuple[int, int, int], int]:
    """How many pixels of each colour (8-bit RGB or RGBA, not interlaced: what chromium writes)."""
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", png
    pos, chunks, header = 8, [], b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            chunks.append(body)
        pos += 12 + length
    width, height, depth, color_type = struct.unpack(">IIBB", header[:10])
    assert depth == 8, depth
    assert color_type in (2, 6), color_type
    channels = 3 if color_type == 2 else 4
    raw = zlib.decompress(b"".join(chunks))
    stride = width * channels
    counts: dict[tuple[int, int, int], int] = {}
    previous = bytearray(stride)
    for row in range(height):
        kind, line = raw[row * (stride + 1)], bytearray(raw[row * (stride + 1) + 1 : (row + 1) * (stride + 1)])
        for i in range(stride):  # undo the row's filter (PNG spec, section 9)
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 0xFF
        for i in range(0, stride, channels):
            rgb = (line[i], line[i + 1], line[i + 2])
            counts[rgb] = counts.get(rgb, 0) + 1
        previous = line
    return counts


def hex_rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)
