"""The disk tier's directory: its layout, the cross-process lock, writers' temp directories, the cleaner
of dead writers' leftovers, the trash, and how an OS error is named.

    entries/<key>/           published entries (cache.disk_entry: their format)
    .tmp/<key>.<uuid>/       an entry being written; .tmp/<key>.<uuid>.lock is flock-ed by its writer
    .trash/                  unpublished entries being deleted
    .lock                    flock-ed around publish + eviction, so the cap holds across processes

A writer killed at any point leaves only a temp directory whose lock is no longer held:
`clean_leftovers` deletes such leftovers (a writer checks, once it holds its temp lock, that the lock
file is still the one in .tmp/, so a cleaner that raced it never deletes a live writer's directory).
Deletion is the reverse of publish: rename into .trash/ (readers see the entry gone at once), then
remove (`trash`).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import time
import uuid

NOT_A_FAULT = frozenset({errno.ENOENT})   # a file another process removed: a race, not an unwritable directory
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")   # how tensorstore (under Orbax) reports one


def os_errno(exc: BaseException) -> int | None:
    """The OS error number behind `exc`: an OSError's errno anywhere in its cause / context chain, or
    the `os_error_code` tensorstore (under Orbax) puts in its ValueError messages; None if none."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        m = _OS_ERROR_CODE.search(str(e))
        if m:
            return int(m.group(1))
        e = e.__cause__ or e.__context__
    return None


def describe(exc: BaseException) -> str:
    """'<ERRNO>: <message>' for an OS error, else '<type>: <exc>'."""
    n = os_errno(exc)
    if n is None:
        return f"{type(exc).__name__}: {exc}"
    return f"{errno.errorcode.get(n, f'errno {n}')}: {os.strerror(n)}"


def make_dirs(*dirs: str) -> None:
    """Creates the directories; NotADirectoryError where a file stands in one's place."""
    for d in dirs:
        if os.path.lexists(d) and not os.path.isdir(d):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), d)
        os.makedirs(d, exist_ok=True)


@contextlib.contextmanager
def dir_lock(directory: str, timeout_s: float, shown_s: float):
    """The flock on `directory`/.lock; TimeoutError after timeout_s (its holder is alive but stuck;
    the message names shown_s, the tier's configured timeout)."""
    fd = os.open(os.path.join(directory, ".lock"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{directory}/.lock held elsewhere for {shown_s:g} s")
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)   # closing releases the flock


def temp_dir(tmp_root: str, key: str) -> tuple[str, str, int]:
    """A fresh temp directory name under tmp_root and its lock, flock-ed: (dir, lock path, lock fd).
    The lock is checked to still be the file in .tmp/ once held (a cleaner may have unlinked it
    between our create and flock: its directory would then look dead to the next cleaner)."""
    for _ in range(8):
        name = f"{key}.{uuid.uuid4().hex}"
        tmp, lock_path = os.path.join(tmp_root, name), os.path.join(tmp_root, name + ".lock")
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
                return tmp, lock_path, fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise FileNotFoundError(errno.ENOENT, "temp locks keep being removed under this writer", tmp_root)


def trash(src: str, trash_root: str, key: str) -> str | None:
    """Renames the entry directory `src` into trash_root (atomic: readers see it gone); the trashed
    path, or None when there was nothing to move. OSError if it is there and cannot be moved."""
    for attempt in range(2):
        dest = os.path.join(trash_root, f"{key}.{uuid.uuid4().hex}")
        try:
            os.rename(src, dest)
            return dest
        except FileNotFoundError:
            if attempt or not os.path.lexists(src):
                return None
            os.makedirs(trash_root, exist_ok=True)    # .trash itself was gone
    return None


def clean_leftovers(tmp_root: str, trash_root: str) -> None:
    """Delete temp dirs of dead writers (their lock is free or gone) and everything in .trash.
    Best effort: what cannot be deleted now is deleted by a later open."""
    try:
        trashed, names = os.listdir(trash_root), os.listdir(tmp_root)
    except OSError:
        return
    for n in trashed:
        shutil.rmtree(os.path.join(trash_root, n), ignore_errors=True)
    for n in names:
        if not n.endswith(".lock"):
            continue
        p = os.path.join(tmp_root, n)
        try:
            fd = os.open(p, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue        # a live writer holds it
        shutil.rmtree(p[:-len(".lock")], ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(p)
        os.close(fd)
    for n in names:
        p = os.path.join(tmp_root, n)
        if not n.endswith(".lock") and not os.path.exists(p + ".lock"):
            shutil.rmtree(p, ignore_errors=True)
