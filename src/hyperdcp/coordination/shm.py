"""Shared-memory objects that a later process can reclaim, and cleanup on SIGTERM.

Every file hyperdcp creates in ``/dev/shm`` (or the staging fallback directory) is named

    hyperdcp-<kind>-<pid namespace>-<pid>-<start time>-<random>

(``kind``: ``stage`` for async-save staging areas, ``ro`` for read-once segments; the pid namespace
is the inode of ``/proc/self/ns/pid`` in hex, the start time is field 22 of ``/proc/<pid>/stat``).
A name is *orphaned* when it comes from this pid namespace and its process is gone, a zombie, or a
different process that reuses the pid (another start time). Orphans are unlinked whenever a new area
or segment is created and when an async-save session starts, so a process killed with SIGKILL (or by
an uncaught signal) leaks its shared memory only until the next hyperdcp save or load on that host.
Names from another pid namespace (a container sharing ``/dev/shm``) are never touched.

:class:`Segment` is one read-once segment in ``/dev/shm`` (created empty and sparse, registered so
that it is unlinked at exit or on SIGTERM at the latest); :func:`host_key` tells which ranks share a host
and its ``/dev/shm``.

:func:`sigterm_cleanup` makes SIGTERM run cleanups and then terminate the process by SIGTERM again,
where SIGTERM had its default action; a handler of the user's stays in charge (it is called instead,
and if it exits, the atexit cleanups run); an ignored SIGTERM stays ignored.
While the main thread is blocked inside a C call (a collective), Python
runs the handler only once that call returns (at the latest at the coordination timeout).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import re
import secrets
import signal
import socket
import threading
from typing import Callable, Iterator

_NAME_RE = re.compile(r"hyperdcp-(stage|ro)-([0-9a-f]+)-(\d+)-(\d+)-[0-9a-f]+\Z")
_LEGACY_STAGE_RE = re.compile(r"hyperdcp-stage-(\d+)-[0-9a-f]+\Z")  # before the start time was in the name
_TAG: tuple[int, str] | None = None  # (pid, tag) of this process, recomputed after fork


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rfind(b")") + 2 :].split()  # the command name may contain spaces and parentheses
    if not rest or rest[0] in (b"Z", b"X"):
        return None
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def owner_tag() -> str:
    """``<pid namespace>-<pid>-<start time>`` of this process."""
    global _TAG
    pid = os.getpid()
    if _TAG is None or _TAG[0] != pid:
        _TAG = (pid, f"{_pid_namespace():x}-{pid}-{start_time(pid) or 0}")
    return _TAG[1]


def new_name(kind: str) -> str:
    return f"hyperdcp-{kind}-{owner_tag()}-{secrets.token_hex(6)}"


def orphaned(name: str) -> bool:
    """Whether ``name`` is a hyperdcp shared-memory file whose creating process no longer exists."""
    m = _NAME_RE.match(name)
    if m is not None:
        ns, pid, start = int(m.group(2), 16), int(m.group(3)), int(m.group(4))
        if ns != _pid_namespace() or pid == os.getpid():
            return False
        now = start_time(pid)
        return now is None or (start != 0 and now != start)
    m = _LEGACY_STAGE_RE.match(name)
    if m is None or int(m.group(1)) == os.getpid():
        return False
    try:
        os.kill(int(m.group(1)), 0)
        return False  # its owner is alive
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive but not ours to signal


def reclaim(directory: str) -> int:
    """Unlink the orphaned hyperdcp shared-memory files in ``directory``; return how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if name.startswith("hyperdcp-") and orphaned(name):
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except OSError:
                pass
    return removed


def reserve(fd: int, nbytes: int) -> None:
    """Back ``nbytes`` of the file with real pages now, so a full tmpfs fails here (OSError ENOSPC)
    instead of killing the process with SIGBUS when a mapped page is first touched."""
    if nbytes <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


def free_bytes(directory: str) -> int:
    try:
        st = os.statvfs(directory)
        return int(st.f_bavail * st.f_frsize)
    except OSError:
        return 0


_CLEANUPS: dict[int, Callable[[], None]] = {}
_CLEANUPS_LOCK = threading.Lock()
_PREVIOUS: list = []  # the handler ours replaced (while installed)


