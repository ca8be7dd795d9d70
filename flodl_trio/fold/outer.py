"""Outer optimizers: what the controller does with each window's params consensus
(with reduction shards, what each shard does with the lanes it reduces:
:class:`ShardLanesOuter`).

Local SGD / DiLoCo ranks train alone for a window, then average. The
controller can treat the averaged params not as the new params but as the
end point of an "outer gradient" step (SlowMo, DiLoCo). Each optimizer here is
an :class:`~flodl_trio.controller.OuterOptimizer`: a callable taking the params
consensus (the first Model round after a Control round) and returning the
frame every rank receives instead::

    opt = DiLoCoNesterov(lr=0.7, momentum=0.9)
    async with open_controller(host, port, world_size=8, salt=salt, outer_optimizer=opt):
        ...

The math runs in f32 numpy on the frame's tensors (bf16 payloads are widened,
stepped, and rounded back to bf16 as torch would); the returned frame keeps
the consensus's kind, weight (accepted mass) and per-tensor wire dtype. The
optimizer keeps f32 master state (``x_prev``, the point the ranks started the
window from, and the momentum buffer); on a bf16 wire the ranks receive
``bf16(x_new)`` while the master keeps ``x_new`` in f32, so the rounding error
is fed back into the next outer gradient rather than lost.

No torch here: the controller runs without it.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, FlodlError, SchemaError
from ..wire.bf16 import F32, U16, bf16_to_f32, encode_f32_as
from ..wire.constants import DTYPE_F32
from ..wire.fragment import FragmentTag
from ..wire.lanes import LaneLayout, lane_tag
from ..wire.round_frame import RoundFrame, RoundKind, TensorPayload, check_payload, schema_frame_len

F32Array = npt.NDArray[np.float32]

__all__ = [
    "SHARD_OUTER_KINDS", "DiLoCoNesterov", "PlainAverage", "ShardLanesOuter", "SlowMo", "consensus_as_f32",
    "lane_state_bytes", "lane_state_frame", "read_lane_state", "shard_outer_config", "state_frame",
]


def consensus_as_f32(frame: RoundFrame, *, copy: bool) -> list[F32Array]:
    """A frame's tensors as f32 arrays of their shapes (elided tensors: zeros).

    ``copy=False`` gives read-only zero-copy views of f32 payloads (bf16
    payloads are always widened into new arrays); ``copy=True`` always owns.
    """
    out: list[F32Array] = []
    for i, t in enumerate(frame.tensors):
        check_payload(t, i, "consensus")
        if t.elided:
            out.append(np.zeros(t.shape, dtype=F32))
        elif t.dtype == DTYPE_F32:
            view = np.frombuffer(t.data, dtype=F32).reshape(t.shape)
            out.append(view.copy() if copy else view)
        else:
            out.append(bf16_to_f32(np.frombuffer(t.data, dtype=U16)).reshape(t.shape))
    return out


def _check_hyper(name: str, value: float, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"{name} must be finite and {bound}, got {value!r}")
    return value


class PlainAverage:
    """The identity: the weighted average of the ranks' params is the new params."""

    def __call__(self, consensus: RoundFrame) -> RoundFrame:
        return consensus

    def step(self, consensus: RoundFrame, fragment: FragmentTag | None) -> RoundFrame:
        return consensus

    def step_lane(
        self, consensus: RoundFrame, layout: LaneLayout, lane: int, fragment: FragmentTag | None
    ) -> RoundFrame:
        return consensus

    def state_dict(self) -> dict[str, np.ndarray]:
        return {}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        if state:
            raise ConfigError(f"PlainAverage has no state; got keys {sorted(state)}")

    def config(self) -> dict[str, object]:
        return {"type": "PlainAverage"}

    def __repr__(self) -> str:
        return "PlainAverage()"


# Keys of one state: "x_prev.3"; of a fragment's state: "fragment.1.4.x_prev.3" (fragment 1 of 4).
_STATE_KEY = re.compile(r"^(?:fragment\.(\d+)\.(\d+)\.)?(x_prev|momentum)\.(\d+)$")
_WINDOWS_KEY = re.compile(r"^(?:fragment\.(\d+)\.(\d+)\.)?windows$")


