"""The errors with which ``splitvl up`` and the tools' clusters refuse or fail to start.

Each carries one line for a user (``splitvl`` prints it without a traceback): the
launch configuration (:class:`LaunchConfigError`, exit 2, nothing started), a busy port
(:class:`PortInUseError`), a service that did not come up (:class:`ServiceStartError`,
exit 1, its log named), or Ctrl-C while starting (:class:`StartInterrupted`).
"""

from __future__ import annotations

from pathlib import Path


class ServiceStartError(RuntimeError):
    """A service exited or did not become SERVING; ``summary`` is one line for a user.

    Attributes:
        service: The service's name (``gateway``, ``encoder``, ``cache``, ``decoder``).
        log_path: Its log file.
        summary: One line naming the service, what happened and the log file.
    """

    def __init__(self, service: str, log_path: Path, what: str, tail: str) -> None:
        self.service = service
        self.log_path = log_path
        self.summary = f"{service} {what}; see its log: {log_path}"
        super().__init__(f"{service} {what}:\n{tail}")


class StartInterrupted(RuntimeError):
    """A signal (Ctrl-C) arrived while the services were starting."""


class LaunchConfigError(ValueError):
    """The launch configuration itself is wrong (nothing was started); one line for a user."""


class PortInUseError(LaunchConfigError):
    """A port the cluster needs is taken; nothing was started.

    Attributes:
        port: The first busy port.
    """

    def __init__(self, port: int, message: str) -> None:
        self.port = port
        super().__init__(message)
