"""Marks that name a process in what it leaves on disk (its metrics and multiprocessing
folders): its pid and its start time, so that a later start can tell the folder of a process
that is gone from one that runs.

A pid alone did not tell them apart in a container, whose supervisor is PID 1 at every start:
a server killed there (the OOM killer, SIGKILL at a deadline) left its folders named after a
pid that runs again, and `docker restart` kept them for good, one set per kill."""

from __future__ import annotations

import os


def mark(pid: int | None = None) -> str:
    """`<pid>.<start time>` of `pid` (this process by default); `<pid>` where /proc cannot
    tell its start time."""
    pid = os.getpid() if pid is None else pid
    started = _start_time(pid)
    return f"{pid}.{started}" if started is not None else str(pid)


def gone(marked: str) -> bool:
    """Whether the process `marked` names (a mark, or a bare pid as older versions wrote it)
    has ended: no process has its pid, or the one that has started at another time. False
    for what is no mark: a folder whose owner cannot be told is left alone."""
    pid_text, _, started = marked.partition(".")
    if not pid_text.isdigit() or (started and not started.isdigit()):
        return False
    pid = int(pid_text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: it runs
        pass
    if not started:
        return False
    now = _start_time(pid)
    return now is not None and now != int(started)


def _start_time(pid: int) -> int | None:
    """The process's start, in clock ticks after boot (field 22 of /proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # After the command name, which may hold spaces and parentheses: field 3 on.
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None
