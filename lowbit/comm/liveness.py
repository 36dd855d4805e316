"""Liveness of a run's workers: one story for lowbit's launcher and for torchrun.

Each worker beats a heartbeat (its last step and the time) whenever it starts
a step (``transport.set_step``) or communicates (every op calls the
transport's ``heartbeat``). A worker whose heartbeat is older than the stall
timeout (before its first step: the longer of that and
:data:`STARTUP_GRACE_S`) ends the run with :class:`WorkerStalled` naming the
rank(s), their last step and whether the OS reports the process stopped
(:func:`stall_error`); a worker that dies ends it with :class:`WorkerDied`; one
that raises, with :class:`WorkerFailed`.

Who watches:

- lowbit's launcher (:mod:`lowbit.comm.launcher`): the beats go into shared
  memory and the launching process watches them, and the workers' exits.
- torchrun: no process of lowbit's sees every rank, so each rank runs a
  :class:`PeerMonitor`, a daemon thread that publishes this rank's beat through
  the rendezvous store (torchrun's TCPStore) and reads the others'. A rank
  whose beats stop coming (its process stopped or gone) or say its main thread
  is silent, a process on this host that is gone, or the whole-run
  ``timeout_s`` passing ends every rank: the first rank to see it publishes the
  verdict under one key, every rank reports that same verdict, and rank 0
  writes it to ``summary.json`` (the training run's ``on_end``).

And each worker watches its parent (:func:`watch_parent`): a worker of
lowbit's launcher gets the parent-death signal (Linux ``prctl``) and, on any
system, a thread that ends it when its parent process is gone, so that a
SIGKILLed launcher leaves no workers training on.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

DEFAULT_STALL_TIMEOUT_S = 300.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
# Before its first step a worker imports torch, joins the rendezvous and loads its data: it
# gets at least this long (or the stall timeout, if longer) before it counts as stalled.
STARTUP_GRACE_S = 120.0
# How often a torchrun rank publishes its beat and reads its peers' (at most; a quarter of
# the stall timeout when that is shorter).
MONITOR_INTERVAL_S = 0.5
# A peer's death shows on the survivors first as a closed connection (gloo) or SIGTERM
# (torchrun's agent). A rank that fails so looks this long (at most) for the reason before it
# reports its own error: a peer found gone, or another rank's verdict.
DIAGNOSE_S = 2.0


class WorkerDied(RuntimeError):
    """A worker process exited without a result (killed, out of memory, os._exit)."""


class WorkerFailed(RuntimeError):
    """A worker raised; ``rank``, ``error`` (the exception's one-line summary) and the traceback in the message."""

    def __init__(self, message: str, rank: int, error: str, cause: BaseException | None = None):
        super().__init__(message)
        self.rank = rank
        self.error = error
        self.cause = cause  # the worker's exception, rebuilt from its record (wire_objects.rebuild_exception)


class WorkerStalled(TimeoutError):
    """No heartbeat from a worker for ``stall_timeout_s`` seconds."""


def os_state(pid: int) -> str | None:
    """The process state letter of /proc/PID/stat (Linux; 'T' stopped, 'Z' zombie), or None (no such process,
    or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _gone(pid: int) -> bool:
    """True when process ``pid`` of this host has exited (absent, or a zombie)."""
    if os.path.isdir("/proc"):
        return os_state(pid) in (None, "Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


@dataclass
class Silence:
    """A rank without progress: its last step (-1: before its first), seconds silent, and what the OS says."""

    rank: int
    step: int
    silent_s: float
    note: str = ""


def stall_error(who: str, world_size: int, stale: list[Silence], stall_timeout_s: float) -> WorkerStalled:
    """The one message of a stall, whichever launcher found it: the ranks whose process is not
    running (a ``note`` says so) first, then the longest silent."""
    parts = [f"rank {s.rank} ({'before its first step' if s.step < 0 else f'last step {s.step}'}, "
             f"silent {s.silent_s:.0f} s{s.note})" for s in sorted(stale, key=lambda s: (not s.note, -s.silent_s))]
    return WorkerStalled(f"{who}: no progress from {len(stale)} of {world_size} worker(s) for more than "
                         f"stall_timeout_s={stall_timeout_s:g} s: {'; '.join(parts)}. A worker is stopped, hung, "
                         f"or waiting on one that is (raise --stall-timeout if a step really takes this long)")


def stopped_note(pid: int | None) -> str:
    """The clause a stall message adds for a worker whose process the OS reports stopped
    (SIGSTOP, state ``T``); empty otherwise or without a pid."""
    return ", process stopped (SIGSTOP?)" if pid is not None and os_state(pid) == "T" else ""


def died_error(who: str, rank: int, world_size: int, how: str, step: int, heard: bool = False) -> WorkerDied:
    """The one message of a dead worker: how it ended and at which step (``heard``: the step of its
    last heartbeat, which may be behind the step it reached)."""
    where = "before its first step" if step < 0 else f"(last heard from at step {step})" if heard else f"at step {step}"
    err = WorkerDied(f"{who}: worker rank {rank} of {world_size} {how} {where}, without a result")
    err.rank = rank
    return err


# ---- parent death --------------------------------------------------------------------------
_PR_SET_PDEATHSIG = 1


def watch_parent(parent_pid: int, *, pdeathsig: bool = True, interval_s: float = 0.5, what: str = "worker") -> None:
    """End this process (exit code 1) when its parent ``parent_pid`` is gone.

    ``pdeathsig``: also ask Linux to SIGKILL this process when the thread that started it exits
    (``prctl(PR_SET_PDEATHSIG)``; only where that thread lives as long as the parent needs the
    child, as in :func:`lowbit.comm.launch`). On every system a daemon thread compares
    ``os.getppid()`` with ``parent_pid`` every ``interval_s`` (an orphan is re-parented)."""
    if pdeathsig and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    def orphaned() -> None:
        sys.stderr.write(f"lowbit: {what} (pid {os.getpid()}): its parent (pid {parent_pid}) is gone; exiting\n")
        sys.stderr.flush()
        os._exit(1)

    if os.getppid() != parent_pid:  # it died before the signal was asked for
        orphaned()

    def poll() -> None:
        wake = threading.Event()
        while not wake.wait(interval_s):
            if os.getppid() != parent_pid:
                orphaned()

    threading.Thread(target=poll, name="lowbit-parent-watch", daemon=True).start()


# ---- torchrun: every rank watches the others through the rendezvous store ------------------
@dataclass
class _Peer:
    seq: int = -1
    seen_at: float = 0.0   # local monotonic time when its seq last changed
    step: int = -1
    age: float = 0.0       # seconds its main thread had been silent when it published
    done: bool = False
    host: str | None = None
    pid: int | None = None


class PeerMonitor:
    """A torchrun rank's view of every rank's liveness (see the module doc).

    ``store``: a ``torch.distributed.Store`` every rank reaches (default: a client of
    ``MASTER_ADDR:MASTER_PORT``, torchrun's store); ``on_end(exc)``: called on the monitor's
    thread with the run's verdict when it must end this rank (it should not return: the main
    thread may be blocked in a collective that never completes; if it returns, the process exits
    with code 1). :meth:`beat` is the transport's heartbeat; :meth:`explain` turns an exception
    of this rank's main thread into the run's verdict. Use as a context manager (start/stop)."""

    def __init__(self, rank: int, world_size: int, *, stall_timeout_s: float | None, timeout_s: float | None,
                 on_end, store=None, interval_s: float | None = None):
        self.rank, self.world_size = rank, world_size
        self.stall_timeout_s, self.timeout_s = stall_timeout_s, timeout_s
        self.interval_s = interval_s if interval_s is not None else min(
            MONITOR_INTERVAL_S, (stall_timeout_s or math.inf) / 4)
        self.on_end = on_end
        self.store = store if store is not None else _connect_store()
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.t0 = self.last = time.monotonic()
        self.step = -1
        self.seq = 0
        self.done = False
        self.peers = {r: _Peer(seen_at=self.t0) for r in range(world_size) if r != rank}
        self._ending = threading.Lock()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one store request at a time
        self._thread = threading.Thread(target=self._run, name=f"lowbit-liveness-{rank}", daemon=True)

    # -- this rank ---------------------------------------------------------------------------
    def beat(self, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        self.last = time.monotonic()

    @property
    def ending(self) -> bool:
        return self._ending.locked()

    def __enter__(self) -> "PeerMonitor":
        with self._lock:
            self.store.set(f"pid/{self.rank}", f"{self.pid} {self.host}")
        self._publish()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def finish(self) -> None:
        """This rank has its result: the others stop watching it (it now only waits for them)."""
        self.done = True
        self._publish()

    # -- the store ---------------------------------------------------------------------------
    def _publish(self) -> None:
        self.seq += 1
        last, step = self.last, self.step  # the main thread may beat meanwhile: read it once, then the clock
        age = max(0.0, time.monotonic() - last)
        with self._lock:
            self.store.set(f"beat/{self.rank}", f"{self.seq} {step} {age:.3f} {int(self.done)}")

    def _read(self) -> dict | None:
        """Update the peers from their beats; return the published verdict, if any."""
        now = time.monotonic()
        with self._lock:
            verdict = self.store.get("end") if self.store.check(["end"]) else None
            # a beat key, once there, stays: ask the store about the missing ones only (one request
            # per rank and interval once every rank has beaten)
            have = [r for r, p in self.peers.items() if p.seq >= 0 or self.store.check([f"beat/{r}"])]
            values = self.store.multi_get([f"beat/{r}" for r in have]) if have else []
            unknown = [r for r in have if self.peers[r].pid is None]
            pids = self.store.multi_get([f"pid/{r}" for r in unknown]) if unknown else []
        from .wire_objects import BadPeerData

        for r, v in zip(unknown, pids):
            try:
                pid, _, host = v.decode().partition(" ")
                self.peers[r].pid, self.peers[r].host = int(pid), host
            except (UnicodeDecodeError, ValueError):
                raise BadPeerData(f"rank {r} published a malformed process id {bytes(v[:40])!r}") from None
        for r, v in zip(have, values):
            try:
                seq, step, age, done = v.decode().split()
                seq, step, age = int(seq), int(step), float(age)
                if done not in ("0", "1") or not age >= 0:
                    raise ValueError
            except (UnicodeDecodeError, ValueError):
                raise BadPeerData(f"rank {r} published a malformed heartbeat {bytes(v[:40])!r}") from None
            p = self.peers[r]
            if seq != p.seq:
                p.seq, p.seen_at, p.step, p.age, p.done = seq, now, step, age, done == "1"
        if verdict is None:
            return None
        try:
            return json.loads(verdict)
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise BadPeerData(f"the run's verdict in the store is not JSON: {bytes(verdict[:40])!r}") from None

    # -- verdicts ----------------------------------------------------------------------------
    def _local(self, r: int) -> bool:
        return self.peers[r].pid is not None and self.peers[r].host == self.host

    def _dead(self, now: float, quiet_s: float | None) -> BaseException | None:
        """A peer gone from this host, or (``quiet_s``) one whose beats stopped that long ago while ours went on."""
        for r, p in self.peers.items():
            if p.done:
                continue
            if self._local(r) and _gone(p.pid):
                return died_error("torchrun", r, self.world_size, "died (its process is gone: killed, out of "
                                  "memory or exited)", p.step, heard=True)
            if quiet_s is not None and p.seq >= 0 and now - p.seen_at > quiet_s:
                return died_error("torchrun", r, self.world_size, f"stopped sending heartbeats {now - p.seen_at:.1f} "
                                  f"s ago (its process is gone or stopped)", p.step, heard=True)
        return None

    def _stalled(self, now: float) -> BaseException | None:
        if self.timeout_s is not None and now - self.t0 > self.timeout_s:
            left = [r for r in range(self.world_size)
                    if not (self.done if r == self.rank else self.peers[r].done)]
            return TimeoutError(f"torchrun: rank(s) {left} did not finish within timeout_s={self.timeout_s:g}")
        if self.stall_timeout_s is None:
            return None
        ranks = [(self.rank, self.step, now - self.last, self.done, self.pid)]
        ranks += [(r, p.step, (now - p.seen_at) + p.age, p.done, p.pid if self._local(r) else None)
                  for r, p in self.peers.items()]
        silences, over = [], False
        for r, step, silent, done, pid in ranks:
            if done:
                continue
            limit = self.stall_timeout_s if step >= 0 else max(self.stall_timeout_s, STARTUP_GRACE_S)
            note = stopped_note(pid)
            if not note and r != self.rank and now - self.peers[r].seen_at > 3 * self.interval_s:
                note = ", its process sends no heartbeat (stopped, frozen or gone)"
            over |= silent > limit
            if silent > limit or note:
                silences.append(Silence(r, step, silent, note))
        # A rank waiting in a collective on a stopped one may have been silent longer than it (it
        # stopped beating when it began to wait): once one is over the limit, every rank whose
        # process is not running is named too, first.
        return stall_error("torchrun", self.world_size, silences, self.stall_timeout_s) if over else None

    def _publish_end(self, exc: BaseException, own: bool) -> BaseException:
        """Publish ``exc`` as the run's verdict unless another rank was first; the verdict every rank
        reports. Called by the one thread that holds ``_ending`` (the main thread's :meth:`explain`
        or the monitor's :meth:`_run`)."""
        from .wire_objects import exception_record

        rec = json.dumps({"rank": self.rank, "own": own, "error": exception_record(exc)}).encode()
        for _ in range(3):  # a store request interrupted by a signal (torchrun's SIGTERM) is asked again
            try:
                with self._lock:
                    first = self.store.compare_set("end", "", rec)
                break
            except Exception:  # noqa: BLE001
                first = None
        if first is None or first == rec:  # ours (or the store is gone: report what this rank knows)
            return exc
        return self._rebuild(first)

    def _rebuild(self, raw) -> BaseException:
        """The verdict a rank published (``raw``: its JSON, or the parsed record)."""
        from .wire_objects import BadPeerData, rebuild_exception

        try:
            rec = raw if isinstance(raw, dict) else json.loads(raw)
            rank = int(rec["rank"])
            err = rebuild_exception(rec["error"], sender=f"rank {rank}")
            if rec.get("own") and rank != self.rank:  # that rank's own failure, as lowbit's launcher reports one
                return WorkerFailed(f"torchrun: worker rank {rank} of {self.world_size} failed:\n"
                                    f"{rec['error'].get('traceback', '')}", rank, str(rec["error"].get("summary")),
                                    err)
            return err
        except (BadPeerData, KeyError, TypeError, ValueError, RecursionError) as e:
            return e if isinstance(e, BadPeerData) else BadPeerData(f"the run's verdict is malformed: {e!r}"[:300])

    def _end(self, exc: BaseException) -> None:
        """On the monitor's thread, holding ``_ending``: end this rank with ``exc``."""
        for r, p in self.peers.items():  # a stopped rank of this host wakes to read the verdict and leave
            if self._local(r) and os_state(p.pid) == "T":
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGCONT)
        try:
            self.on_end(exc)
        finally:
            os._exit(1)

    def _run(self) -> None:
        from .wire_objects import BadPeerData

        failing_since = None
        while not self._stop.wait(self.interval_s):
            rec, verdict = None, None
            try:
                self._publish()
                rec = self._read()
                failing_since = None
            except BadPeerData as e:
                verdict = e
            except Exception as e:  # noqa: BLE001 - the store's host (torchrun's agent, or rank 0) may be gone
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since < DIAGNOSE_S:  # or a request interrupted by a signal
                    continue
                verdict = WorkerDied(f"torchrun: rank {self.rank} lost the rendezvous store ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0] if str(e) else ''}): torchrun's agent or the "
                                     f"store's host is gone")
            now = time.monotonic()
            if rec is None and verdict is None:
                verdict = self._dead(now, None) or self._stalled(now)
                if verdict is None:
                    continue
            if not self._ending.acquire(blocking=False):  # the main thread is ending this rank
                return
            self._end(self._rebuild(rec) if rec is not None else self._publish_end(verdict, own=False))
            return

    def explain(self, e: BaseException) -> BaseException:
        """The error this rank reports for the exception ``e`` of its main thread: the run's verdict.
        A communication failure or a termination signal (a peer's death shows so) is diagnosed for up
        to :data:`DIAGNOSE_S`: a verdict another rank published (or this rank's monitor, just before),
        or a peer found gone, wins."""
        if not self._ending.acquire(blocking=False):  # the monitor thread is ending this rank: it exits
            threading.Event().wait()
        if _is_comm_failure(e):
            deadline = time.monotonic() + DIAGNOSE_S
            while time.monotonic() <= deadline:
                try:
                    rec = self._read()
                except Exception:  # noqa: BLE001 - a request interrupted by a signal, or no store: ask again
                    rec = None
                else:
                    if rec is not None:
                        return self._rebuild(rec)
                    verdict = self._dead(time.monotonic(), 3 * self.interval_s)
                    if verdict is not None:
                        return self._publish_end(verdict, own=False)
                self._stop.wait(self.interval_s / 2)
        return self._publish_end(e, own=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM received by a lowbit process (handled as Ctrl-C: its workers or its rank are ended)."""


def _is_comm_failure(e: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(e, Terminated):
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(w in text for w in ("gloo", "connection", "nccl", "socket"))


@contextlib.contextmanager
def sigterm_as_interrupt(message: str, ignore_while=None):
    """While inside, SIGTERM raises :class:`Terminated` in the main thread as SIGINT does (so that
    ``finally`` blocks run), unless ``ignore_while()`` is true (a rank already ending). A rank that
    leaves the block ending goes on ignoring SIGTERM: it is on its way out with the run's verdict
    (writing its summary), and torchrun's agent, which sends SIGTERM once a peer died, would
    otherwise end it between the block and the summary. Only on the main thread, where handlers can be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if ignore_while is not None and ignore_while():
            return
        raise Terminated(message.format(signum=signum))

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        ending = ignore_while is not None and ignore_while()
        signal.signal(signal.SIGTERM, signal.SIG_IGN if ending else old)


def _connect_store():
    """A client of the rendezvous store named by MASTER_ADDR/MASTER_PORT, under a key space of this attempt."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"lowbit/liveness/{run}/{attempt}/", store)
