"""The exit-code contract of every command (docs/exit-codes.md), in one wrapper: :func:`run_command`.

Every console command and subcommand (``dinopipe ...``, ``curate ...``) runs its body through it, so the
classification of an error lives here and nowhere else:

- a mistake of the user (:class:`~dinopipe.config.ConfigError` and its subclasses: a config key or value, a
  path, a file's content, data too small for a setting, an OS error on an output path) -> one line, exit 2;
- a task that was killed (any signal, the OOM killer) or a part such a task left unwritten
  (:class:`UnfinishedError`) -> one line naming the step and task or the part, "rerun the same command",
  exit :data:`EXIT_UNFINISHED` (75, ``EX_TEMPFAIL`` of sysexits.h: "try again later") --
  neither the user's mistake nor a bug;
- anything else -> the traceback, "please report", exit 1 (:func:`~dinopipe.config.report_bug`).

``SystemExit`` passes through untouched (argparse's usage errors are exit 2 already; a command that decided its
own code keeps it), and so does ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Iterator

from ..config import EXIT_BUG, EXIT_CONFIG_ERROR, ConfigError, report_bug

EXIT_UNFINISHED = 75
EXIT_BAD_DATA = 65  # EX_DATAERR of sysexits.h: training only skipped (unreadable shards), named in the message


class UnfinishedError(RuntimeError):
    """A part of a step that a task should have written and did not (the task was killed, preempted or crashed
    before it finished): rerunning the same command writes it. Not the user's mistake and not a bug. ``why``: the
    cause named in the one line (a subclass names its own: the object store's retry budget ran out)."""

    why = "a task was killed or crashed before it wrote this"


class OutputError(ConfigError):
    """An OS error writing an output path (a full disk, a read-only folder, no permission): the user's to fix,
    exit 2 naming the path. Raised by :func:`writing`."""


@contextlib.contextmanager
def writing(path: Any) -> Iterator[None]:
    """Turn an ``OSError`` raised while writing ``path`` into :class:`OutputError` naming it (exit 2, one line)."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, OutputError):
            raise
        reason = exc.strerror or str(exc) or type(exc).__name__
        where = exc.filename if exc.filename and os.fspath(exc.filename) != os.fspath(path) else None
        raise OutputError(f"cannot write '{path}': {reason}" + (f" ({where})" if where else "")) from None


def check_writable(path: Any, key: str) -> None:
    """Before any work: ``path`` (a file or folder to be written) can be created -- its nearest existing ancestor
    is a writable folder and ``path`` itself, if there, is not a file where a folder is expected. ConfigError
    naming ``key`` otherwise (a typo'd mount, a file where the folder should be, a read-only disk)."""
    p = os.path.abspath(os.fspath(path))
    up = p
    while not os.path.exists(up):
        up = os.path.dirname(up)
    if up != p and not os.path.isdir(up):
        raise OutputError(f"{key}: cannot create '{path}': '{up}' is a file, not a folder")
    if not os.access(up if os.path.isdir(up) else os.path.dirname(up), os.W_OK):
        raise OutputError(f"{key}: cannot write '{path}': '{up}' is not writable")


def run_command(command: str, body: Callable[..., int], *args: Any, **kwargs: Any) -> int:
    """Run a command's ``body`` under the contract above; returns its exit code. ``command``: how the user typed
    it (``"dinopipe eval"``, ``"curate index"``), the first word of every line printed here."""
    try:
        return body(*args, **kwargs)
    except ConfigError as exc:
        print(f"{command}: error: {exc or type(exc).__name__}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except UnfinishedError as exc:
        print(f"{command}: unfinished: {exc} -- {exc.why}; rerun the same command", file=sys.stderr)
        return EXIT_UNFINISHED
    except Exception:  # noqa: BLE001 -- everything else is a bug by the contract: exit 1, never 2
        return report_bug(command)


__all__ = ["EXIT_BUG", "EXIT_CONFIG_ERROR", "EXIT_UNFINISHED", "EXIT_BAD_DATA", "OutputError", "UnfinishedError",
           "check_writable", "run_command", "writing"]
