"""Worker processes of a tensor-parallel engine, and the control link between them.

The engine's process is rank 0 (the driver: scheduler, sampler, its own model shard); ranks
1..N-1 are workers that run their shards as the driver tells them. Two channels join them:

* control: one ``multiprocessing.connection`` per worker (TCP, authenticated with a random
  key), carrying pickled commands from the driver and the few replies (setup results, a
  worker's last error). A worker waits on it without a timeout between steps; when the
  driver goes away the connection closes and the worker exits.
* data: the ``TensorParallelGroup`` (gloo or NCCL) that the shards' layers gather through,
  met in a ``TCPStore``.

``WorkerProcesses.spawn`` starts the workers itself (multiprocessing's spawn start method, a
fresh interpreter per rank, as vLLM does; the script that builds an engine needs the usual
``if __name__ == "__main__":`` guard). ``WorkerProcesses.from_torchrun`` meets workers that
``torchrun`` started: every rank runs the same script, rank 0's engine becomes the driver,
and the others find it (``torchrun_rendezvous``) from inside their own engine constructor.

A worker that dies is noticed (a monitor thread on the process sentinels, or the broken
connection under torchrun) and every later call raises ``WorkerDied`` naming its rank, with
the worker's own traceback when it managed to send one; ``on_failure`` (the driver aborts its
NCCL group there) unblocks a driver waiting in a collective.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import secrets
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

# How long the driver waits for a worker to connect after starting (importing torch and
# detlora) before checking again that it is alive; there is no overall limit.
_POLL_S = 0.2
_STORE_TIMEOUT = datetime.timedelta(minutes=5)
# The exit code of a spawned worker that found itself building an engine while it re-ran the
# script's main module (``refuse_in_spawn_bootstrap``), and what the driver then tells the user.
MAIN_REIMPORT_EXIT = 86
MAIN_GUARD_HELP = (
    "stopped while re-running your script: tensor_parallel_size > 1 starts each worker with "
    "multiprocessing's spawn, which imports the script's main module again in the new "
    "process, and the script builds an LLM (or engine) at module level, so the worker would "
    "start one of its own. Put the code that builds and uses the LLM under\n\n"
    "    if __name__ == \"__main__\":\n        llm = LLM(..., tensor_parallel_size=N)\n\n"
    "(Python's multiprocessing guide, \"Safe importing of main module\"; vLLM asks the same)")


class WorkerDied(RuntimeError):
    """A tensor-parallel worker exited or lost its connection; ``rank`` names it."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"tensor-parallel worker rank {rank} {detail}")
        self.rank = rank


@dataclass(frozen=True)
class Rendezvous:
    """Where a worker finds the driver: the group's store and the control listener."""

    rank: int
    size: int
    store_host: str
    store_port: int
    control: tuple[str, int]
    authkey: bytes
    store_is_torchrun: bool = False  # the store is torchrun's (its agent hosts it)

    def connect_store(self) -> dist.TCPStore:
        return dist.TCPStore(self.store_host, self.store_port, self.size, False,
                             timeout=_STORE_TIMEOUT)


