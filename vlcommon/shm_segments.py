"""The shared-memory segments of a holder's process: named, recorded, swept when dead.

Segments are named ``splitvl-<service>-<pid>-<32 hex>`` under ``/dev/shm``
(:class:`vlcommon.handoff.Holder` writes them). A holder started after a ``kill -9`` of
its predecessor removes the segments of dead processes of its own service
(:func:`sweep_dead_segments`); a process records the segments it owns beside them
(:func:`record_owned_segments`) so a supervisor can list what a dead child left
(:func:`mapped_segments`); and multiprocessing's resource tracker is started in its own
process group (:func:`start_resource_tracker_in_own_group`), so a signal to the service's
group does not kill it first.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
#: A holder's segment name: service, pid, 32 hex characters.
SEGMENT_NAME = re.compile(r"^splitvl-([a-z]+)-(\d+)-([0-9a-f]{32})$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_dead_segments(service: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove ``service``'s segments left by dead processes (and by an earlier process
    with this one's pid: a restarted container is often pid 1 again).

    Called once by a holder before it serves. Segments of live processes of the service
    (another replica on this host) are left alone.

    Returns:
        The names removed.
    """
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        m = SEGMENT_NAME.match(name)
        if m is None or m.group(1) != service:
            continue
        pid = int(m.group(2))
        if pid == os.getpid() or not _pid_alive(pid):
            for owned in _owned_by(shm_dir / name):
                try:
                    os.unlink(shm_dir / owned)
                    removed.append(owned)
                except OSError:
                    pass
            try:
                os.unlink(shm_dir / name)
                removed.append(name)
            except OSError:
                pass
    if removed:
        log.info("removed %d shared-memory segments of dead %s processes", len(removed), service)
    return removed


_OWNED_MAGIC = b"splitvl-owned-segments\n"
_FOREIGN = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def _owned_by(path: Path) -> list[str]:
    """The segment names a record written by :func:`record_owned_segments` lists (none
    for a held-embedding segment)."""
    try:
        with open(path, "rb") as f:
            # Only a record this user wrote is trusted: one planted by another local user
            # must not make this service delete files it names.
            if os.fstat(f.fileno()).st_uid != os.getuid():
                return []
            head = f.read(len(_OWNED_MAGIC))
            if head != _OWNED_MAGIC:
                return []
            names = f.read(1 << 20).decode(errors="replace").split()
    except OSError:
        return []
    return [n for n in names if _FOREIGN.match(n) and not n.startswith("splitvl-")]


def mapped_segments(pids: list[int], shm_dir: Path = SHM_DIR) -> list[str]:
    """Names of the files under ``shm_dir`` that the processes ``pids`` map (from
    /proc/<pid>/maps), e.g. vLLM's ``psm_*`` message-queue buffers."""
    prefix = f"{shm_dir}/"
    names: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            # An unlinked file (" (deleted)", e.g. a named semaphore) leaves nothing behind.
            if path.startswith(prefix) and not path.endswith(" (deleted)"):
                if "/" not in path[len(prefix) :]:
                    names.add(path[len(prefix) :])
    return sorted(names)


def record_owned_segments(service: str, names: list[str], shm_dir: Path = SHM_DIR) -> Path | None:
    """Write down segments this process (or its children) made through libraries that
    do not clean up after a ``kill -9`` (vLLM's shared-memory message queues: Python's
    resource tracker dies with the process group). The record is named like a held
    segment of this pid, so the service's next process removes it and every segment it
    lists (:func:`sweep_dead_segments`) once this one is dead. Returns the record's path
    (None when /dev/shm is unusable or there is nothing to record)."""
    names = [n for n in names if _FOREIGN.match(n) and not n.startswith("splitvl-")]
    if not names:
        return None
    path = shm_dir / f"splitvl-{service}-{os.getpid()}-{secrets.token_hex(16)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(_OWNED_MAGIC + "\n".join(names).encode() + b"\n")
    except OSError as err:
        log.warning("could not record the shared-memory segments of %s: %s", service, err)
        return None
    return path


def start_resource_tracker_in_own_group() -> int | None:
    """Start this process's multiprocessing resource tracker in a process group of its own.

    Python's resource tracker unlinks the named semaphores (``/dev/shm/sem.mp-*``) and
    shared-memory segments its process tree registered once every process holding its pipe
    has exited, however they died. Started the stock way it is a plain child, in the
    caller's process group, so a ``kill -9`` of that group (an OOM kill of a container's
    processes, ``splitvl up``'s lifeline, an operator's ``kill -9 -PGID``) kills it too and
    nothing unlinks them: a semaphore vLLM's engine start registers, mapped by no process,
    outlived the decoder that way (found 2026-12-04). Started in its own group, it sees
    the pipe close when the last process of the group dies, cleans up as designed and
    exits. Its children (vLLM's engine core and workers, started with ``spawn``) inherit
    its pipe, so they use the same tracker.

    Call it before anything registers a resource (before vLLM starts its engine). Stdlib's
    own ``ensure_running`` launches it, so its pipe, signal mask and bookkeeping stay
    stdlib's; only the launch (``multiprocessing.util.spawnv_passfds``, whose fixed
    ``fork_exec`` arguments cannot ask for a new group) is replaced, for this one call, by
    ``subprocess.Popen(..., process_group=0)``.

    Returns:
        The tracker's pid, or None when this process already had a tracker (started
        before this call, or inherited from a parent): left as it is.
    """
    with _TRACKER_LAUNCH:  # two calls at once would restore each other's replacement
        return _start_tracker_in_own_group()


def _start_tracker_in_own_group() -> int | None:
    import subprocess
    from multiprocessing import resource_tracker, util

    tracker = resource_tracker._resource_tracker
    if getattr(tracker, "_fd", None) is not None:
        log.warning(
            "this process already has a resource tracker (started earlier or inherited): "
            "left where it is, in its own process group or not"
        )
        return None

    def spawn_in_own_group(path: str, args: list[str], passfds: list[int]) -> int:
        proc = subprocess.Popen(
            args,
            executable=path,
            pass_fds=tuple(sorted(map(int, passfds))),
            close_fds=True,
            restore_signals=False,
            process_group=0,
        )
        _TRACKERS.append(proc)  # kept: a collected Popen would warn while it runs
        return proc.pid

    original = util.spawnv_passfds
    util.spawnv_passfds = spawn_in_own_group  # type: ignore[assignment]
    try:
        tracker.ensure_running()
    finally:
        util.spawnv_passfds = original  # type: ignore[assignment]
    pid = getattr(tracker, "_pid", None)
    return int(pid) if pid is not None else None


_TRACKERS: list[Any] = []
_TRACKER_LAUNCH = threading.Lock()
