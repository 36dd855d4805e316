"""Local launcher: run ``fn(transport, *args)`` on n real processes of this machine.

The processes are started with the "spawn" method, join a
``torch.distributed`` group on 127.0.0.1 through the same environment
variables ``torchrun`` sets (the launcher hosts the rendezvous store, as
torchrun's agent does), and send back their results through a pipe as
:mod:`lowbit.comm.wire_objects` frames (no pickle: the launcher never runs what
a worker sends; results are values, tensors and registered dataclasses). A
worker that raises stops the whole launch: the others are terminated and the
launcher raises a :class:`WorkerFailed` that names the rank and carries its
traceback and its exception, rebuilt from its record.

Liveness, not a deadline: a launch has no whole-run time limit unless
``timeout_s`` sets one. Each worker beats a heartbeat (its last step and the
time) into shared memory whenever it starts a step (``transport.set_step``)
or communicates; a worker whose heartbeat is older than ``stall_timeout_s``
(stopped, deadlocked, or waiting on one that is; before its first step, the
longer of that and :data:`STARTUP_GRACE_S`) ends the launch with a
:class:`WorkerStalled` error naming the rank(s), their last step and whether
the OS reports the process stopped. A worker that dies is reported at once
(:class:`WorkerDied`). SIGTERM to the launching process ends the workers as
SIGINT does. Each worker watches its launcher (:func:`~lowbit.comm.liveness.watch_parent`):
a SIGKILLed launcher leaves no worker running. For several machines, start the
script with ``torchrun`` and call :func:`lowbit.comm.init_from_env` instead
(:func:`is_torchrun` tells which); the same liveness rules hold there
(:class:`~lowbit.comm.liveness.PeerMonitor`, used by ``lowbit train``).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import wire_objects
from .distributed import init_from_env
from .liveness import (DEFAULT_COLLECTIVE_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S, STARTUP_GRACE_S, Silence,  # noqa: F401
                       WorkerDied, WorkerFailed, WorkerStalled, died_error, os_state, sigterm_as_interrupt,
                       stall_error, stopped_note, watch_parent)

# The most local worker processes one launch starts: each is a Python interpreter with torch
# loaded (~300 MB) and a gloo socket to every peer it talks to.
MAX_LOCAL_WORKERS = 256
# The largest frame a worker may send back through its pipe (its result or its error).
MAX_RESULT_NBYTES = 1 << 34


class _Heartbeat:
    """A worker's slot in the launch's shared heartbeat array: (last step, monotonic time)."""

    def __init__(self, beats, rank: int):
        self.beats, self.rank = beats, rank

    def __call__(self, step: int | None = None) -> None:
        if step is not None:
            self.beats[2 * self.rank] = float(step)
        self.beats[2 * self.rank + 1] = time.monotonic()


def is_torchrun() -> bool:
    """True when this process was started by ``torchrun`` (or anything that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def _worker(rank: int, world_size: int, env: dict, backend: str, timeout_s: float, deterministic: bool, latency_s: float,
            fn, args, beats, launcher_pid: int, conn) -> None:
    watch_parent(launcher_pid, what=f"lowbit worker rank {rank}")  # a SIGKILLed launcher leaves no worker behind
    torch.set_num_threads(1)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)})
    beat = _Heartbeat(beats, rank)
    beat()
    try:
        transport = init_from_env(backend, timeout_s=timeout_s, deterministic=deterministic, latency_s=latency_s)
        transport.heartbeat = beat
        result = fn(transport, *args)
        payload = wire_objects.dumps({"ok": result})
    except BaseException as e:  # noqa: BLE001 - reported to the launcher
        conn.send_bytes(wire_objects.dumps({"error": wire_objects.exception_record(e, traceback.format_exc())}))
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # peers may be blocked in a collective with us: do not wait for them
    conn.send_bytes(payload)
    conn.close()
    try:  # leave together, so no rank closes its sockets under a peer still talking
        transport.barrier()
    finally:
        transport.close()


