"""Local launcher: run ``fn(transport, *args)`` on n real processes of this machine.

The processes are started with the "spawn" method, join a
``torch.distributed`` group on 127.0.0.1 through the same environment
variables ``torchrun`` sets (the launcher hosts the rendezvous store, as
torchrun's agent does), and send back their (picklable) results. A worker
that raises stops the whole launch: the others are terminated and the
launcher raises a :class:`RuntimeError` that names the rank and carries its
traceback. For several machines, start the script with ``torchrun`` and call
:func:`lowbit.comm.init_from_env` instead (:func:`is_torchrun` tells which).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .distributed import init_from_env


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
            fn, args, conn) -> None:
    torch.set_num_threads(1)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)})
    try:
        transport = init_from_env(backend, timeout_s=timeout_s, deterministic=deterministic, latency_s=latency_s)
        result = fn(transport, *args)
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:  # noqa: BLE001 - reported to the launcher
        conn.send(("error", traceback.format_exc()))
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # peers may be blocked in a collective with us: do not wait for them
    conn.send(("ok", payload))
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
    timeout_s: float = 600,
    deterministic: bool = False,
    latency_s: float = 0.0,
    network=None,
) -> list:
    """Run ``fn(transport, *args)`` on ``world_size`` local processes; results in rank order.

    ``fn`` must be a module-level (picklable) function and its results
    picklable. ``backend``: "gloo" (CPU) or "nccl" (one GPU per rank, rank r on
    ``cuda:r``). ``timeout_s`` bounds the whole launch and every collective.
    ``deterministic``: float all-reduce sums in rank order, bit-identical to the
    in-process runtime (see :mod:`lowbit.comm.distributed`).
    ``latency_s``: seconds of latency each rank adds per message (see
    :class:`~lowbit.comm.distributed.TorchDistributedTransport`).
    ``network``: an entered :class:`~lowbit.comm.shaping.ShapedNetwork` of
    ``world_size`` ranks: rank r runs inside its namespace and the ranks talk
    over its shaped links (the store is hosted in rank 0's namespace).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {fn!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if not latency_s >= 0:
        raise ValueError(f"latency_s must be >= 0, got {latency_s!r}")
    if network is not None and network.n != world_size:
        raise ValueError(f"network has {network.n} ranks but world_size={world_size}")
    # The launcher hosts the rendezvous store, as torchrun's agent does: the OS
    # picks its port while it is bound, so no other program can take it first.
    host = "127.0.0.1" if network is None else network.address(0)
    with _in_namespace(network, 0):
        store = dist.TCPStore(
            host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
    env = {"MASTER_ADDR": host, "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    if network is not None:  # each rank's only way out is its shaped link
        from .shaping import IFNAME

        env["GLOO_SOCKET_IFNAME"] = IFNAME
    elif "GLOO_SOCKET_IFNAME" not in os.environ:
        lo = _loopback_ifname()
        if lo is not None:  # every rank is on this host: talk over loopback
            env["GLOO_SOCKET_IFNAME"] = lo

    ctx = mp.get_context("spawn")
    procs, conns = [], []
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(rank, world_size, env, backend, timeout_s, deterministic, latency_s, fn, args, send_end),
                name=f"lowbit-rank-{rank}",
                daemon=False,  # fn may start processes of its own (DataLoader workers)
            )
            with _in_namespace(network, rank):  # the child inherits this thread's namespace
                p.start()
            send_end.close()
            procs.append(p)
            conns.append(recv_end)
        results = _collect(procs, conns, timeout_s)
        for p in procs:  # they leave on their own after a final barrier
            p.join(timeout=30)
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns:
            c.close()


def _in_namespace(network, rank: int):
    return contextlib.nullcontext() if network is None else network.enter(rank)


def _collect(procs, conns, timeout_s: float) -> list:
    """Each rank's result, read as it arrives; the first failure or death is raised."""
    world_size = len(procs)
    results: list = [None] * world_size
    pending = {conns[r]: r for r in range(world_size)}  # ranks whose result has not come
    deadline = time.monotonic() + timeout_s

    def died(rank: int) -> RuntimeError:
        procs[rank].join(timeout=1)
        code = procs[rank].exitcode
        return RuntimeError(f"launch: worker rank {rank} of {world_size} exited with code {code} without a result")

    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"launch: rank(s) {sorted(pending.values())} did not finish within timeout_s={timeout_s}")
        sentinels = {procs[r].sentinel: r for r in pending.values()}
        ready = wait(list(pending) + list(sentinels), timeout=min(left, 1.0))
        for obj in ready:
            if obj in pending:
                rank = pending.pop(obj)
                try:
                    status, payload = obj.recv()
                except EOFError:
                    raise died(rank) from None
                if status != "ok":
                    raise RuntimeError(f"launch: worker rank {rank} of {world_size} failed:\n{payload}")
                results[rank] = pickle.loads(payload)
        for obj in ready:  # a worker gone with nothing left in its pipe
            rank = sentinels.get(obj)
            if rank is not None and conns[rank] in pending and not conns[rank].poll():
                raise died(rank)
    return results
