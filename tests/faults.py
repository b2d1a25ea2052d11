"""Fault injection for tests: a full disk, a read-only folder, a storage server that fails.

Real where the machine allows it: a size-limited tmpfs and a read-only bind mount need `mount`
(root, or a container that permits it); without it, a read-only folder is a chmod 0o555 one for a
user other than root (root writes there anyway), and tests that need the real thing are skipped.
`fail_os_writes` simulates a full or read-only disk at the OS boundary for code that writes with
open()/os.open in this process, where no mount is possible. The stand-in S3 server (moto, in
tests/stores.py) is stopped to make a store vanish.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@functools.cache
def can_mount() -> bool:
    """Whether this process may mount a tmpfs (tried once, on a scratch folder)."""
    if os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory() as scratch:
        if (
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", scratch], capture_output=True).returncode
            != 0
        ):
            return False
        subprocess.run(["umount", scratch], capture_output=True)
    return True


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def small_disk(path: Path, free_bytes: int) -> Iterator[Path]:
    """A real tmpfs at `path` with about `free_bytes` free: writing more fails with ENOSPC.

    Skips the test where no tmpfs can be mounted.
    """
    if not can_mount():
        pytest.skip("a small disk needs `mount` (root)")
    path.mkdir(parents=True, exist_ok=True)
    size = free_bytes + (1 << 20)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        filler = path / ".filler"
        filler.write_bytes(b"\0" * (size - free_bytes))
        yield path
    finally:
        _umount(path)


@contextlib.contextmanager
def read_only_folder(path: Path) -> Iterator[Path]:
    """`path` (created, possibly with files in it first) made read-only: a real read-only bind mount,
    else chmod 0o555 for a user other than root; skips the test where neither stops a write."""
    path.mkdir(parents=True, exist_ok=True)
    if can_mount():
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        try:
            yield path
        finally:
            _umount(path)
        return
    if os.geteuid() == 0:
        pytest.skip("a read-only folder needs `mount` when running as root")
    mode = path.stat().st_mode
    path.chmod(0o555)
    try:
        yield path
    finally:
        path.chmod(mode)


@contextlib.contextmanager
def mount_point(path: Path) -> Iterator[Path]:
    """An empty tmpfs mounted at `path` (as a fresh disk or a Colab drive is); skips without `mount`."""
    if not can_mount():
        pytest.skip("a mount point needs `mount` (root)")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        _umount(path)


def fail_os_writes(monkeypatch, folder: Path, code: int = errno.ENOSPC) -> None:
    """From now on, opening a file for writing under `folder` in this process fails with OSError(`code`)
    (ENOSPC: a full disk, EROFS: a read-only one), through open(), Path.open and os.open."""
    folder = str(Path(folder).resolve())

    def inside(name) -> bool:
        try:
            return os.path.abspath(os.fspath(name)).startswith(folder + os.sep)
        except TypeError:
            return False

    real_open, real_os_open = builtins.open, os.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if inside(file) and any(flag in mode for flag in "wax+"):
            raise OSError(code, os.strerror(code), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(name, flags, *args, **kwargs):
        if inside(name) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(code, os.strerror(code), os.fspath(name))
        return real_os_open(name, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(os, "open", guarded_os_open)