def launch(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    timeout_s: float | None = None,
    deterministic: bool = False,
    latency_s: float = 0.0,
    network=None,
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> list:
    """Run ``fn(transport, *args)`` on ``world_size`` local processes; results in rank order.

    ``fn`` must be a module-level (picklable) function and its results
    picklable. ``backend``: "gloo" (CPU) or "nccl" (one GPU per rank, rank r on
    ``cuda:r``). ``timeout_s``: a limit on the whole launch (None: none; a
    :class:`TimeoutError` when passed). ``stall_timeout_s``: the longest a
    worker may go without a heartbeat (starting a step or communicating)
    before the launch ends with :class:`WorkerStalled` (None: never).
    ``collective_timeout_s``: the backend's limit on one collective (capped by
    ``timeout_s``).
    ``deterministic``: float all-reduce sums in rank order, bit-identical to the
    in-process runtime (see :mod:`lowbit.comm.distributed`).
    ``latency_s``: seconds of latency each rank adds per message (see
    :class:`~lowbit.comm.distributed.TorchDistributedTransport`).
    ``network``: an entered :class:`~lowbit.comm.shaping.ShapedNetwork` of
    ``world_size`` ranks: rank r runs inside its namespace and the ranks talk
    over its shaped links (the store is hosted in rank 0's namespace).
    """
    op_timeout = _check_launch(world_size, fn, timeout_s, stall_timeout_s, collective_timeout_s, latency_s, network)
    store, env = _rendezvous(world_size, network, op_timeout)  # held until the launch ends
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    beats = ctx.RawArray("d", 2 * world_size)  # per rank: last step, monotonic time of the last beat
    for r in range(world_size):
        beats[2 * r], beats[2 * r + 1] = -1.0, time.monotonic()
    try:
        for rank in range(world_size):
            _start_worker(ctx, rank, network, procs, conns, (
                rank, world_size, env, backend, op_timeout, deterministic, latency_s, fn, args, beats))
        with sigterm_as_interrupt("launch: received signal {signum} (SIGTERM); workers ended"):
            results = _collect(procs, conns, timeout_s, stall_timeout_s, beats)
        for p in procs:  # they leave on their own after a final barrier
            p.join(timeout=30)
        return results
    finally:
        _end_workers(procs, conns)


def _check_launch(world_size, fn, timeout_s, stall_timeout_s, collective_timeout_s, latency_s, network) -> float:
    """Check :func:`launch`'s arguments; the backend's limit on one collective."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {fn!r}")
    if world_size > MAX_LOCAL_WORKERS:
        raise ValueError(f"workers={world_size}: one machine runs at most {MAX_LOCAL_WORKERS} worker processes "
                         f"(each is a Python process with torch loaded, ~300 MB); use --backend thread to "
                         f"simulate more, or torchrun over several machines")
    for name, v in (("timeout_s", timeout_s), ("stall_timeout_s", stall_timeout_s),
                    ("collective_timeout_s", collective_timeout_s)):
        if v is not None and not (isinstance(v, (int, float)) and v > 0 and not math.isnan(v)):
            raise ValueError(f"{name} must be a number of seconds > 0 (or None), got {v!r}")
    if collective_timeout_s is None:
        raise ValueError("collective_timeout_s must be a number of seconds > 0, got None")
    if not latency_s >= 0:
        raise ValueError(f"latency_s must be >= 0, got {latency_s!r}")
    if network is not None and network.n != world_size:
        raise ValueError(f"network has {network.n} ranks but world_size={world_size}")
    return collective_timeout_s if timeout_s is None else min(collective_timeout_s, timeout_s)


def _rendezvous(world_size: int, network, op_timeout: float) -> tuple[Any, dict]:
    """The rendezvous store, hosted here as torchrun's agent hosts it (the OS picks its port while
    it is bound, so no other program can take it first), and the environment the workers join with."""
    host = "127.0.0.1" if network is None else network.address(0)
    with _in_namespace(network, 0):
        store = dist.TCPStore(
            host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=op_timeout), wait_for_workers=False
        )
    env = {"MASTER_ADDR": host, "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    if network is not None:  # each rank's only way out is its shaped link
        from .shaping import IFNAME

        env["GLOO_SOCKET_IFNAME"] = IFNAME
    elif "GLOO_SOCKET_IFNAME" not in os.environ:
        lo = _loopback_ifname()
        if lo is not None:  # every rank is on this host: talk over loopback
            env["GLOO_SOCKET_IFNAME"] = lo
    return store, env


def _start_worker(ctx, rank: int, network, procs: list, conns: list, worker_args: tuple) -> None:
    """Start worker ``rank`` (in its namespace of ``network``) on :func:`_worker`'s ``worker_args``;
    its process and the reading end of its pipe join ``procs`` and ``conns``."""
    recv_end, send_end = ctx.Pipe(duplex=False)
    p = ctx.Process(
        target=_worker,
        args=(*worker_args, os.getpid(), send_end),
        name=f"lowbit-rank-{rank}",
        daemon=False,  # fn may start processes of its own (DataLoader workers)
    )
    with _in_namespace(network, rank):  # the child inherits this thread's namespace
        p.start()
    send_end.close()
    procs.append(p)
    conns.append(recv_end)


def _end_workers(procs: list, conns: list) -> None:
    """End the workers still running (SIGTERM, then SIGKILL) and close their pipes."""
    for p in procs:
        if p.is_alive():
            p.terminate()
            with contextlib.suppress(OSError):  # a stopped worker acts on SIGTERM once continued
                os.kill(p.pid, signal.SIGCONT)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    for c in conns:
        c.close()


def _in_namespace(network, rank: int):
    return contextlib.nullcontext() if network is None else network.enter(rank)


def _collect(procs, conns, timeout_s: float | None, stall_timeout_s: float | None, beats) -> list:
    """Each rank's result, read as it arrives; the first failure, death or stall is raised."""
    world_size = len(procs)
    results: list = [None] * world_size
    pending = {conns[r]: r for r in range(world_size)}  # ranks whose result has not come
    deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s

    def died(rank: int) -> RuntimeError:
        procs[rank].join(timeout=1)
        code = procs[rank].exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        hint = " (SIGKILL: often the out-of-memory killer)" if code == -signal.SIGKILL else ""
        return died_error("launch", rank, world_size, how + hint, int(beats[2 * rank]))

    while pending:
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            raise TimeoutError(f"launch: rank(s) {sorted(pending.values())} did not finish within timeout_s={timeout_s}")
        if stall_timeout_s is not None:
            stale = [r for r in pending.values()
                     if now - beats[2 * r + 1] > (stall_timeout_s if beats[2 * r] >= 0
                                                  else max(stall_timeout_s, STARTUP_GRACE_S))]
            if stale:
                raise stall_error("launch", world_size, [
                    Silence(r, int(beats[2 * r]), now - beats[2 * r + 1], stopped_note(procs[r].pid)) for r in stale],
                    stall_timeout_s)
        sentinels = {procs[r].sentinel: r for r in pending.values()}
        ready = wait(list(pending) + list(sentinels), timeout=min(left, 1.0))
        for obj in ready:
            if obj in pending:
                rank = pending.pop(obj)
                try:
                    frame = obj.recv_bytes(MAX_RESULT_NBYTES)
                except EOFError:
                    raise died(rank) from None
                except OSError as e:  # a frame longer than the bound
                    raise wire_objects.BadPeerData(f"worker rank {rank} sent a result of more than "
                                                   f"{MAX_RESULT_NBYTES} bytes; refused ({e})") from None
                results[rank] = _result(frame, rank, world_size)
        for obj in ready:  # a worker gone with nothing left in its pipe
            rank = sentinels.get(obj)
            if rank is not None and conns[rank] in pending and not conns[rank].poll():
                raise died(rank)
    return results


def _result(frame: bytes, rank: int, world_size: int):
    """The result in worker ``rank``'s frame, or its error raised as :class:`WorkerFailed`."""
    who = f"worker rank {rank}"
    msg = wire_objects.loads(frame, sender=who, max_nbytes=MAX_RESULT_NBYTES)
    if not (isinstance(msg, dict) and len(msg) == 1 and ("ok" in msg or "error" in msg)):
        raise wire_objects.BadPeerData(f"{who} sent a frame that is neither a result nor an error; refused")
    if "ok" in msg:
        return msg["ok"]
    rec = msg["error"]
    cause = wire_objects.rebuild_exception(rec, sender=who)
    raise WorkerFailed(f"launch: worker rank {rank} of {world_size} failed:\n{rec.get('traceback', '')}", rank,
                       str(rec.get("summary", "")), cause)
