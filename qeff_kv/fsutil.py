"""Atomic file writes: every file is written to a temporary name beside its target, then renamed into place.

A process killed midway leaves at most a ``.<name>.tmp-*`` file, never a half-written file under the name a
finished one is expected at.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; on success rename it onto ``target``, else remove it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        os.chmod(tmp_path, 0o666 & ~_umask())
        yield tmp_path
        _fsync(tmp_path)
        os.replace(tmp_path, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(target: str | os.PathLike, data: bytes) -> None:
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def write_text(target: str | os.PathLike, text: str) -> None:
    write_bytes(target, text.encode("utf-8"))


def write_json(target: str | os.PathLike, obj: object) -> None:
    write_text(target, json.dumps(obj, indent=2, sort_keys=False) + "\n")


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside ``target``; on success it replaces ``target`` as a whole."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "x")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_FICLONE = 0x40049409  # Linux ioctl: share the source's blocks (btrfs, XFS with reflink); ENOTSUP elsewhere


def clone_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> str:
    """Place a copy of ``src`` at ``dst`` atomically, never a hard link or symlink; return how.

    onnx (1.23) refuses to read external data from a file with several hard links ("potential hardlink
    attack") or from a symlink, and onnxruntime refuses symlinks leading out of the model folder, so a linked
    data file would break both the new model *and* the original. Tries a reflink (``"clone"``: instant, no extra
    space), else copies in the kernel with ``copy_file_range`` keeping holes (``"copy"``). Memory use is
    constant whatever the file size.
    """
    with atomic_path(dst) as tmp:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            try:
                import fcntl

                fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
                return "clone"
            except (OSError, ImportError, AttributeError):
                pass
            _copy_sparse(fin.fileno(), fout.fileno(), os.fstat(fin.fileno()).st_size)
    return "copy"


def _copy_sparse(fd_in: int, fd_out: int, size: int) -> None:
    chunk = 1 << 30
    pos = 0
    seek_data = getattr(os, "SEEK_DATA", None)
    while pos < size:
        if seek_data is not None:
            try:
                pos = os.lseek(fd_in, pos, seek_data)
            except OSError:  # ENXIO: only a hole is left
                break
            end = os.lseek(fd_in, pos, os.SEEK_HOLE)
        else:
            end = size
        while pos < end:
            n = min(chunk, end - pos)
            if hasattr(os, "copy_file_range"):
                done = os.copy_file_range(fd_in, fd_out, n, pos, pos)
            else:  # pragma: no cover - non-Linux
                os.lseek(fd_in, pos, os.SEEK_SET)
                os.lseek(fd_out, pos, os.SEEK_SET)
                done = os.write(fd_out, os.read(fd_in, min(n, 64 << 20)))
            if done <= 0:
                raise OSError(f"copy stopped at byte {pos} of {size}")
            pos += done
    os.ftruncate(fd_out, size)