class WorkerProcesses:
    """The driver's side: one control connection per worker rank (1..size-1)."""

    def __init__(self, size: int, store: dist.Store, conns: dict[int, mpc.Connection],
                 procs: dict[int, Any]) -> None:
        self.size = size
        self.store = store
        self._conns = conns
        self._procs = procs  # rank -> multiprocessing.Process (spawn) ; empty under torchrun
        self._failure: WorkerDied | None = None
        self._closing = False
        self._lock = threading.Lock()
        self.on_failure: Callable[[], None] | None = None
        if procs:
            threading.Thread(target=self._monitor, name="detlora-tp-monitor",
                             daemon=True).start()

    # ---- starting ----

    @classmethod
    def spawn(cls, size: int, target: Callable[[Rendezvous, Any], None], payload: Any,
              ) -> WorkerProcesses:
        """Start ranks 1..size-1 as ``target(rendezvous, payload)`` in fresh interpreters;
        returns once every one of them is connected."""
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=_STORE_TIMEOUT,
                              wait_for_workers=False)
        authkey = secrets.token_bytes(32)
        listener = mpc.Listener(("127.0.0.1", 0), authkey=authkey)
        ctx = mp.get_context("spawn")
        procs = {}
        try:
            for rank in range(1, size):
                rdv = Rendezvous(rank, size, "127.0.0.1", store.port, listener.address,
                                 authkey)
                proc = ctx.Process(target=_worker_entry, args=(target, rdv, payload,
                                                               os.getpid()),
                                   name=f"detlora-tp-rank{rank}", daemon=True)
                proc.start()
                procs[rank] = proc
            conns = _accept(listener, size, procs)
        except BaseException:
            for proc in procs.values():
                proc.kill()
            raise
        finally:
            listener.close()
        return cls(size, store, conns, procs)

    @classmethod
    def from_torchrun(cls, size: int, key: str, payload: Any) -> WorkerProcesses:
        """Rank 0 of a ``torchrun`` launch: publish the control listener and ``payload``
        under ``key`` in torchrun's store and wait for ranks 1..size-1
        (``torchrun_rendezvous(key)``) to connect."""
        env = torchrun_env()
        assert env is not None and env[0] == 0
        store = _torchrun_store(0, size)
        authkey = secrets.token_bytes(32)
        host = "127.0.0.1" if _single_node() else socket.gethostbyname(socket.gethostname())
        listener = mpc.Listener((host, 0), authkey=authkey)
        store.set(f"detlora/{key}", pickle.dumps((listener.address, authkey, payload)))
        try:
            conns = _accept(listener, size, {})
        finally:
            listener.close()
        return cls(size, store, conns, {})

    # ---- commands ----

    def send(self, message: Any) -> None:
        """One command to every worker (pickled once)."""
        self.check()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in self._conns.items():
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise self._died(rank, f"lost its connection ({e})") from None

    def recv(self, rank: int) -> Any:
        """The next reply of ``rank`` (waits while it is alive)."""
        conn = self._conns[rank]
        while True:
            self.check()
            try:
                if conn.poll(_POLL_S):
                    kind, value = pickle.loads(conn.recv_bytes())
                    if kind == "error":
                        raise self._died(rank, f"failed:\n{value}")
                    return value
            except (EOFError, OSError):
                raise self._died(rank, "closed its connection") from None

    def gather_replies(self) -> list[Any]:
        """One reply from every worker, in rank order (1..size-1)."""
        return [self.recv(rank) for rank in sorted(self._conns)]

    @property
    def pids(self) -> dict[int, int]:
        """rank -> process id of the spawned workers (none under torchrun)."""
        return {rank: proc.pid for rank, proc in self._procs.items()}

    # ---- failures ----

    def fail(self, error: BaseException) -> None:
        """Mark the group broken: every later call raises ``error`` (the ranks are out of
        step once one of them failed a command)."""
        with self._lock:
            if self._failure is None:
                self._failure = (error if isinstance(error, WorkerDied)
                                 else WorkerDied(0, f"(the driver) failed a step: {error!r}"))

    def check(self) -> None:
        """Raise ``WorkerDied`` if a worker has died (or the group was broken before)."""
        if self._failure is not None:
            raise self._failure
        for rank, proc in self._procs.items():
            if proc.exitcode is not None and not self._closing:
                raise self._died(rank, f"exited with code {proc.exitcode}")

    def explain(self, error: BaseException) -> BaseException:
        """``error`` (raised by a collective) as ``WorkerDied`` when a worker is gone."""
        deadline = time.monotonic() + 2.0  # a killed peer's exit may lag its socket's close
        while time.monotonic() < deadline:
            try:
                self.check()
            except WorkerDied as died:
                return died
            if not self._procs:
                break
            time.sleep(0.05)
        return error

    def _died(self, rank: int, detail: str) -> WorkerDied:
        with self._lock:
            if self._failure is None:
                message = self._last_error(rank)
                if message and "failed:" not in detail:
                    detail = f"{detail}; its error:\n{message}"
                self._failure = WorkerDied(rank, detail)
            return self._failure

    def _last_error(self, rank: int) -> str | None:
        """The traceback a dying worker sent, if it sent one."""
        conn = self._conns.get(rank)
        try:
            while conn is not None and conn.poll(0):
                kind, value = pickle.loads(conn.recv_bytes())
                if kind == "error":
                    return value
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        return None

    def _monitor(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in self._procs.items()}
        mpc.wait(list(sentinels))
        if self._closing:
            return
        for rank, proc in self._procs.items():
            proc.join(0)
            if proc.exitcode is not None:
                self._died(rank, f"exited with code {proc.exitcode}")
                break
        if self.on_failure is not None:
            self.on_failure()

    # ---- stopping ----

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell every worker to exit and wait for it (killing it after ``timeout``)."""
        if self._closing:
            return
        self._closing = True
        data = pickle.dumps(("shutdown",))
        for conn in self._conns.values():
            with contextlib.suppress(OSError):  # a worker already gone
                conn.send_bytes(data)
        deadline = time.monotonic() + timeout
        for proc in self._procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join(1.0)
        for conn in self._conns.values():
            conn.close()


def _accept(listener: mpc.Listener, size: int, procs: dict[int, Any]
            ) -> dict[int, mpc.Connection]:
    """Accept one connection per worker rank (each sends its rank first), checking that the
    spawned ones are still alive while waiting."""
    conns: dict[int, mpc.Connection] = {}
    errors: list[BaseException] = []

    def accept_all() -> None:
        try:
            while len(conns) < size - 1:
                conn = listener.accept()
                conns[conn.recv()] = conn
        except BaseException as e:  # reported by the waiting thread
            errors.append(e)

    thread = threading.Thread(target=accept_all, name="detlora-tp-accept", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(_POLL_S)
        for rank, proc in procs.items():
            if rank not in conns and proc.exitcode is not None:
                if proc.exitcode == MAIN_REIMPORT_EXIT:
                    raise WorkerDied(rank, MAIN_GUARD_HELP)
                raise WorkerDied(rank, f"exited with code {proc.exitcode} before connecting")
    if errors:
        raise errors[0]
    return conns


# ----------------------------------------------------------------------------- worker side


def refuse_in_spawn_bootstrap() -> None:
    """Exit with ``MAIN_REIMPORT_EXIT`` when this process is a spawned child still re-running
    its parent's main module (multiprocessing marks that phase ``_inheriting``): a script
    without the ``__main__`` guard builds its engine there, in every worker, and a worker
    must not start workers of its own. The driver names the fix."""
    if getattr(mp.current_process(), "_inheriting", False):
        sys.stderr.write("detlora: a tensor-parallel worker stopped: the script builds an "
                         "engine at module level, without if __name__ == \"__main__\":\n")
        raise SystemExit(MAIN_REIMPORT_EXIT)


class DriverLink:
    """A worker's side of the control link."""

    def __init__(self, conn: mpc.Connection) -> None:
        self._conn = conn

    def recv(self) -> Any:
        """The next command; ("shutdown",) when the driver has gone."""
        try:
            return pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            return ("shutdown",)

    def reply(self, value: Any) -> None:
        self._conn.send_bytes(pickle.dumps(("ok", value), protocol=pickle.HIGHEST_PROTOCOL))

    def report_error(self, text: str) -> None:
        with contextlib.suppress(OSError):  # the driver already gone
            self._conn.send_bytes(pickle.dumps(("error", text)))