def _on_sigterm(signum, frame) -> None:
    prev = _PREVIOUS[0] if _PREVIOUS else signal.SIG_DFL
    if callable(prev):  # the user's handler decides what SIGTERM does (if it exits, atexit cleans up)
        prev(signum, frame)
        return
    with _CLEANUPS_LOCK:
        fns = list(_CLEANUPS.values())
        _CLEANUPS.clear()
    for fn in fns:
        try:
            fn()
        except Exception:  # noqa: BLE001 - cleanup must not stop the signal
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # die by SIGTERM, as without us
    os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def sigterm_cleanup(fn: Callable[[], None]) -> Iterator[None]:
    """Run ``fn`` if SIGTERM arrives inside the block (main thread only; elsewhere a no-op).

    Nested and concurrent uses share one handler; the previous handler is restored when the last block
    ends, unless someone replaced ours meanwhile (theirs stays). SIG_IGN is left alone.
    """
    key = id(fn) ^ secrets.randbits(32)
    installed = False
    if threading.current_thread() is threading.main_thread():
        try:
            cur = signal.getsignal(signal.SIGTERM)
            if cur is _on_sigterm:
                installed = True
            elif cur is not signal.SIG_IGN and cur is not None:
                _PREVIOUS[:] = [cur]
                signal.signal(signal.SIGTERM, _on_sigterm)
                installed = True
        except (ValueError, OSError):
            installed = False
    if installed:
        with _CLEANUPS_LOCK:
            _CLEANUPS[key] = fn
    try:
        yield
    finally:
        if installed:
            with _CLEANUPS_LOCK:
                _CLEANUPS.pop(key, None)
                last = not _CLEANUPS
            if last and threading.current_thread() is threading.main_thread():
                try:
                    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                        signal.signal(signal.SIGTERM, _PREVIOUS[0] if _PREVIOUS else signal.SIG_DFL)
                        _PREVIOUS.clear()
                except (ValueError, OSError):
                    pass


# -- read-once segments -------------------------------------------------------------------------

SHM_DIR = "/dev/shm"
#: the name of a read-once segment (see new_name): what a rank accepts from another rank's plan header
SEGMENT_RE = re.compile(r"hyperdcp-ro-[0-9a-f]+-\d+-\d+-[0-9a-f]{12}\Z")
_LIVE: set[str] = set()  # segments this process created and has not unlinked yet
_LIVE_LOCK = threading.Lock()
_ATEXIT = False


def unlink_live() -> None:
    """Unlink every segment of this process that is still named (at exit, on SIGTERM, after errors)."""
    with _LIVE_LOCK:
        paths = list(_LIVE)
        _LIVE.clear()
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


_unlink_live = unlink_live  # old private name


def host_key(forced: str | None = None) -> str:
    """What ranks sharing a host (and its /dev/shm) have in common.

    ``forced`` (``LoadOptions.host_id``, whose default is ``HYPERDCP_HOST``) overrides it; ``None`` reads
    the environment for callers without options.
    """
    if forced is None:
        forced = os.environ.get("HYPERDCP_HOST")
    if forced:
        return "forced:" + forced
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        dev = os.stat(SHM_DIR).st_dev
    except OSError:
        dev = -1
    return f"{socket.gethostname()}|{boot}|{dev}"


def shm_enabled(allowed: bool | None = None) -> bool:
    """Whether read-once may use /dev/shm: ``allowed`` (``LoadOptions.shared_memory``, whose default is
    ``HYPERDCP_READ_ONCE_SHM``) and a writable /dev/shm; ``None`` reads the environment."""
    if allowed is None:
        allowed = os.environ.get("HYPERDCP_READ_ONCE_SHM", "1").strip().lower() not in ("0", "false", "no", "off")
    if not allowed:
        return False
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


class Segment:
    """This rank's /dev/shm file, created empty and sparse before the plan exchange.

    Call order: ``Segment(size)`` (reclaims orphans first), peers map it by ``name``; ``unlink()`` once
    every consumer mapped it; ``close()`` at the end (unlinks too if still named).
    """

    def __init__(self, size: int):
        global _ATEXIT
        reclaim(SHM_DIR)  # segments and staging areas of processes killed before they could unlink them
        self.name = new_name("ro")
        self.path = os.path.join(SHM_DIR, self.name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        self.fd = os.open(self.path, flags, 0o600)
        with _LIVE_LOCK:
            _LIVE.add(self.path)
            if not _ATEXIT:
                atexit.register(unlink_live)
                _ATEXIT = True
        try:
            os.ftruncate(self.fd, size)  # sparse: no memory until written
        except BaseException:
            self.close()
            raise
        self.size = size

    def unlink(self) -> None:
        with _LIVE_LOCK:
            live = self.path in _LIVE
            _LIVE.discard(self.path)
        if live:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def close(self) -> None:
        self.unlink()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_Segment = Segment  # old private name
