"""A blocking facade for trainers that are not written in trio.

``BlockingReduceClient`` runs a trio loop in a helper thread that owns the
rank's data connection (and, optionally, its control connection). Calls from
ordinary synchronous code are handed to that loop and block until the round
completes. A bonus for plain-Python trainers: heartbeats keep flowing from the
helper thread while the main thread computes, as long as the computation
releases the GIL (torch ops do).

    with BlockingReduceClient(("127.0.0.1", 1341), rank, world, salt,
                              control_address=("127.0.0.1", 1342),
                              model_signature=model_signature(model)) as client:
        for window in range(windows):
            train_inner_steps()
            params = client.all_reduce_tensors(list(model.parameters()))
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import attrs
import trio

from ..client import (
    Address,
    ClusterState,
    CoordinatorLost,
    ReduceClient,
    connect_control_client,
    connect_reduce_client,
)
from ..errors import ConfigError, FlodlError, RankDeadError
from ..wire.fragment import FragmentTag
from ..wire.quant import DeltaCodec
from ..wire.round_frame import RoundFrame, RoundKind
from ..wire.salt import SessionSalt
from .trainer import TrainerStats, WindowSchedule, WindowTrainer

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
STARTUP_TIMEOUT_S = 120.0


@attrs.define(eq=False)
class _Request:
    """One call handed to the trio thread; ``done`` fires with a result or an error."""

    call: Callable[[ReduceClient], Awaitable[Any]]
    done: trio.Event = attrs.field(factory=trio.Event)
    result: Any = None
    error: BaseException | None = None


_V = TypeVar("_V")


class _Through(Generic[_V]):
    """An attribute of the blocking client that is its trio client's (read, and set
    where ``settable``): one place for what would be a property pair each."""

    def __init__(self, name: str, *, settable: bool = True) -> None:
        self.name = name
        self.settable = settable

    def __get__(self, owner: BlockingReduceClient | None, cls: type | None = None) -> _V:
        if owner is None:
            return self  # type: ignore[return-value]  # the class attribute itself
        assert owner._client is not None
        return cast(_V, getattr(owner._client, self.name))

    def __set__(self, owner: BlockingReduceClient, value: _V) -> None:
        if not self.settable:
            raise AttributeError(f"{self.name} is read-only (the trio client's state)")
        assert owner._client is not None
        setattr(owner._client, self.name, value)


class BlockingReduceClient:
    """ReduceClient's API for synchronous code; trio runs in a helper thread."""

    def __init__(
        self,
        address: Address,
        rank: int,
        world_size: int,
        salt: SessionSalt | bytes,
        *,
        control_address: Address | None = None,
        model_signature: bytes | None = None,
        heartbeat_timeout: float | None = None,
        **connect_options: Any,
    ) -> None:
        if control_address is not None and model_signature is None:
            raise ConfigError("a control connection needs model_signature (see tensors.model_signature)")
        self.rank = rank
        self.world_size = world_size
        self._nursery: trio.Nursery | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._client: ReduceClient | None = None
        self._finished = False
        self._cluster_error_seen = False  # a call raised the cluster's verdict on this rank
        self._args = (address, rank, world_size, salt, control_address, model_signature, heartbeat_timeout, connect_options)
        self._thread = threading.Thread(target=self._thread_main, name=f"flodl-rank{rank}", daemon=True)
        self._thread.start()
        if not self._ready.wait(STARTUP_TIMEOUT_S):
            raise FlodlError(f"rank {rank}: the client thread did not connect within {STARTUP_TIMEOUT_S:.0f} s")
        if self._failure is not None:
            self._thread.join()
            raise self._failure

    # -- the trio thread -----------------------------------------------------

    def _thread_main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # reported to the caller, never lost in the thread
            self._failure = self._failure or _unwrap(exc)
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        address, rank, world, salt, control, signature, heartbeat, options = self._args
        self._stop = trio.Event()
        send, self._requests = trio.open_memory_channel[_Request](1)
        self._request_send = send
        pending: list[_Request] = []
        try:
            async with AsyncExitStack() as stack:
                if control is not None:
                    if signature is None:  # (refused in __init__ already)
                        raise ConfigError("a control connection needs model_signature (see tensors.model_signature)")
                    await stack.enter_async_context(
                        connect_control_client(control, rank, world, salt, signature, heartbeat_timeout=heartbeat)
                    )
                self._client = await stack.enter_async_context(connect_reduce_client(address, rank, world, salt, **options))
                self._token = trio.lowlevel.current_trio_token()
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery  # where a window trainer's background rounds run
                    self._ready.set()
                    nursery.start_soon(self._worker, pending)
                    await self._stop.wait()
                    nursery.cancel_scope.cancel()
                if not self._finished:
                    await self._client.aclose()  # leaving without saying "finished" (see close)
        except BaseException as exc:
            self._failure = _unwrap(exc)
            raise
        finally:
            for request in pending:
                request.error = self._failure or FlodlError(f"rank {rank}: client closed")
                request.done.set()

    async def _worker(self, pending: list[_Request]) -> None:
        assert self._client is not None
        async for request in self._requests:
            pending.append(request)
            try:
                request.result = await request.call(self._client)
            except Exception as exc:
                # The caller's error, whatever its type (a wrong argument, say): the
                # trio client decides for itself whether it is still usable after it.
                request.error = exc
            pending.remove(request)
            request.done.set()

    async def _submit(self, call: Callable[[ReduceClient], Awaitable[T]]) -> T:
        request = _Request(call)
        await self._request_send.send(request)
        await request.done.wait()
        if request.error is not None:
            if isinstance(request.error, (RankDeadError, CoordinatorLost)):
                self._cluster_error_seen = True
            raise request.error
        return cast("T", request.result)  # the result of the call submitted with that type

    # -- the caller's thread -------------------------------------------------

    def _run(self, call: Callable[[ReduceClient], Awaitable[T]]) -> T:
        if self._failure is not None:
            raise self._failure
        if self._token is None:
            raise FlodlError(f"rank {self.rank}: client is closed")
        try:
            return trio.from_thread.run(self._submit, call, trio_token=self._token)
        except trio.RunFinishedError:
            raise self._failure or FlodlError(f"rank {self.rank}: client is closed") from None

    # The trio client's settings and state, read (and the settings set) through: see ReduceClient.
    bf16_wire: _Through[bool] = _Through("bf16_wire")
    pinned_decode: _Through[bool] = _Through("pinned_decode")
    delta_codec: _Through[DeltaCodec | None] = _Through("delta_codec")
    delta_error_feedback: _Through[bool] = _Through("delta_error_feedback")
    catching_up: _Through[set[int]] = _Through("catching_up", settable=False)
    local_leg: _Through[bool] = _Through("local_leg", settable=False)

    def arm_pinned_decode(self, slot: int) -> None:
        assert self._client is not None
        self._client.arm_pinned_decode(slot)

    def all_reduce(self, frame: RoundFrame) -> RoundFrame:
        return self._run(lambda c: c.all_reduce(frame))

    def all_reduce_tensors(self, tensors: Sequence[torch.Tensor], *, in_place: bool = False) -> list[torch.Tensor]:
        return self._run(lambda c: c.all_reduce_tensors(tensors, in_place=in_place))

    def all_reduce_scaled(
        self, tensors: Sequence[torch.Tensor], scale: float, kind: RoundKind, weight: float, *, in_place: bool = False
    ) -> tuple[list[torch.Tensor], float]:
        return self._run(lambda c: c.all_reduce_scaled(tensors, scale, kind, weight, in_place=in_place))

    def all_reduce_weighted(
        self, tensors: Sequence[torch.Tensor], kind: RoundKind, weight: float, *, in_place: bool = False
    ) -> tuple[list[torch.Tensor], float]:
        return self._run(lambda c: c.all_reduce_weighted(tensors, kind, weight, in_place=in_place))

    def all_reduce_per_rank_f64(self, values: Sequence[float], *, fragment: FragmentTag | None = None) -> list[float]:
        return self._run(lambda c: c.all_reduce_per_rank_f64(values, fragment=fragment))

    def broadcast_from_root(self, tensors: Sequence[torch.Tensor], root: int) -> list[torch.Tensor]:
        return self._run(lambda c: c.broadcast_from_root(tensors, root))

    def join(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor] = ()) -> int:
        """Start from the cluster's consensus; see :meth:`ReduceClient.join`."""
        return self._run(lambda c: c.join(params, buffers))

    def fetch_state(self) -> ClusterState:
        return self._run(lambda c: c.fetch_state())

    @property
    def last_state(self) -> ClusterState | None:
        """What :meth:`join` loaded (see :attr:`ReduceClient.last_state`)."""
        return None if self._client is None else self._client.last_state

    def window_trainer(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor] = (),
        *,
        sync_every: int,
        overlap: int = 0,
        gamma: float = 1.0,
        outer: object | None = None,
        merge_after: int | None = None,
        fragments: int = 1,
        start_window: int = 0,
        merge_by: int | None = None,
    ) -> BlockingWindowTrainer:
        """The window loop for a plain-Python trainer (see :class:`~flodl_trio.train.trainer.WindowTrainer`):
        call ``step()`` after every inner step; with ``overlap=1`` a window's round
        runs in the helper thread while your next inner steps run in yours;
        ``fragments`` syncs the params in staggered fragments."""
        assert self._nursery is not None and self._client is not None
        trainer = WindowTrainer(
            self._client, params, buffers, rank=self.rank, world_size=self.world_size,
            schedule=WindowSchedule(sync_every, overlap, gamma, merge_after, fragments, merge_by), outer=outer,
            nursery=self._nursery,
            start_window=start_window,
        )
        return BlockingWindowTrainer(self, trainer)

    def finish(self) -> None:
        """Leave for good, saying so (see :meth:`ReduceClient.finish`), and stop the thread.
        An error of the leaving itself (a delta run's last digest check) is raised here."""
        seen = self._failure is not None or self._cluster_error_seen
        self._finished = True
        self.close()
        if self._failure is not None and not seen:  # (one the caller was told of already is not news)
            raise self._failure

    def close(self) -> None:
        """Leave the cluster and stop the helper thread. After :meth:`join` this reads
        as a crash (the rank may come back); :meth:`finish` says training is done."""
        if self._token is not None and self._thread.is_alive():
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(timeout=30)
        self._token = None

    def __enter__(self) -> BlockingReduceClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.finish() if exc_type is None else self.close()


class BlockingWindowTrainer:
    """A :class:`~flodl_trio.train.trainer.WindowTrainer` driven from the caller's thread: the
    same implementation, its rounds on the client's helper thread."""

    def __init__(self, client: BlockingReduceClient, trainer: WindowTrainer) -> None:
        self._client = client
        self.trainer = trainer

    @property
    def stats(self) -> TrainerStats:
        return self.trainer.stats

    def step(self) -> None:
        """One inner step is done (may merge a landed consensus, or end the window)."""
        self._client._run(lambda _c: self.trainer.after_step())

    def finish(self) -> None:
        """Wait for the round still in flight and merge it."""
        self._client._run(lambda _c: self.trainer.finish())


def _unwrap(exc: BaseException) -> BaseException:
    from ..transport.tasks import unwrap_group

    return unwrap_group(exc) if isinstance(exc, BaseExceptionGroup) else exc
