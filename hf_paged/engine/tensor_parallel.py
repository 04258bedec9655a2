"""Tensor parallelism for the engine: rank 0 decides, every rank computes the same step.

A model loaded with transformers' ``tp_plan="auto"`` holds a slice of the heads on each rank of a
``torch.distributed`` group, and its forwards all-reduce across ranks: every rank must run the
same forwards in the same order. So only rank 0 takes requests, schedules and samples; before
each forward it broadcasts the step's ``SchedulerOutput`` (plain Python data: the tokens to feed,
which include the tokens sampled at the previous step, their positions, slots, block tables and
block moves). The other ranks execute exactly that (:meth:`LLMEngine.run_worker`), so their
block books cannot differ from rank 0's, and no rank samples on its own. Each rank's pools hold
its own K/V heads only. Control messages go over a gloo group (CPU objects, whatever the
model's backend: gloo on CPU, NCCL on CUDA).

Messages (rank 0 to the others): ``("open", serial)`` as every rank builds an engine;
``("step", SchedulerOutput)``; ``("done", result)`` at the end of a ``generate`` call or a
snapshot save/load (a follower that made the same call returns it); ``("save", (path, export))``,
``("check", path)`` and ``("load", (placement, pool sizes))`` for prefix-cache snapshots, one file
per rank; ``("stop", None)`` from :meth:`LLMEngine.close` (ends ``run_worker``); ``("exit", None)``
as rank 0's interpreter exits.

Lifecycle: an engine that rank 0 drops without ``close()`` leaves the others in its
``run_worker``. When rank 0 builds the next engine, its ``"open"`` reaches them there: they leave
that loop as if closed and report it, so that rank 0 marks the old engine closed too, and their
next engine starts in step (:meth:`TensorParallelGroup.of`). Engines every rank still uses (code
that makes the same calls in every rank) stay open. When rank 0 exits without ``close()``, an
``atexit`` hook sends ``"exit"``, which releases a follower from ``run_worker`` as ``close()``
does; every rank tears its process group down before the interpreter does. Startup
(:func:`init_from_env`) waits a short time for the ranks to join, not the serving timeout.

Faults: when a step's broadcast or execution raises on any rank, the ranks no longer agree on
what ran, so that rank tears the process group down (:meth:`TensorParallelGroup.stop`). Under
gloo a peer's pending collective then fails at once ("Connection closed by peer"), so no rank
hangs: followers leave :meth:`LLMEngine.run_worker` with a ``RuntimeError`` naming the cause,
and rank 0 fails every request and refuses further work (``healthy`` is False). This is tested
under gloo only; whether a NCCL collective already running on the device fails as fast when a
peer tears its group down is not (NCCL may wait for the group's timeout).
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig, PreTrainedModel

from hf_paged import kinds
from hf_paged.model_info import state_kinds


def tp_size_of(model: PreTrainedModel) -> int:
    """Ranks the model's weights are split over (1 without tensor parallelism)."""
    return int(getattr(model, "tp_size", None) or 1)


def check_kv_heads(config: PretrainedConfig, size: int) -> None:
    """Each rank must hold whole K/V heads: refuse a head count that does not divide by ``size``,
    MLA models, whose single latent head cannot be split, and models with recurrent layers, whose
    state slots are not split across ranks."""
    config = config.get_text_config(decoder=True)
    if size > 1 and kinds.is_mla_config(config):
        raise ValueError(
            f"tensor parallelism is not supported for MLA models ({type(config).__name__}): their cache holds one "
            "latent head per token that every rank would need whole (hf_paged.kinds.mla); run them on one rank")
    if size > 1 and any(state_kinds(config)):
        raise ValueError(
            f"tensor parallelism is not supported for models with recurrent layers ({type(config).__name__}): "
            "LLMEngine does not split their state slots across ranks (hf_paged.kinds.recurrent); run them on one rank")
    if size <= 1:
        return
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % size or config.num_attention_heads % size:
        raise ValueError(
            f"tensor-parallel size {size} does not divide the model's heads (num_key_value_heads={heads}, "
            f"num_attention_heads={config.num_attention_heads}): each rank must hold whole K/V heads; "
            f"use a size that divides {heads}")


STARTUP_TIMEOUT_ENV = "HF_PAGED_TP_STARTUP_TIMEOUT_S"
STARTUP_TIMEOUT_S = 60.0  # the ranks of one launch start together; a rank missing after this has died
EXIT_WAIT_S = 30.0  # rank 0's exit: how long it waits for the others to acknowledge "exit"


