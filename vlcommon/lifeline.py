"""A service started by ``splitvl up`` ends when its launcher does, however the launcher died.

The launcher sets ``SPLITVL_LAUNCHER_PID`` in each child's environment.
:func:`start_watchdog` (called by every service's main before anything heavy loads) removes
it from the environment, so vLLM's engine-core and worker processes do not inherit it, and
starts a daemon thread that checks ``os.getppid()`` every ``poll_s``. When the launcher is
gone (a SIGKILL, an OOM kill, a closed terminal: nothing of the launcher runs then), the
thread sends the service SIGTERM (its graceful drain and engine shutdown) and, if it is
still alive ``grace_s`` later, SIGKILLs its whole process group: the service and the vLLM
processes it started, which share the group the launcher gave it.

Linux's ``PR_SET_PDEATHSIG`` would signal only the service's root process and only when
the forking *thread* dies; the poll covers the whole group and needs no ctypes.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

#: Environment variable naming the launcher's pid (set by ``splitvl.launcher``).
LAUNCHER_PID_ENV = "SPLITVL_LAUNCHER_PID"


def start_watchdog(poll_s: float = 0.5, grace_s: float = 3.0) -> threading.Thread | None:
    """Watch the launcher named by ``SPLITVL_LAUNCHER_PID``; None when there is none.

    Args:
        poll_s: Seconds between checks of the parent pid.
        grace_s: Seconds from SIGTERM (graceful drain) to SIGKILL of the process group.

    Returns:
        The daemon thread, or None when the variable is unset, malformed, or names a
        process that is not this one's parent (started by hand, or a grandchild).
    """
    value = os.environ.pop(LAUNCHER_PID_ENV, "")
    try:
        launcher = int(value)
    except ValueError:
        return None
    if launcher <= 1 or os.getppid() != launcher:
        return None  # the launcher is already gone, or this is not its direct child
    thread = threading.Thread(
        target=_watch, args=(launcher, poll_s, grace_s), name="launcher-watchdog", daemon=True
    )
    thread.start()
    return thread


def _watch(launcher: int, poll_s: float, grace_s: float) -> None:
    while os.getppid() == launcher:
        time.sleep(poll_s)
    log.error("launcher (pid %d) is gone: stopping this service and its processes", launcher)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    log.error("still running %.0f s after the launcher died: killing the process group", grace_s)
    os.killpg(os.getpgrp(), signal.SIGKILL)