@attrs.define(eq=False)
class _OuterState:
    """One fragment's (or the whole model's) f32 master params, momentum and window count.
    Built lane by lane (with lanes), ``unfilled`` holds the lanes whose elements have
    not had their first window yet: that window only initializes them."""

    x: list[F32Array]
    m: list[F32Array]
    windows: int = 1
    unfilled: set[tuple[int, int]] = attrs.field(factory=set)  # (lane, lane count)

    @classmethod
    def zeros(cls, layout: LaneLayout) -> _OuterState:
        x = [np.zeros(shape, dtype=F32) for _, shape in layout.schema]
        return cls(x, [np.zeros_like(a) for a in x], unfilled={(k, layout.count) for k in range(layout.count)})


def _state_prefix(fragment: FragmentTag | None) -> str:
    return "" if fragment is None else f"fragment.{fragment.index}.{fragment.count}."


def _where(fragment: FragmentTag | None) -> str:
    return "" if fragment is None else f" (fragment {fragment.key()})"


class _MomentumOuter:
    """Shared machinery: f32 master params ``x_prev``, a momentum buffer, schema checks.

    The state is kept per fragment (:class:`~flodl_trio.wire.fragment.FragmentTag`)
    when the ranks sync their model in fragments: each fragment is its own
    window schedule with its own tensors, so it gets its own ``x_prev`` and
    momentum. An unfragmented window uses the untagged state.
    """

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr = _check_hyper("lr", lr, positive=True)
        self.momentum = _check_hyper("momentum", momentum, positive=False)
        self._states: dict[FragmentTag | None, _OuterState] = {}
        self._uncounted: dict[FragmentTag | None, int] = {}  # windows the shards stepped, no state here yet
        # The tensor shapes of the rounds the shards stepped with no state here (check_sharded_schema).
        self._sharded_shapes: dict[FragmentTag | None, list[tuple[int, ...]]] = {}

    @property
    def windows(self) -> int:
        """Windows seen with accepted mass > 0, over every fragment (a state's first one only
        initializes), the windows the shards stepped included (:meth:`count_sharded_window`:
        counted here whether or not a copy of their state came)."""
        return sum(state.windows for state in self._states.values()) + sum(self._uncounted.values())

    @property
    def holds_state(self) -> bool:
        """Whether this optimizer holds outer state (it stepped, or a checkpoint's state was
        loaded): with shards, each lane's part of it is seeded to the shard that steps it
        (:meth:`seed_state`)."""
        return bool(self._states)

    @property
    def fragments(self) -> list[FragmentTag | None]:
        """The fragments that have state (None: the unfragmented model)."""
        return sorted(self._states, key=lambda tag: (-1, -1) if tag is None else (tag.count, tag.index))

    # -- the step ------------------------------------------------------------

    def __call__(self, consensus: RoundFrame) -> RoundFrame:
        return self.step(consensus, None)

    def step(self, consensus: RoundFrame, fragment: FragmentTag | None) -> RoundFrame:
        """The outer step of ``fragment``'s params consensus (None: the whole model's)."""
        if not consensus.weight > 0:
            return consensus  # nobody realized work: nothing to step on, state unchanged
        state = self._states.get(fragment)
        if state is None:
            start = consensus_as_f32(consensus, copy=True)
            self._states[fragment] = _OuterState(
                start, [np.zeros_like(a) for a in start], self._uncounted.pop(fragment, 0) + 1)
            return consensus
        self._check_schema(consensus, state, fragment)  # before any state changes
        values = consensus_as_f32(consensus, copy=False)
        out: list[TensorPayload] = []
        with np.errstate(over="ignore", invalid="ignore"):
            for t, x, m, c in zip(consensus.tensors, state.x, state.m, values):
                # flat views: in-place updates reach the state, and 0-d tensors stay arrays
                new = self._step(x.reshape(-1), m.reshape(-1), c.reshape(-1))
                out.append(TensorPayload(t.dtype, t.shape, encode_f32_as(new.reshape(-1), t.dtype)))
        state.windows += 1
        return RoundFrame(out, consensus.kind, consensus.weight)

    def adopt_lane(
        self, layout: LaneLayout, lane: int, fragment: FragmentTag | None,
        state: tuple[Sequence[F32Array], Sequence[F32Array]],
    ) -> None:
        """Take lane ``lane``'s state as the shard that reduces it stepped it (its copy for
        a checkpoint), so :meth:`state_dict` holds what stepping every lane here would."""
        whole = self._state_for(layout, fragment, counted=True)
        whole.unfilled.discard((lane, layout.count))
        for p, x, m in zip(layout.lanes[lane], *state):
            whole.x[p.tensor].reshape(-1)[p.start:p.stop] = x
            whole.m[p.tensor].reshape(-1)[p.start:p.stop] = m

    def seed_state(
        self, layout: LaneLayout, lane: int, fragment: FragmentTag | None
    ) -> tuple[list[F32Array], list[F32Array]] | None:
        """Lane ``lane``'s part of ``fragment``'s state (views: flat f32 ``x_prev`` and
        momentum per piece), for the shard that steps the lane to start from - the state
        a resumed optimizer holds reaches the shards (docs/wire.md, "Seeding the shards'
        outer state"). None: no state here, or some lane's elements not yet filled."""
        state = self._states.get(fragment)
        if state is None or state.unfilled:
            return None
        self._check_shapes(layout.schema, [x.shape for x in state.x], fragment)
        pieces = layout.lanes[lane]
        return ([state.x[p.tensor].reshape(-1)[p.start:p.stop] for p in pieces],
                [state.m[p.tensor].reshape(-1)[p.start:p.stop] for p in pieces])

    def count_sharded_window(self, fragment: FragmentTag | None) -> None:
        """A window the shards stepped: the state's window count moves as stepping its
        lanes here would move it. No state is held for it here until a shard's copy
        brings one (:meth:`adopt_lane`): the count waits for it meanwhile."""
        state = self._states.get(fragment)
        if state is None:
            self._uncounted[fragment] = self._uncounted.get(fragment, 0) + 1
        else:
            state.windows += 1

    def _state_for(self, layout: LaneLayout, fragment: FragmentTag | None, *, counted: bool = False) -> _OuterState:
        """``fragment``'s state, made (zeros, every lane unfilled) if there is none; its window
        count takes over the windows counted without it, this one included (``counted``: the
        shards' window, counted already) or not (a window stepped here)."""
        state = self._states.get(fragment)
        if state is None:
            state = self._states[fragment] = _OuterState.zeros(layout)
            uncounted = self._uncounted.pop(fragment, 0)
            state.windows = max(uncounted, 1) if counted else uncounted + 1
        self._check_shapes(layout.schema, [x.shape for x in state.x], fragment)
        return state

    def check_sharded_schema(
        self, schema: Sequence[tuple[int, tuple[int, ...]]], fragment: FragmentTag | None
    ) -> None:
        """A params round of ``schema`` the shards are about to step (``fragment``'s state):
        SchemaError, before any shard steps it, when its tensors are not those of the
        state here, or (no state here) of the rounds the shards stepped before - the
        guard a round stepped here has (the shards hold the state, each its lanes)."""
        state = self._states.get(fragment)
        if state is not None:
            return self._check_shapes(schema, [x.shape for x in state.x], fragment)
        known = self._sharded_shapes.get(fragment)
        if known is None:
            self._sharded_shapes[fragment] = [tuple(shape) for _, shape in schema]
        else:
            self._check_shapes(schema, known, fragment)

    def step_lane(
        self, consensus: RoundFrame, layout: LaneLayout, lane: int, fragment: FragmentTag | None
    ) -> RoundFrame:
        """The outer step of lane ``lane`` of a params consensus cut into lanes
        (``layout`` says which elements of which tensors its pieces are). The step is
        elementwise, so a window's lanes give the ranks the same bytes :meth:`step`
        gives them for the whole frame, and the state is the same whole-tensor state
        (checkpoints do not depend on lanes)."""
        if not consensus.weight > 0:
            return consensus
        state = self._state_for(layout, fragment)
        pieces = layout.lanes[lane]
        values = consensus_as_f32(RoundFrame(consensus.tensors[:len(pieces)], consensus.kind), copy=False)
        if (lane, layout.count) in state.unfilled:  # these elements' first window only initializes them
            state.unfilled.discard((lane, layout.count))
            for p, c in zip(pieces, values):
                state.x[p.tensor].reshape(-1)[p.start:p.stop] = c
            return consensus
        xs = [state.x[p.tensor].reshape(-1)[p.start:p.stop] for p in pieces]  # views: the step updates the state
        ms = [state.m[p.tensor].reshape(-1)[p.start:p.stop] for p in pieces]
        stepped = self._step_pieces(consensus, xs, ms, values)
        if lane == layout.count - 1:
            state.windows += 1
        return stepped

    def _step_pieces(
        self, consensus: RoundFrame, xs: Sequence[F32Array], ms: Sequence[F32Array], values: Sequence[F32Array]
    ) -> RoundFrame:
        """A lane's consensus with its pieces stepped: each piece's ``x`` and ``m`` (flat)
        updated in place from its value; the tensors after the pieces (the tag) kept."""
        out: list[TensorPayload] = []
        with np.errstate(over="ignore", invalid="ignore"):
            for t, x, m, c in zip(consensus.tensors, xs, ms, values):
                out.append(TensorPayload(t.dtype, t.shape, encode_f32_as(self._step(x, m, c.reshape(-1)), t.dtype)))
        return RoundFrame([*out, *consensus.tensors[len(xs):]], consensus.kind, consensus.weight)

    def _step(self, x: F32Array, m: F32Array, c: F32Array) -> F32Array:
        """Update ``x`` and ``m`` in place; return a fresh array holding the new ``x``."""
        raise NotImplementedError

    def _check_schema(self, consensus: RoundFrame, state: _OuterState, fragment: FragmentTag | None) -> None:
        for i, t in enumerate(consensus.tensors):
            check_payload(t, i, f"{type(self).__name__}{_where(fragment)}: params consensus")
        self._check_shapes([(t.dtype, tuple(t.shape)) for t in consensus.tensors], [x.shape for x in state.x],
                           fragment)

    def _check_shapes(
        self, schema: Sequence[tuple[int, tuple[int, ...]]], held: Sequence[tuple[int, ...]],
        fragment: FragmentTag | None,
    ) -> None:
        name = type(self).__name__ + _where(fragment)
        if len(schema) != len(held):
            raise SchemaError(
                f"{name}: this window's params consensus has {len(schema)} tensors, "
                f"the outer state holds {len(held)} (the model's schema changed between windows)"
            )
        for i, ((_, shape), old) in enumerate(zip(schema, held)):
            if tuple(shape) != tuple(old):
                raise SchemaError(
                    f"{name}: tensor {i} has shape {list(shape)} this window, the outer state "
                    f"holds shape {list(old)} (the model's schema changed between windows)"
                )

    # -- checkpointing ---------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the outer state: ``x_prev.{i}``, ``momentum.{i}`` (f32) and ``windows``
        (int64[1], over every fragment); a fragment's state under ``fragment.{p}.{P}.``."""
        # (The windows the shards stepped with no state here count in the total alone.)
        state: dict[str, np.ndarray] = {"windows": np.array([self.windows], dtype=np.int64)}
        for fragment, s in self._states.items():
            prefix = _state_prefix(fragment)
            if fragment is not None:
                state[prefix + "windows"] = np.array([s.windows], dtype=np.int64)
            for i, (x, m) in enumerate(zip(s.x, s.m)):
                state[f"{prefix}x_prev.{i}"] = x.copy()
                state[f"{prefix}momentum.{i}"] = m.copy()
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state_dict` produced (copies the arrays); nothing
        changes unless all of it is valid."""
        name = type(self).__name__
        arrays: dict[FragmentTag | None, tuple[dict[int, np.ndarray], dict[int, np.ndarray]]] = {}
        windows: dict[FragmentTag | None, int] = {}
        total = None
        for key, value in state.items():
            counted = _WINDOWS_KEY.match(key)
            if counted is not None:
                count = _window_count(name, key, value)
                if counted.group(1) is None:
                    total = count
                else:
                    windows[_fragment_in_key(name, key, counted.group(1), counted.group(2))] = count
                continue
            match = _STATE_KEY.match(key)
            if match is None:
                raise ConfigError(f"{name}.load_state_dict: unexpected key {key!r}")
            fragment = None if match.group(1) is None else _fragment_in_key(name, key, match.group(1), match.group(2))
            x, m = arrays.setdefault(fragment, ({}, {}))
            (x if match.group(3) == "x_prev" else m)[int(match.group(4))] = np.asarray(value)
        if total is None:
            raise ConfigError(f"{name}.load_state_dict: missing key 'windows'")
        states = {fragment: _loaded_state(name + _where(fragment), x, m) for fragment, (x, m) in arrays.items()}
        for fragment, s in states.items():
            if fragment is not None:
                if fragment not in windows:
                    raise ConfigError(f"{name}.load_state_dict: missing key '{_state_prefix(fragment)}windows'")
                s.windows = windows[fragment]
        uncounted = {fragment: count for fragment, count in windows.items() if fragment not in states}
        rest = total - sum(windows.values())  # the unfragmented state's count, or windows counted without state
        if None in states:
            states[None].windows = rest
        elif rest > 0:
            uncounted[None] = rest
        self._states, self._uncounted = states, {k: v for k, v in uncounted.items() if v > 0}
        self._sharded_shapes = {}

    def config(self) -> dict[str, object]:
        return {"type": type(self).__name__, "lr": self.lr, "momentum": self.momentum}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(lr={self.lr}, momentum={self.momentum})"


def _window_count(name: str, key: str, value: np.ndarray) -> int:
    """A state's window count: one integer >= 0 (``int64[1]`` in a checkpoint)."""
    flat = np.asarray(value).reshape(-1)
    count = flat[0] if flat.size == 1 and np.isreal(flat[0]) else None
    if count is None or not float(count).is_integer() or count < 0:
        raise ConfigError(
            f"{name}.load_state_dict: {key!r} must hold one window count (an integer >= 0), "
            f"got {flat.size} values {flat[:4].tolist()}"
        )
    return int(count)


def _fragment_in_key(name: str, key: str, index: str, count: str) -> FragmentTag:
    try:
        return FragmentTag(int(index), int(count))
    except ConfigError as exc:
        raise ConfigError(f"{name}.load_state_dict: key {key!r}: {exc}") from None


def _loaded_state(name: str, x: dict[int, np.ndarray], m: dict[int, np.ndarray]) -> _OuterState:
    if sorted(x) != list(range(len(x))) or sorted(m) != sorted(x):
        raise ConfigError(
            f"{name}.load_state_dict: x_prev indices {sorted(x)} and momentum indices {sorted(m)} "
            "must both be 0..n-1"
        )
    for i in range(len(x)):
        if x[i].shape != m[i].shape:
            raise SchemaError(
                f"{name}.load_state_dict: tensor {i}: x_prev has shape {list(x[i].shape)}, "
                f"momentum has shape {list(m[i].shape)}"
            )
    return _OuterState(
        [np.array(x[i], dtype=F32, copy=True) for i in range(len(x))],
        [np.array(m[i], dtype=F32, copy=True) for i in range(len(m))],
    )


class SlowMo(_MomentumOuter):
    """Slow momentum (Wang et al., 2019) over each window's params consensus.

    With ``x`` the previous outer params and ``c`` the consensus::

        delta = x - c
        m     = momentum * m + delta
        x     = x - lr * m

    (the paper's ``u = beta*u + (x - c)/gamma; x -= alpha*gamma*u`` with
    ``alpha*gamma`` folded into ``lr``.) ``SlowMo(lr=1, momentum=0)`` is plain
    averaging in exact arithmetic; in f32, ``x - (x - c)`` may differ from ``c`` in its
    last bit. The first window only initializes ``x`` from its consensus.
    """

    def __init__(self, lr: float = 1.0, momentum: float = 0.5) -> None:
        super().__init__(lr, momentum)

    def _step(self, x: F32Array, m: F32Array, c: F32Array) -> F32Array:
        delta = np.subtract(x, c)
        m *= np.float32(self.momentum)
        m += delta
        step = np.multiply(m, np.float32(self.lr), out=delta)
        x -= step
        np.copyto(step, x)
        return step


class DiLoCoNesterov(_MomentumOuter):
    """DiLoCo's outer step (Douillard et al., 2023): Nesterov SGD on the outer gradient.

    With ``x`` the previous outer params and ``c`` the consensus::

        g = x - c
        m = momentum * m + g
        x = x - lr * (g + momentum * m)

    the update of ``torch.optim.SGD(lr=lr, momentum=momentum, nesterov=True)`` fed
    ``grad = x - c`` once per window: the same math, though not always the same f32
    bits (torch rounds its multiply-adds its own way; the tests compare within 1e-6).
    The first window only initializes ``x``.
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        super().__init__(lr, momentum)

    def _step(self, x: F32Array, m: F32Array, c: F32Array) -> F32Array:
        g = np.subtract(x, c)
        beta = np.float32(self.momentum)
        m *= beta
        m += g
        step = np.multiply(m, beta)
        step += g
        step *= np.float32(self.lr)
        x -= step
        np.copyto(step, x)
        return step



# -- the outer step where a shard reduces --------------------------------------------------

# The optimizers a controller can hand to its shards, by their number on the wire (ShardOuter).
SHARD_OUTER_KINDS: dict[int, type[_MomentumOuter]] = {1: SlowMo, 2: DiLoCoNesterov}


def shard_outer_config(optimizer: object) -> tuple[int, float, float] | None:
    """What a shard needs to step its lanes as ``optimizer`` steps them: (its number,
    lr, momentum); None when no shard can (a custom optimizer, whose math only the
    controller knows). PlainAverage is (0, 1, 0): the shards step nothing."""
    if type(optimizer) is PlainAverage:
        return (0, 1.0, 0.0)
    for kind, cls in SHARD_OUTER_KINDS.items():
        if type(optimizer) is cls:
            assert isinstance(optimizer, _MomentumOuter)
            return (kind, optimizer.lr, optimizer.momentum)
    return None


# One lane's state at a shard: (params fragment, lane count, lane, its pieces).
LaneKey = tuple[FragmentTag | None, int, int, tuple[object, ...]]


class ShardLanesOuter:
    """The outer step of the lanes one shard reduces, with their state (f32 ``x_prev`` and
    momentum, per piece) and nothing else: a shard holds 2 / S of the model's state.

    The bytes are the ones :meth:`_MomentumOuter.step_lane` gives the same consensus
    at a controller (the same elementwise math on the same values). A round may be
    decided again (a shard or a host was lost before its commit): each decision steps
    from the state the round started with, and that state moves on only when a later
    round is decided. A lane the shard has no state for (its first params window, or
    a lane it took over from a lost shard) only starts its state: that window's
    consensus goes out as the plain average, as an optimizer's first window does."""

    def __init__(self, optimizer: _MomentumOuter) -> None:
        self.optimizer = optimizer
        self._committed: dict[LaneKey, tuple[list[F32Array], list[F32Array]]] = {}
        self._pending: dict[LaneKey, tuple[list[F32Array], list[F32Array]]] = {}
        self._round = -1  # the round the pending state is of

    @property
    def lanes_held(self) -> int:
        return len(self._committed.keys() | self._pending.keys())

    def _advance(self, round_: int) -> None:
        """Round ``round_`` steps now: the state of a round before it is the one it starts from."""
        if round_ != self._round:
            if round_ > self._round:  # the controller decides a round only once the one before committed
                self._committed.update(self._pending)
            self._pending, self._round = {}, round_

    def start_state(
        self, round_: int, layout: LaneLayout, lane: int, fragment: FragmentTag | None
    ) -> tuple[list[F32Array], list[F32Array]] | None:
        """The state lane ``lane``'s step in round ``round_`` starts from (None: none here)."""
        self._advance(round_)
        return self._committed.get(lane_key(layout, lane, fragment))

    def adopt(
        self, round_: int, layout: LaneLayout, lane: int, fragment: FragmentTag | None,
        state: tuple[list[F32Array], list[F32Array]],
    ) -> None:
        """Lane ``lane`` starts round ``round_`` from ``state`` (a mirror's, or the one its
        owner said): a lost shard's lanes step on where they were."""
        self._advance(round_)
        key = lane_key(layout, lane, fragment)
        self._committed[key] = state
        self._pending.pop(key, None)

    def forget(self, layout: LaneLayout, lane: int, fragment: FragmentTag | None) -> None:
        """Lane ``lane``'s state is another shard's to keep now."""
        self.forget_key(lane_key(layout, lane, fragment))

    def forget_key(self, key: LaneKey) -> None:
        self._committed.pop(key, None)
        self._pending.pop(key, None)

    def held(self) -> dict[LaneKey, tuple[list[F32Array], list[F32Array]]]:
        """Every lane's state as its newest step left it (between rounds: the state the
        next round starts from)."""
        return {**self._committed, **self._pending}

    def step(
        self, round_: int, consensus: RoundFrame, layout: LaneLayout, lane: int, fragment: FragmentTag | None
    ) -> RoundFrame:
        """Lane ``lane`` of round ``round_``'s params consensus, stepped."""
        self._advance(round_)
        if not consensus.weight > 0:
            return consensus
        pieces = layout.lanes[lane]
        key = lane_key(layout, lane, fragment)
        values = consensus_as_f32(RoundFrame(consensus.tensors[:len(pieces)], consensus.kind), copy=False)
        state = self._committed.get(key)
        if state is None:  # these elements' first window here only starts their state
            self._pending[key] = ([v.reshape(-1).copy() for v in values], [np.zeros(v.size, dtype=F32) for v in values])
            return consensus
        xs, ms = [x.copy() for x in state[0]], [m.copy() for m in state[1]]  # the round's pending state
        self._pending[key] = (xs, ms)
        return self.optimizer._step_pieces(consensus, xs, ms, values)

    def lane_state(
        self, round_: int, layout: LaneLayout, lane: int, fragment: FragmentTag | None
    ) -> tuple[list[F32Array], list[F32Array]]:
        """Lane ``lane``'s state as round ``round_``'s step left it (flat f32 ``x_prev``
        and momentum per piece; never changed afterwards): what a checkpoint saves."""
        key = lane_key(layout, lane, fragment)
        if round_ != self._round or key not in self._pending:
            raise FlodlError(f"lane {lane} of round {round_} was not stepped here (the last round stepped: "
                             f"{self._round})")
        return self._pending[key]


def lane_key(layout: LaneLayout, lane: int, fragment: FragmentTag | None) -> LaneKey:
    """What names a lane's state: its fragment, the layout's lane count, the lane and its pieces."""
    return (fragment, layout.count, lane, tuple(layout.lanes[lane]))


def lane_state_frame(stepped: RoundFrame, pieces: int, state: tuple[list[F32Array], list[F32Array]]) -> RoundFrame:
    """A stepped lane's outer state as a frame a shard sends its controller (``Decide.copy``
    2): the ``pieces`` pieces' f32 ``x_prev``, then their momentum, then the lane's tag."""
    xs, ms = state
    arrays = [TensorPayload(DTYPE_F32, (a.size,), a) for a in (*xs, *ms)]
    return RoundFrame([*arrays, *stepped.tensors[pieces:]], stepped.kind, stepped.weight)


def state_frame(lane: int, lanes: int, state: tuple[Sequence[F32Array], Sequence[F32Array]]) -> RoundFrame:
    """Lane ``lane`` (of ``lanes``)'s outer state as a frame of its own (a handback, a
    seed): the pieces' f32 ``x_prev``, then their momentum, then the lane's tag."""
    xs, ms = state
    arrays = [TensorPayload(DTYPE_F32, (a.size,), a) for a in (*xs, *ms)]
    return RoundFrame([*arrays, lane_tag(lane, lanes)], RoundKind.MODEL)


def lane_state_bytes(layout: LaneLayout, lane: int) -> int:
    """The length of lane ``lane``'s state frame (what a controller may receive for it)."""
    pieces = [(DTYPE_F32, (p.numel,)) for p in layout.lanes[lane]]
    return schema_frame_len([*pieces, *pieces, *((t.dtype, tuple(t.shape)) for t in layout.trailer(lane))])


def read_lane_state(frame: RoundFrame, layout: LaneLayout, lane: int) -> tuple[list[F32Array], list[F32Array]]:
    """The ``x_prev`` and momentum pieces of lane ``lane``'s state frame (views), or a
    SchemaError saying which tensor is not what the layout says."""
    pieces = layout.lanes[lane]
    want = 2 * len(pieces) + len(layout.trailer(lane))
    if len(frame.tensors) != want:
        raise SchemaError(f"lane {lane}'s outer state has {len(frame.tensors)} tensors, its layout says {want}")
    arrays: list[F32Array] = []
    for i, (t, p) in enumerate(zip(frame.tensors, (*pieces, *pieces))):
        if t.dtype != DTYPE_F32 or tuple(t.shape) != (p.numel,):
            raise SchemaError(f"lane {lane}'s outer state: tensor {i} is dtype {t.dtype} shape {list(t.shape)}, "
                              f"its layout says f32 shape [{p.numel}]")
        check_payload(t, i, f"lane {lane}'s outer state")
        arrays.append(np.zeros(p.numel, dtype=F32) if t.elided else np.frombuffer(t.data, dtype=F32))
    return arrays[:len(pieces)], arrays[len(pieces):]