def connect_driver(rdv: Rendezvous) -> DriverLink:
    conn = mpc.Client(rdv.control, authkey=rdv.authkey)
    conn.send(rdv.rank)
    return DriverLink(conn)


def _worker_entry(target: Callable[[Rendezvous, Any], None], rdv: Rendezvous, payload: Any,
                  parent_pid: int) -> None:
    """A spawned worker: exit when the driver's process is gone, whatever it is doing."""
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    target(rdv, payload)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def run_worker(rdv: Rendezvous, serve: Callable[[DriverLink], None]) -> None:
    """Connect to the driver and run ``serve(link)``; a failure is reported to the driver
    (its traceback) before the process exits with code 1."""
    link = connect_driver(rdv)
    try:
        serve(link)
    except BaseException:
        link.report_error(traceback.format_exc())
        raise


# ----------------------------------------------------------------------------- torchrun


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process was started by torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    try:
        return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                int(os.environ["LOCAL_RANK"]))
    except (KeyError, ValueError):
        return None


def _single_node() -> bool:
    return os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")


def _torchrun_store(rank: int, size: int) -> dist.TCPStore:
    """The store torchrun set up at MASTER_ADDR:MASTER_PORT (its agent's, or rank 0's)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(host, port, size, rank == 0 and not agent, timeout=_STORE_TIMEOUT)


def torchrun_rendezvous(key: str) -> tuple[Rendezvous, Any]:
    """Ranks 1..N-1 of a torchrun launch: the listener and payload rank 0 published under
    ``key`` (waits for it)."""
    env = torchrun_env()
    assert env is not None
    rank, size, _ = env
    store = _torchrun_store(rank, size)
    address, authkey, payload = pickle.loads(store.get(f"detlora/{key}"))
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return Rendezvous(rank, size, host, port, address, authkey, store_is_torchrun=True), payload
