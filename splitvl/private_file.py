"""Files only their owner may read: the local Redis's config and URL, the store secret.

A file is written to a new temporary file in its folder (``mkstemp``: created 0600, never
through a symlink, never an existing file) and renamed over its name, so no moment exists
at which it is readable by others or half written, and a symlink planted at its name is
replaced, not followed.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

from splitvl.errors import LaunchConfigError


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` as a 0600 file (module docstring).

    Raises:
        OSError: the folder is not writable.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_private(path: Path) -> str | None:
    """The content of a private file ``path``; None when there is none.

    Raises:
        LaunchConfigError: it is a symlink, not a regular file, or readable by others.
    """
    try:  # O_NONBLOCK: a FIFO planted there is refused below, not waited on
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise LaunchConfigError(f"{path}: {err.strerror or err} (a symlink is refused)") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode) or mode & 0o077:
        os.close(fd)
        raise LaunchConfigError(
            f"{path} must be a regular file only its owner can read (chmod 600 {path})"
        )
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read().decode()
        except UnicodeDecodeError:
            raise LaunchConfigError(f"{path} is not UTF-8 text") from None


def store_secret(folder: Path) -> Path:
    """The store secret ``splitvl up`` hands its caches (``CACHE_STORE_SECRET_FILE``):
    ``folder/store-secret``, 256 random bits made at the first start and kept, so that a
    restart in the same folder still reads the entries an external store holds.

    Raises:
        LaunchConfigError: the file is unusable (:func:`read_private`) or cannot be written.
    """
    path = folder / "store-secret"
    found = read_private(path)
    if found is not None and found.strip():
        return path
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".store-secret.")
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        try:
            # link() never replaces: of two launchers starting at once, both use the
            # first one's secret. An empty file left by a crash is replaced.
            if found is not None:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError as err:
        raise LaunchConfigError(f"--log-dir {folder}: {err.strerror or err}") from None
    if not (read_private(path) or "").strip():
        raise LaunchConfigError(f"{path} is empty")
    return path
