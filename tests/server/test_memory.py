"""The router's free-memory reading works without Linux's /proc (a Mac has neither /proc/meminfo nor
SC_AVPHYS_PAGES, and read nothing before), and sizes parse as users write them."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from quantserve.server.memory import free_bytes, parse_size


def test_free_bytes_needs_no_proc_meminfo(monkeypatch):
    real_read_text = Path.read_text

    def read_text(self, *args, **kwargs):
        if str(self).startswith("/proc"):
            raise FileNotFoundError(self)
        return real_read_text(self, *args, **kwargs)

    def sysconf(name):
        if name == "SC_AVPHYS_PAGES":
            raise ValueError("unrecognized configuration name")  # as on macOS
        return os.sysconf(name)

    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr("os.sysconf", sysconf)
    got = free_bytes("llamacpp")
    assert isinstance(got, int) and 0 < got <= psutil.virtual_memory().total
    # what the OS reports, up to what other processes allocated in between
    assert abs(got - psutil.virtual_memory().available) < 256 * 2**20


@pytest.mark.parametrize(
    ("text", "size"), [("24G", 24 * 2**30), ("512M", 512 * 2**20), ("1.5GiB", 3 * 2**29), ("1000000", 10**6)]
)
def test_parse_size(text, size):
    assert parse_size(text) == size