class _Lifecycle:
    """This process's tensor-parallel engines (module state: the ranks' engines share one group)."""

    serials = itertools.count(1)  # rank 0 numbers the engines; "open" carries the number to the others
    open: weakref.WeakValueDictionary[int, TensorParallelGroup] = weakref.WeakValueDictionary()  # rank 0's
    announced: tuple[int, int] | None = None  # a follower: (new serial, left serial) taken by an old engine's loop
    control: tuple[Any, Any] | None = None  # (default group, gloo control group): one per default group
    hooked = False


@dataclass(eq=False)
class TensorParallelGroup:
    """This process's place among the ranks of a tensor-parallel model, and the control channel
    (one per engine; ``serial`` is the engine's number, the same in every rank)."""

    rank: int
    size: int
    group: Any  # a gloo process group for control messages
    serial: int = 0
    closed: bool = field(default=False)  # rank 0 has released the other ranks from this engine

    @classmethod
    def of(cls, model: PreTrainedModel) -> TensorParallelGroup | None:
        """The group of a new engine on ``model``; every rank calls it as it builds the engine, before
        any other collective of the engine (:meth:`_open`)."""
        size = tp_size_of(model)
        if size <= 1:
            return None
        if not dist.is_initialized():
            raise RuntimeError(f"{type(model).__name__} is split over {size} ranks but torch.distributed is not "
                               "initialized in this process")
        if dist.get_world_size() != size:
            raise ValueError(f"the model is split over {size} ranks but the process group has "
                             f"{dist.get_world_size()}: one tensor-parallel group per engine")
        tp = cls(dist.get_rank(), size, _control_group())
        tp._open()
        if not _Lifecycle.hooked:
            atexit.register(_at_exit)
            _Lifecycle.hooked = True
        return tp

    def _open(self) -> None:
        """Rank 0 announces the engine (``("open", serial)``); a follower receives it here, or took it
        already in the ``run_worker`` of an engine that rank 0 dropped unclosed (:meth:`left`). Every
        follower then says which engine it left, if any, and rank 0 marks that one closed: its
        followers are gone, so a later step of it would meet this engine's loop."""
        if self.is_driver:
            self.serial = next(_Lifecycle.serials)
            self.send("open", self.serial)
            for serial in {s for s in self.gather(None)[1:] if s is not None}:
                if (old := _Lifecycle.open.get(serial)) is not None:
                    old.closed = True
            _Lifecycle.open[self.serial] = self
            return
        left = None
        if _Lifecycle.announced is not None:
            (self.serial, left), _Lifecycle.announced = _Lifecycle.announced, None
        else:
            kind, payload = self.receive()
            if kind != "open":  # rank 0 is still running an engine this rank no longer follows
                self.stop()
                raise RuntimeError(
                    f"rank {self.rank} built an engine while rank 0 sent {kind!r} for an older one: the ranks are "
                    "out of step (every rank builds the same engines in the same order; a follower leaves "
                    "run_worker() only when rank 0 calls close() or builds its next engine); the group is stopped")
            self.serial = payload
        self.gather(left)

    def left(self, kind: str, payload: Any) -> None:
        """A follower in this engine's loop received rank 0's ``"open"`` (a new engine: kept for its
        constructor) or ``"exit"`` (acknowledged): rank 0 has left this engine without ``close()``."""
        self.closed = True
        if kind == "open":
            _Lifecycle.announced = (payload, self.serial)
        else:
            self.barrier()

    @property
    def is_driver(self) -> bool:
        """Rank 0: takes requests, schedules, samples."""
        return self.rank == 0

    def send(self, kind: str, payload: Any = None) -> None:
        dist.broadcast_object_list([(kind, payload)], src=0, group=self.group)

    def receive(self) -> tuple[str, Any]:
        if _Lifecycle.announced is not None:  # rank 0 waits in its next engine's constructor for this rank
            raise RuntimeError("rank 0 has built its next engine (this rank left the previous one's run_worker): "
                               "build the same engine here before anything else")
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def barrier(self) -> None:
        """Wait for every rank (before a rank exits: its last message must have arrived)."""
        dist.barrier(group=self.group)

    def stop(self) -> None:
        """Tear down this process's groups after a failure: a peer blocked in a collective with
        this rank (or entering one) then fails at once ("Connection closed by peer" under gloo)
        instead of waiting out the group's timeout. Process exit has the same effect."""
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - already broken: nothing more to release
                pass

    def agree_min(self, values: list[int]) -> list[int]:
        """The smallest of every rank's values, element by element (a KV budget all ranks can hold)."""
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return tensor.tolist()


