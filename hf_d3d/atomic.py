"""Writes that are complete or absent: an interrupted run never leaves a file or folder that looks finished."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def scratch_name(path: Path) -> Path:
    """A scratch file beside ``path`` that no other writer uses: per process and per thread, since two threads
    sharing one would truncate each other's text and the second rename would find it gone."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def write_text_atomic(path: Path, text: str) -> None:
    """Write text to a temporary file in the same folder, fsync, then rename over ``path``."""
    path = Path(path)
    tmp = scratch_name(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:  # a failed write (a full disk) leaves no scratch file behind
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: Path, obj: object) -> None:
    """Write JSON to a temporary file in the same folder, fsync, then rename over ``path``."""
    write_text_atomic(path, json.dumps(obj, indent=2))


def save_figure(fig, path: str | Path) -> None:
    """Save a matplotlib figure as PNG under a scratch name, then rename it over ``path``."""
    path = Path(path)
    tmp = scratch_name(path)
    try:
        fig.savefig(tmp, dpi=120, format="png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def open_up(path: Path, umask: int | None = None) -> None:
    """Give ``path`` the permissions the umask allows: safetensors and mkdtemp create theirs private (0600/0700)."""
    umask = _current_umask() if umask is None else umask
    path.chmod((path.stat().st_mode & 0o7777) | ((0o777 if path.is_dir() else 0o666) & ~umask))


def _writer_alive(pid: int) -> bool:
    """Whether process ``pid``, the writer named in a scratch folder ``.<out>-<pid>-<random>``, still runs here."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    return True


def recover_folder(out: str | Path) -> Path:
    """``out``, put back from its last complete version if a writer died between the two renames of
    :func:`atomic_folder` (so a reader, e.g. a resume, finds it)."""
    out = Path(out)
    old = out.with_name(f".{out.name}.old")
    if old.exists() and not out.exists():
        old.rename(out)
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_folder(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty sibling folder to fill; when the block succeeds it becomes ``out``, otherwise it is removed.

    ``out`` is at every moment absent, the old complete folder or the new one. Without ``overwrite`` an existing
    ``out`` is refused before anything is written. Scratch folders of killed runs are removed; those of runs still
    writing (another process on this machine) are left alone.
    """
    out = recover_folder(out)
    old = out.with_name(f".{out.name}.old")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; choose a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Scratch copies of runs killed mid-write (no pid in the name: an older version's). Matched whole:
    # ".X-whole-<pid>-..." is the live scratch copy of a sibling output "X-whole", not one of X's.
    scratch = re.compile(rf"\.{re.escape(out.name)}-(?:(\d+)-)?[a-z0-9_]+")
    for stale in out.parent.glob(f".{out.name}-*"):
        match = scratch.fullmatch(stale.name)
        if match and not (match.group(1) and _writer_alive(int(match.group(1)))):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-{os.getpid()}-", dir=out.parent))
    umask = _current_umask()
    try:
        yield tmp
        for path in [tmp, *tmp.rglob("*")]:  # readable by the other users of a shared cache, as a plain write would be
            open_up(path, umask)
        # On disk before the swap: after a power loss the new folder is whole, never a name over empty files.
        for path in [*(p for p in tmp.rglob("*") if p.is_file()), *(p for p in tmp.rglob("*") if p.is_dir()), tmp]:
            _fsync(path)
        if old.exists():
            shutil.rmtree(old)
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        _fsync(out.parent)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
