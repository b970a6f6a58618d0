"""Atomic file writes: every file is written to a temporary name beside its target, then renamed into place.

A process killed midway leaves at most a ``.<name>.tmp-*`` file, never a half-written file under the name a
finished one is expected at.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Iterator

from qeff_kv.errors import OutputError


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def make_dirs(folder: str | os.PathLike) -> Path:
    """Create ``folder`` and its parents; one-line :class:`OutputError` when a part of it is a file, or the
    folder cannot be created (permission, read-only file system...)."""
    folder = Path(folder)
    if folder.is_dir():
        return folder
    for part in [folder, *folder.parents]:
        if part.exists() or part.is_symlink():
            if not part.is_dir():
                raise OutputError(f"cannot create folder {folder}: {part} exists and is not a folder")
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create folder {folder}: {_reason(exc)}") from None
    return folder


def check_output_file(target: str | os.PathLike) -> Path:
    """Refuse (:class:`OutputError`) a target that exists and is not a regular file (a folder, a FIFO, a
    device node, a socket): writing would replace it. A missing target, or a regular file, is fine."""
    target = Path(target)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return target
    except OSError as exc:
        if isinstance(exc, NotADirectoryError):
            make_dirs(target.parent)  # raises naming the file in the way
        raise OutputError(f"cannot write {target}: {_reason(exc)}") from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"output {target} is a folder; give a file name")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device node"
                if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise OutputError(f"output {target} is {kind}; refusing to replace it (an output must be a regular "
                          "file or not exist)")
    return target


#: ``.<name>.<kind>-<pid>@<host>-<random>``: a staging entry named by :func:`staging_prefix` carries its owner
_OWNER = re.compile(r"\.[A-Za-z]+-([0-9]{1,10})@([0-9a-f]{8})-[^/]*$")


def host_id() -> str:
    """8 hex digits naming this machine (its host name): a pid means something on its own host only."""
    import hashlib
    import socket

    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def staging_prefix(name: str, kind: str) -> str:
    """``.<name>.<kind>-<pid>@<host>-``: the prefix of a staging entry beside ``name`` that :func:`remove_stale`
    removes as soon as the process that made it is gone (killed by SIGKILL, a power cut...), not a day later.
    Entries of another host (a shared folder) are left to the age limit."""
    return f".{name}.{kind}-{os.getpid()}@{host_id()}-"


def owner_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this machine; one of another user counts as alive)."""
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


def remove_stale(folder: str | os.PathLike, pattern: str, max_age_s: float = 86400.0) -> list[Path]:
    """Remove the entries of ``folder`` matching ``pattern`` (staging folders of killed runs) whose owner process
    (the pid in a :func:`staging_prefix` name) is gone, or that were last modified more than ``max_age_s`` ago;
    errors are ignored (another process may be removing them too)."""
    removed = []
    now = time.time()
    try:
        entries = list(Path(folder).glob(pattern))
    except OSError:
        return removed
    for p in entries:
        try:
            owner = _OWNER.search(p.name)
            orphan = owner is not None and owner.group(2) == host_id() and not owner_alive(int(owner.group(1)))
            if p.is_symlink() or (not orphan and now - p.lstat().st_mtime < max_age_s):
                continue
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
        except OSError:
            continue
    return removed


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; on success rename it onto ``target``, else remove it."""
    target = Path(target)
    make_dirs(target.parent)
    check_output_file(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    except OSError as exc:
        raise OutputError(f"cannot write in {target.parent}: {_reason(exc)}") from None
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        os.chmod(tmp_path, 0o666 & ~_umask())
        try:
            yield tmp_path
            _fsync(tmp_path)
            check_output_file(target)  # may have appeared meanwhile
            os.replace(tmp_path, target)
        except OSError as exc:
            raise OutputError(f"cannot write {target}: {_reason(exc)}") from None
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
    make_dirs(target.parent)
    if (target.exists() or target.is_symlink()) and not target.is_dir():
        raise OutputError(f"{target} exists and is not a folder")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=staging_prefix(target.name, "tmp"), dir=target.parent))
    except OSError as exc:
        raise OutputError(f"cannot write in {target.parent}: {_reason(exc)}") from None
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


def read_regular_file(path: str | os.PathLike, limit: int | None = None) -> bytes:
    """The bytes of ``path``, opened without following a symbolic link in its last component and refused unless it
    is a regular file (a FIFO is not waited on); at most ``limit`` bytes (more: refused). ``OSError`` subclasses
    carry the reason; the message of a refusal names the file's name only, never its folder or its bytes."""
    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path.name}: no such file") from None
    except OSError as exc:
        if os.path.islink(path):
            raise PermissionError(f"{path.name}: is a symbolic link; refusing to follow it") from None
        raise OSError(f"{path.name}: cannot be opened ({_reason(exc)})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(f"{path.name}: not a regular file")
        if limit is not None and st.st_size > limit:
            raise OSError(f"{path.name}: larger than {limit} bytes")
        return f.read()


def read_json_object(path: str | os.PathLike, error: type[Exception]) -> dict:
    """The JSON object in ``path``; ``error`` (the caller's typed error) in one line naming the file when it is
    unreadable, not JSON, or not an object."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:   # UnicodeDecodeError is a ValueError
        raise error(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object")
    return value