def load_model(path: str, dtype: torch.dtype = torch.float32, **kwargs) -> PreTrainedModel:
    """Load a checkpoint split over the ranks of ``torch.distributed`` (transformers' ``tp_plan="auto"``), after
    checking that its heads divide by the world size. Call it in every rank (e.g. under
    ``torchrun``); it initializes the default process group from the environment if needed
    (gloo on CPU, NCCL on CUDA)."""
    from transformers import AutoConfig, AutoModelForCausalLM, DistributedConfig

    init_from_env()
    check_kv_heads(AutoConfig.from_pretrained(path), dist.get_world_size())
    plan = DistributedConfig(tp_size=dist.get_world_size(), tp_plan="auto")
    return AutoModelForCausalLM.from_pretrained(path, distributed_config=plan, dtype=dtype, **kwargs).eval()


def init_from_env(timeout_s: float = 7 * 24 * 3600, startup_timeout_s: float | None = None) -> None:
    """Join the process group that ``torchrun`` (or :func:`launch`) describes in the environment
    (gloo on CPU, NCCL on CUDA). Joining waits ``startup_timeout_s`` at most (default
    ``$HF_PAGED_TP_STARTUP_TIMEOUT_S`` or 60 s) for every rank: a rank that died before joining fails
    the others then, with an error that says so, instead of leaving them waiting out ``timeout_s``.
    Once every rank has joined, the group's timeout is ``timeout_s``, which is long: a serving rank
    waits for rank 0's next step as long as the server is idle."""
    if dist.is_initialized():
        return
    if startup_timeout_s is None:
        startup_timeout_s = float(os.environ.get(STARTUP_TIMEOUT_ENV, STARTUP_TIMEOUT_S))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    startup = min(startup_timeout_s, timeout_s)
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=startup))
    except (RuntimeError, TimeoutError) as err:  # DistStoreError, DistNetworkError, gloo's connect
        raise RuntimeError(
            f"rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')}: the tensor-parallel ranks did not all "
            f"join within {startup:g} s (a rank died or was not started; ${STARTUP_TIMEOUT_ENV} sets the wait): "
            f"{type(err).__name__}: {err}") from err
    serving = datetime.timedelta(seconds=timeout_s)
    dist.distributed_c10d._set_pg_timeout(serving)  # the collectives' wait from now on
    dist.distributed_c10d._get_default_store().set_timeout(serving)  # later groups' rendezvous (new_group)


def _control_group() -> Any:
    """The gloo group for control messages: the default group under gloo, else one gloo group made
    once (by the first engine, as every rank builds it), not per engine: a ``new_group`` on rank 0
    while a follower still waits in an old engine's loop would never pair."""
    world = dist.group.WORLD
    if dist.get_backend() == "gloo":
        return world
    if _Lifecycle.control is None or _Lifecycle.control[0] is not world:
        _Lifecycle.control = (world, dist.new_group(backend="gloo"))
    return _Lifecycle.control[1]


def _at_exit() -> None:
    """Rank 0's interpreter exits, maybe without ``close()``: release the followers (``"exit"`` ends
    ``run_worker`` as ``close()`` does; a follower that has left already answers with a closed
    connection), waiting ``EXIT_WAIT_S`` at most. Then every rank tears its groups down before the
    interpreter does (an abort at interpreter teardown was seen, at times, when it did it)."""
    if not dist.is_initialized():
        return
    world, control = dist.group.WORLD, _Lifecycle.control
    group = world if dist.get_backend() == "gloo" else control[1] if control and control[0] is world else None
    try:
        if dist.get_rank() == 0 and group is not None:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=EXIT_WAIT_S), group)
            dist.broadcast_object_list([("exit", None)], src=0, group=group)
            dist.barrier(group=group)
    except Exception:  # noqa: BLE001 - a rank already gone: nothing to release
        pass
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def launch(argv: list[str], nprocs: int, module: str = "hf_paged") -> int:
    """Run ``python -m module *argv`` as ``nprocs`` ranks on this machine (torchrun's environment:
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free loopback port). Returns the
    first non-zero exit status, or 0. SIGINT/SIGTERM go to rank 0, which shuts down and releases the
    others; when a rank fails the others are stopped, so none is left behind."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(nprocs):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
               "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=env))

    def stop_all(signum=signal.SIGTERM):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def to_driver(signum, _frame):
        if procs[0].poll() is None:
            procs[0].send_signal(signum)

    previous = {sig: signal.signal(sig, to_driver) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(proc.poll() is None for proc in procs):
            if any(proc.returncode not in (None, 0) for proc in procs):
                stop_all()
                break
            time.sleep(0.2)
        deadline = time.monotonic() + 30
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return next((proc.returncode for proc in procs if proc.returncode), 0)
