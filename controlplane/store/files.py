"""Files only their owner may read: the state folder (0700) and what holds secrets in it (0600).

The state folder holds the store (token and password hashes, the audit trail), the replicas' admin-token
secret and every log. ``private_dir`` creates it 0700 and narrows one that an earlier version created
wider; ``create_private`` writes a new secret file that is 0600 from its first byte (``O_EXCL``, no chmod
window); ``restrict`` narrows an existing file to 0600 (the SQLite database and its ``-wal``/``-shm``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from controlplane.errors import Forbidden

logger = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """``path`` (and missing parents, as the platform makes them) as a folder only its owner may enter.

    An existing folder of ours that others may read is narrowed to 0700; one that belongs to another user
    is left alone (and logged), as are its parents."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    info = path.stat()
    if stat.S_IMODE(info.st_mode) & 0o077:
        if info.st_uid != os.getuid():
            logger.warning("state folder %s is readable by others and not ours to narrow (owner uid %d)",
                           path, info.st_uid)
        else:
            path.chmod(DIR_MODE)
    return path


def create_private(path: Path, data: bytes) -> None:
    """Write a new file at ``path`` readable by its owner only from the moment it exists; FileExistsError
    when there is one already (the caller reads that one instead)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def touch_private(path: Path) -> None:
    """Create ``path`` empty and 0600 when it does not exist (so that a program that opens it next, such as
    SQLite, never creates it with the umask's wider mode); an existing one is narrowed (:func:`restrict`)."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE))
    restrict(path)


def restrict(path: Path) -> None:
    """Narrow an existing file of ours to 0600; a missing file is fine, one of another user's is logged."""
    try:
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            path.chmod(FILE_MODE)
    except FileNotFoundError:
        return
    except PermissionError:
        logger.warning("%s is readable by others and not ours to narrow", path)


class NotPrivate(Forbidden):
    """A path that does not belong to the caller alone: another user owns it, or others may write it."""


def require_private(*paths: Path) -> None:
    """Refuse (:class:`NotPrivate`) unless each path is the caller's and no one else may write it: the
    authority of a local admin command is the file permissions of the state folder it acts on."""
    uid = os.getuid()
    for path in paths:
        try:
            info = path.stat()
        except FileNotFoundError as exc:
            raise NotPrivate(f"{path} does not exist") from exc
        mode = stat.S_IMODE(info.st_mode)
        if info.st_uid != uid:
            raise NotPrivate(f"{path} belongs to uid {info.st_uid}, not to you (uid {uid}): run this as its "
                             "owner")
        if mode & 0o022:
            raise NotPrivate(f"others may write {path} (mode {mode:04o}): anyone could have changed what is "
                             f"in it; chmod go-w it (the control plane keeps it {DIR_MODE:04o}) first")
