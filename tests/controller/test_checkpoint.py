"""Consensus checkpoints: the sink's window tracking, the trio writer (latest wins,
flush on leaving), the atomic writer and the reader over the safetensors library,
loading, pruning, restoring a torch module, and a real cluster whose controller
runs an outer optimizer and a checkpointer.

Expected values are computed independently in each test; files are checked with
the safetensors library itself.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch
import trio

import flodl_trio
import flodl_trio.wire.checkpoint
from flodl_trio import (
    DTYPE_BF16,
    DTYPE_F32,
    RoundFrame,
    RoundKind,
    SchemaError,
    TensorPayload,
    average_window,
    connect_reduce_client,
)
from flodl_trio.controller import checkpointer as checkpointer_module
from flodl_trio.controller.checkpointer import ConsensusCheckpointer
from flodl_trio.errors import ConfigError
from flodl_trio.fold.outer import DiLoCoNesterov, SlowMo
from flodl_trio.testing import open_local_cluster
from flodl_trio.train.checkpoint import restore_module
from flodl_trio.wire.bf16 import bf16_to_f32, f32_to_bf16
from flodl_trio.wire.checkpoint import (
    FORMAT,
    Checkpoint,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    write_safetensors_atomic,
)

PARAM_SHAPES = [(2, 3), (2,)]
BUFFER_SHAPES = [(2,)]
WRITE_DEADLINE_S = 10.0


def model_frame(values: list[np.ndarray], weight: float, dtype: int = DTYPE_F32) -> RoundFrame:
    payloads = []
    for v in values:
        flat = np.asarray(v, dtype=np.float32).reshape(-1)
        payloads.append(TensorPayload(dtype, np.shape(v), flat if dtype == DTYPE_F32 else f32_to_bf16(flat)))
    return RoundFrame(payloads, RoundKind.MODEL, weight)


def control_frame(world: int = 4) -> RoundFrame:
    return RoundFrame([TensorPayload(DTYPE_F32, (world,), np.arange(world, dtype=np.float32))], RoundKind.CONTROL, 0.0)


def random_window(rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    params = [rng.standard_normal(s).astype(np.float32) for s in PARAM_SHAPES]
    buffers = [rng.standard_normal(s).astype(np.float32) for s in BUFFER_SHAPES]
    return params, buffers


def feed_window(sink, round_index: int, params, buffers, mass: float = 4.0, dtype: int = DTYPE_F32) -> int:
    """Drive the sink like the controller does for one average_window; returns the next round index."""
    sink(round_index, control_frame())
    sink(round_index + 1, model_frame(params, mass, dtype))
    if buffers is not None:
        sink(round_index + 2, model_frame(buffers, 2.0, dtype))
        return round_index + 3
    return round_index + 2


async def written(sink: ConsensusCheckpointer) -> None:
    """Wait until the sink's writer has written everything submitted (a writer that falls behind skips windows)."""
    with trio.fail_after(WRITE_DEADLINE_S):
        await sink.wait_idle()


def files_in(directory) -> list[str]:
    return sorted(os.listdir(directory))


def window_files(*windows: int) -> list[str]:
    return [f"window-{k:06d}.safetensors" for k in windows]


# ---------------------------------------------------------------------------
# the sink, fed directly
# ---------------------------------------------------------------------------


async def test_windows_written_with_values_and_metadata(tmp_path):
    rng = np.random.default_rng(1)
    windows = [random_window(rng) for _ in range(3)]
    async with ConsensusCheckpointer(tmp_path, keep=5) as sink:
        r = 1
        for params, buffers in windows:
            r = feed_window(sink, r, params, buffers, mass=6.5)
            await written(sink)
    assert files_in(tmp_path) == window_files(0, 1, 2)
    assert sink.written == [tmp_path / name for name in window_files(0, 1, 2)]
    for k, (params, buffers) in enumerate(windows):
        ckpt = load_checkpoint(tmp_path / f"window-{k:06d}.safetensors")
        assert ckpt.window == k
        assert ckpt.round_index == 2 + 3 * k
        assert ckpt.metadata["buffers_round"] == str(3 + 3 * k)
        assert ckpt.mass == 6.5 and ckpt.buffers_mass == 2.0
        assert ckpt.wire_dtype == "f32"
        assert ckpt.version == flodl_trio.__version__
        assert ckpt.outer == {} and ckpt.outer_config is None
        assert [a.dtype for a in ckpt.params + ckpt.buffers] == [np.float32] * 3
        for got, want in zip(ckpt.params + ckpt.buffers, params + buffers):
            np.testing.assert_array_equal(got, want)
        # the reference implementation, opened independently of load_checkpoint
        with safetensors.safe_open(str(ckpt.path), framework="np") as f:
            assert sorted(f.keys()) == ["buffers.0", "params.0", "params.1"]
            for name, want in [("params.0", params[0]), ("params.1", params[1]), ("buffers.0", buffers[0])]:
                got = f.get_tensor(name)
                assert got.dtype == np.float32 and got.shape == want.shape
                np.testing.assert_array_equal(got, want)
            assert f.metadata()["window"] == str(k)
            assert f.metadata()["format"] == "flodl_trio.checkpoint.v1"
        torch_official = safetensors.torch.load_file(str(ckpt.path))
        assert torch_official["params.0"].dtype == torch.float32


async def test_keep_prunes_and_latest_checkpoint(tmp_path):
    rng = np.random.default_rng(2)
    async with ConsensusCheckpointer(tmp_path, keep=2) as sink:
        r = 1
        for _ in range(5):
            params, buffers = random_window(rng)
            r = feed_window(sink, r, params, buffers)
            await written(sink)
    assert files_in(tmp_path) == window_files(3, 4)
    assert latest_checkpoint(tmp_path) == tmp_path / "window-000004.safetensors"
    assert [w for w, _ in list_checkpoints(tmp_path)] == [3, 4]
    assert latest_checkpoint(tmp_path / "nowhere") is None


async def test_every_n_windows(tmp_path):
    rng = np.random.default_rng(3)
    async with ConsensusCheckpointer(tmp_path, every=2, keep=10) as sink:
        r = 1
        for _ in range(5):
            r = feed_window(sink, r, *random_window(rng))
            await written(sink)
    assert files_in(tmp_path) == window_files(0, 2, 4)


async def test_window_without_buffers_round_completes_at_next_control_or_on_leaving(tmp_path):
    rng = np.random.default_rng(4)
    p0, _ = random_window(rng)
    p1, _ = random_window(rng)
    async with ConsensusCheckpointer(tmp_path) as sink:
        feed_window(sink, 1, p0, None)
        sink(3, control_frame())  # next window opens: window 0 is complete
        await written(sink)
        assert files_in(tmp_path) == window_files(0)
        sink(4, model_frame(p1, 1.0))
    # leaving the block wrote window 1 (no buffers round came)
    assert files_in(tmp_path) == window_files(0, 1)
    ckpt = load_checkpoint(tmp_path / "window-000001.safetensors")
    assert ckpt.buffers == [] and ckpt.metadata["buffers"] == "none"
    np.testing.assert_array_equal(ckpt.params[0], p1[0])


async def test_bf16_consensus_saved_as_f32(tmp_path):
    rng = np.random.default_rng(5)
    params, buffers = random_window(rng)
    async with ConsensusCheckpointer(tmp_path) as sink:
        feed_window(sink, 1, params, buffers, dtype=DTYPE_BF16)
    ckpt = load_checkpoint(latest_checkpoint(tmp_path))
    assert ckpt.wire_dtype == "bf16"
    for got, want in zip(ckpt.params + ckpt.buffers, params + buffers):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.reshape(-1), bf16_to_f32(f32_to_bf16(want.reshape(-1))))


async def test_zero_mass_window_and_unwindowed_rounds_are_not_saved(tmp_path):
    rng = np.random.default_rng(6)
    async with ConsensusCheckpointer(tmp_path) as sink:
        sink(1, model_frame(random_window(rng)[0], 1.0))  # no Control round before it: not a window
        r = feed_window(sink, 2, *random_window(rng), mass=0.0)  # window 0: zero mass
        params, buffers = random_window(rng)
        feed_window(sink, r, params, buffers)  # window 1
    assert files_in(tmp_path) == window_files(1)
    np.testing.assert_array_equal(load_checkpoint(tmp_path / "window-000001.safetensors").params[1], params[1])


async def test_zero_mass_buffers_round_marks_buffers_absent(tmp_path):
    rng = np.random.default_rng(7)
    params, buffers = random_window(rng)
    async with ConsensusCheckpointer(tmp_path) as sink:
        sink(1, control_frame())
        sink(2, model_frame(params, 3.0))
        sink(3, model_frame(buffers, 0.0))
    ckpt = load_checkpoint(latest_checkpoint(tmp_path))
    assert ckpt.buffers == [] and ckpt.metadata["buffers"] == "absent"
    module = torch.nn.Linear(3, 2)
    module.register_buffer("running", torch.zeros(2))
    with pytest.raises(SchemaError, match="zero mass; pass buffers=False"):
        restore_module(module, ckpt)
    restore_module(module, ckpt, buffers=False)
    np.testing.assert_array_equal(module.weight.detach().numpy(), params[0])


async def test_consensus_is_copied_before_the_writer_sees_it(tmp_path):
    rng = np.random.default_rng(8)
    params, buffers = random_window(rng)
    frame_params = [p.copy() for p in params]
    release = threading.Event()
    async with ConsensusCheckpointer(tmp_path) as sink:
        original_write = sink._write

        def slow_write(snap):  # runs in the writer's worker thread
            release.wait(WRITE_DEADLINE_S)
            return original_write(snap)

        sink._write = slow_write  # type: ignore[method-assign]
        sink(1, control_frame())
        sink(2, model_frame(frame_params, 1.0))
        sink(3, model_frame(buffers, 1.0))
        for p in frame_params:  # the controller reuses its buffers
            p[...] = 999.0
        release.set()
    ckpt = load_checkpoint(latest_checkpoint(tmp_path))
    for got, want in zip(ckpt.params, params):
        np.testing.assert_array_equal(got, want)


async def test_falling_behind_skips_to_the_latest_window(tmp_path, caplog):
    rng = np.random.default_rng(9)
    windows = [random_window(rng) for _ in range(5)]
    started = trio.Event()
    release = threading.Event()
    async with ConsensusCheckpointer(tmp_path, keep=10) as sink:
        original_write = sink._write

        def slow_write(snap):  # runs in the writer's worker thread
            trio.from_thread.run_sync(started.set)
            release.wait(WRITE_DEADLINE_S)
            return original_write(snap)

        sink._write = slow_write  # type: ignore[method-assign]
        try:
            with caplog.at_level(logging.WARNING, logger="flodl_trio.checkpoint"):
                r = feed_window(sink, 1, *windows[0])
                await started.wait()  # window 0 is being written, slowly
                for params, buffers in windows[1:]:
                    r = feed_window(sink, r, params, buffers)
        finally:
            release.set()
    assert sink.skipped_windows == [1, 2, 3]
    assert files_in(tmp_path) == window_files(0, 4)
    assert "writer is behind; window 1 skipped" in caplog.text
    np.testing.assert_array_equal(load_checkpoint(tmp_path / "window-000004.safetensors").params[0], windows[4][0][0])


async def test_latest_wins_while_the_file_write_is_blocked(tmp_path, monkeypatch, caplog):
    """Window 0 is stuck in the disk write; window 1 waits; window 2 replaces it.

    Only the write itself is blocked (the module's atomic writer), so this is the
    writer task and its worker thread as the controller runs them.
    """
    rng = np.random.default_rng(14)
    windows = [random_window(rng) for _ in range(3)]
    writing = trio.Event()
    release = threading.Event()
    real_write = checkpointer_module.write_safetensors_atomic

    def blocked_write(path, tensors, metadata):  # runs in the writer's worker thread
        trio.from_thread.run_sync(writing.set)
        release.wait(WRITE_DEADLINE_S)
        real_write(path, tensors, metadata)

    monkeypatch.setattr(checkpointer_module, "write_safetensors_atomic", blocked_write)
    with caplog.at_level(logging.WARNING, logger="flodl_trio.checkpoint"):
        async with ConsensusCheckpointer(tmp_path, keep=10) as sink:
            try:
                r = feed_window(sink, 1, *windows[0])
                await writing.wait()  # the writer holds window 0
                r = feed_window(sink, r, *windows[1])
                assert sink.skipped_windows == []  # one pending is allowed
                feed_window(sink, r, *windows[2])
                assert sink.skipped_windows == [1]  # the pending one was replaced, not queued
                with trio.move_on_after(0.1) as still_writing:
                    await sink.wait_idle()
                assert still_writing.cancelled_caught  # not idle while window 0 is stuck
            finally:
                release.set()
            await written(sink)
            assert sink.written == [tmp_path / name for name in window_files(0, 2)]
    assert sink.failures == 0
    assert files_in(tmp_path) == window_files(0, 2)
    assert "window 1 skipped, window 2 replaces it (latest wins)" in caplog.text
    for got, want in zip(load_checkpoint(tmp_path / "window-000002.safetensors").params, windows[2][0]):
        np.testing.assert_array_equal(got, want)


async def test_leaving_the_block_by_an_error_still_writes_the_last_window(tmp_path):
    rng = np.random.default_rng(15)
    params, _ = random_window(rng)
    with pytest.raises(RuntimeError, match="the controller failed"):  # itself, not an ExceptionGroup
        async with ConsensusCheckpointer(tmp_path) as sink:
            sink(1, control_frame())
            sink(2, model_frame(params, 1.0))  # window 0, still waiting for its buffers round
            raise RuntimeError("the controller failed")
    assert files_in(tmp_path) == window_files(0)
    np.testing.assert_array_equal(load_checkpoint(tmp_path / "window-000000.safetensors").params[0], params[0])


async def test_leaving_the_block_by_cancellation_still_writes_what_was_submitted(tmp_path):
    rng = np.random.default_rng(16)
    params, buffers = random_window(rng)
    with trio.CancelScope() as scope:
        async with ConsensusCheckpointer(tmp_path) as sink:
            feed_window(sink, 1, params, buffers)
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert sink.written == [tmp_path / "window-000000.safetensors"]
    np.testing.assert_array_equal(load_checkpoint(tmp_path / "window-000000.safetensors").buffers[0], buffers[0])


async def test_windows_before_the_block_wait_for_it_and_windows_after_it_are_dropped(tmp_path, caplog):
    rng = np.random.default_rng(17)
    sink = ConsensusCheckpointer(tmp_path)
    with caplog.at_level(logging.WARNING, logger="flodl_trio.checkpoint"):
        r = feed_window(sink, 1, *random_window(rng))
        assert "used before its async with block" in caplog.text
        assert files_in(tmp_path) == []
        async with sink:
            await written(sink)
            assert files_in(tmp_path) == window_files(0)
        feed_window(sink, r, *random_window(rng))
    assert "window 1 completed after the checkpointer closed; not saved" in caplog.text
    assert files_in(tmp_path) == window_files(0)
    assert sink.failures == 0


async def test_start_window_continues_after_existing_files_and_stale_temps_are_removed(tmp_path):
    rng = np.random.default_rng(10)
    async with ConsensusCheckpointer(tmp_path) as sink:
        feed_window(sink, 1, *random_window(rng))
        await written(sink)
        feed_window(sink, 4, *random_window(rng))
    (tmp_path / ".window-000002.safetensors.tmp-123-abcd").write_bytes(b"partial")
    resumed = ConsensusCheckpointer(tmp_path, keep=2)
    assert resumed.next_window == 2
    async with resumed:
        assert files_in(tmp_path) == window_files(0, 1)
        feed_window(resumed, 1, *random_window(rng))
    assert files_in(tmp_path) == window_files(1, 2)
    assert load_checkpoint(tmp_path / "window-000002.safetensors").round_index == 2


async def test_sink_never_raises(tmp_path, caplog):
    async with ConsensusCheckpointer(tmp_path) as sink:
        sink(1, control_frame())
        bad = RoundFrame([TensorPayload(DTYPE_F32, (4,), b"\x00" * 7)], RoundKind.MODEL, 1.0)
        with caplog.at_level(logging.ERROR, logger="flodl_trio.checkpoint"):
            sink(2, bad)
    assert sink.failures == 1 and isinstance(sink.last_error, SchemaError)
    assert "could not record round 2" in caplog.text
    assert files_in(tmp_path) == []


async def test_write_failure_is_counted_and_the_next_window_still_written(tmp_path, monkeypatch, caplog):
    rng = np.random.default_rng(18)
    real_write = checkpointer_module.write_safetensors_atomic
    calls = 0

    def first_write_fails(path, tensors, metadata):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError(28, "No space left on device")
        real_write(path, tensors, metadata)

    monkeypatch.setattr(checkpointer_module, "write_safetensors_atomic", first_write_fails)
    with caplog.at_level(logging.ERROR, logger="flodl_trio.checkpoint"):
        async with ConsensusCheckpointer(tmp_path) as sink:
            r = feed_window(sink, 1, *random_window(rng))
            await written(sink)
            feed_window(sink, r, *random_window(rng))
    assert sink.failures == 1 and isinstance(sink.last_error, OSError)
    assert "writing window 0 failed" in caplog.text
    assert files_in(tmp_path) == window_files(1)


async def test_config_validation(tmp_path):
    with pytest.raises(ConfigError):
        ConsensusCheckpointer(tmp_path, keep=0)
    with pytest.raises(ConfigError):
        ConsensusCheckpointer(tmp_path, every=0)
    sink = ConsensusCheckpointer(tmp_path)
    async with sink:
        with pytest.raises(ConfigError, match="is open"):
            async with sink:
                pass
    with pytest.raises(ConfigError, match="closed"):
        async with sink:
            pass


async def test_outer_state_saved_and_reloadable(tmp_path):
    rng = np.random.default_rng(11)
    outer = SlowMo(lr=0.9, momentum=0.6)
    async with ConsensusCheckpointer(tmp_path, keep=10, outer=outer) as sink:
        r = 1
        for _ in range(3):
            params, buffers = random_window(rng)
            sink(r, control_frame())
            transformed = outer(model_frame(params, 2.0))  # what the controller does before the sink
            sink(r + 1, transformed)
            sink(r + 2, model_frame(buffers, 2.0))
            r += 3
            await written(sink)
        expected_state = outer.state_dict()
    ckpt = load_checkpoint(tmp_path / "window-000002.safetensors")
    assert ckpt.outer_config == {"type": "SlowMo", "lr": 0.9, "momentum": 0.6}
    assert sorted(ckpt.outer) == sorted(expected_state)
    for key, value in expected_state.items():
        np.testing.assert_array_equal(ckpt.outer[key], value)
    np.testing.assert_array_equal(ckpt.outer["x_prev.0"], ckpt.params[0])
    resumed = SlowMo(lr=0.9, momentum=0.6)
    resumed.load_state_dict(ckpt.outer)
    nxt = model_frame(random_window(rng)[0], 2.0)
    a = outer(nxt)
    b = resumed(nxt)
    for ta, tb in zip(a.tensors, b.tensors):
        assert bytes(ta.data) == bytes(tb.data)


# ---------------------------------------------------------------------------
# module boundaries
# ---------------------------------------------------------------------------


def test_checkpoint_module_imports_neither_trio_nor_the_controller():
    """A rank reads checkpoints without the controller, trio or torch.

    ``flodl_trio/__init__.py`` imports the controller itself, so the subprocess
    stands in an empty package for it and imports the format and the rank's
    restore alone: whatever they (or anything they import) pull in shows up.
    """
    code = textwrap.dedent(
        """
        import importlib.util, sys, types
        spec = importlib.util.find_spec("flodl_trio")  # locates the package without running it
        package = types.ModuleType("flodl_trio")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["flodl_trio"] = package

        import flodl_trio.wire.checkpoint, flodl_trio.train.checkpoint
        heavy = sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in ("trio", "torch")}
                       | {m for m in sys.modules if m.startswith("flodl_trio.controller")})
        assert not heavy, f"importing the checkpoint reader imported {heavy}"
        """
    )
    root = Path(flodl_trio.__file__).resolve().parents[1]  # the checkout under test
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_the_package_exports_the_writer_and_the_readers_by_name():
    assert flodl_trio.ConsensusCheckpointer is ConsensusCheckpointer
    assert flodl_trio.load_checkpoint is load_checkpoint and flodl_trio.restore_module is restore_module
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        flodl_trio.Nope  # noqa: B018


# ---------------------------------------------------------------------------
# file format and atomicity
# ---------------------------------------------------------------------------


def test_failed_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "window-000000.safetensors"
    write_safetensors_atomic(target, [("params.0", np.ones(3, np.float32))], {"format": "x"})
    before = target.read_bytes()

    # the library refuses the array
    with pytest.raises(CheckpointError, match=r"window-000000\.safetensors: cannot write: .*complex128") as info:
        write_safetensors_atomic(target, [("params.0", np.zeros(3, np.complex128))], {"format": "x"})
    assert isinstance(info.value.__cause__, safetensors.SafetensorError)
    assert files_in(tmp_path) == ["window-000000.safetensors"]
    assert target.read_bytes() == before

    # the disk fails after the library wrote the temp file
    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(CheckpointError, match="No space") as info:
        write_safetensors_atomic(target, [("params.0", np.zeros(3, np.float32))], {"format": "x"})
    assert isinstance(info.value.__cause__, OSError)
    assert files_in(tmp_path) == ["window-000000.safetensors"]
    assert target.read_bytes() == before


def test_load_checkpoint_rejects_bad_files(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 40)
    with pytest.raises(CheckpointError, match=r"garbage\.safetensors: not a readable safetensors file") as info:
        load_checkpoint(garbage)
    assert isinstance(info.value.__cause__, safetensors.SafetensorError)

    good = tmp_path / "good.safetensors"
    write_safetensors_atomic(good, [("params.0", np.arange(64, dtype=np.float32))], {"format": FORMAT})
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-16])  # a partial copy
    with pytest.raises(CheckpointError, match=r"truncated\.safetensors: not a readable safetensors file"):
        load_checkpoint(truncated)

    foreign = tmp_path / "foreign.safetensors"
    safetensors.numpy.save_file({"weight": np.zeros(2, np.float32)}, str(foreign))
    with pytest.raises(CheckpointError, match=r"foreign\.safetensors: not a flodl_trio checkpoint \(format None"):
        load_checkpoint(foreign)

    gappy = tmp_path / "gappy.safetensors"
    write_safetensors_atomic(
        gappy, [("params.0", np.zeros(2, np.float32)), ("params.2", np.zeros(2, np.float32))], {"format": FORMAT},
    )
    with pytest.raises(CheckpointError, match=r"params\.N tensors are not numbered 0..n-1: \[0, 2\]"):
        load_checkpoint(gappy)

    short = tmp_path / "short.safetensors"
    write_safetensors_atomic(short, [("params.0", np.zeros(2, np.float32))], {"format": FORMAT, "params_count": "2"})
    with pytest.raises(CheckpointError, match="metadata declares 2 params tensors, the file holds 1"):
        load_checkpoint(short)

    extra = tmp_path / "extra.safetensors"
    write_safetensors_atomic(extra, [("params.0", np.zeros(2, np.float32)), ("loss", np.zeros(1))], {"format": FORMAT})
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['loss'\]"):
        load_checkpoint(extra)

    with pytest.raises(CheckpointError, match=r"missing\.safetensors: cannot read") as info:
        load_checkpoint(tmp_path / "missing.safetensors")
    assert isinstance(info.value.__cause__, OSError)


def test_written_files_are_what_the_library_reads(tmp_path):
    arrays = {
        "params.0": np.arange(6, dtype=np.float32).reshape(2, 3),
        "params.1": np.array(2.5, dtype=np.float32),  # 0-d stays 0-d
        "params.2": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],  # a strided view
        "buffers.0": np.zeros((0,), np.float32),
        "outer.windows": np.array([7], np.int64),
    }
    path = tmp_path / "x.safetensors"
    write_safetensors_atomic(path, list(arrays.items()), {"format": FORMAT, "k": "v"})
    assert files_in(tmp_path) == ["x.safetensors"]  # no temp file left
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # ranks on other accounts can read it
    with safetensors.safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"format": FORMAT, "k": "v"}
        assert sorted(f.keys()) == sorted(arrays)
        for name, value in arrays.items():
            got = f.get_tensor(name)
            assert got.dtype == value.dtype and got.shape == value.shape, name
            np.testing.assert_array_equal(got, value)
    with pytest.raises(CheckpointError, match="duplicate tensor name 'params.0'"):
        write_safetensors_atomic(path, [("params.0", arrays["params.0"])] * 2, {})
    # and load_checkpoint reads a file the library wrote on its own
    other = tmp_path / "lib.safetensors"
    safetensors.numpy.save_file({k: v.copy() for k, v in arrays.items()}, str(other), metadata={"format": FORMAT})
    ckpt = load_checkpoint(other)
    for i in range(3):
        np.testing.assert_array_equal(ckpt.params[i], arrays[f"params.{i}"])
    assert ckpt.params[1].shape == ()
    assert ckpt.outer["windows"].tolist() == [7]


# ---------------------------------------------------------------------------
# restore_module
# ---------------------------------------------------------------------------


def make_checkpoint(params, buffers) -> Checkpoint:
    return Checkpoint(list(params), list(buffers), {}, {"format": "flodl_trio.checkpoint.v1"})


def test_restore_module_params_and_float_buffers_in_registration_order():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    rng = np.random.default_rng(12)
    params = [rng.standard_normal(tuple(p.shape)).astype(np.float32) for p in module.parameters()]
    float_buffers = [b for b in module.buffers() if b.is_floating_point()]
    assert len(float_buffers) == 2  # running_mean, running_var; num_batches_tracked is int
    buffers = [rng.random(tuple(b.shape)).astype(np.float32) for b in float_buffers]
    restore_module(module, make_checkpoint(params, buffers))
    for p, want in zip(module.parameters(), params):
        np.testing.assert_array_equal(p.detach().numpy(), want)
    for b, want in zip(float_buffers, buffers):
        np.testing.assert_array_equal(b.numpy(), want)
    assert module[1].num_batches_tracked.item() == 0


def test_restore_module_mismatches_name_index_and_shapes():
    module = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(SchemaError, match="holds 1 parameters, the module has 2"):
        restore_module(module, make_checkpoint([np.zeros((2, 3), np.float32)], []))
    with pytest.raises(SchemaError, match=r"parameter 1 \(bias\): the checkpoint has shape \[3\], the module has \[2\]"):
        restore_module(module, make_checkpoint([np.zeros((2, 3), np.float32), np.zeros(3, np.float32)], []))
    with pytest.raises(SchemaError, match="holds 1 float buffers, the module has 0"):
        restore_module(module, make_checkpoint([np.zeros((2, 3), np.float32), np.zeros(2, np.float32)], [np.zeros(2, np.float32)]))
    for p, b in zip(module.parameters(), before):  # nothing was copied
        assert torch.equal(p.detach(), b)


def test_restore_module_zero_dim_parameter():
    module = torch.nn.Module()
    module.temperature = torch.nn.Parameter(torch.tensor(1.0))
    restore_module(module, make_checkpoint([np.array(0.25, np.float32)], []))
    assert module.temperature.shape == () and module.temperature.item() == 0.25


def test_restore_module_casts_to_the_module_dtype():
    module = torch.nn.Linear(3, 2).to(torch.bfloat16)
    params = [np.full((2, 3), 1.5, np.float32), np.full(2, -2.0, np.float32)]
    restore_module(module, make_checkpoint(params, []))
    assert module.weight.dtype == torch.bfloat16
    assert torch.equal(module.weight.float(), torch.full((2, 3), 1.5))


# ---------------------------------------------------------------------------
# end to end: a real cluster, DiLoCo at the controller, checkpoints on disk
# ---------------------------------------------------------------------------

WORLD = 4
HOSTS = [[0, 1], [2, 3]]
WINDOWS = 3
LR, MOMENTUM = 0.7, 0.9


def make_rank_model() -> torch.nn.Linear:
    torch.manual_seed(1234)  # every rank starts from the same init
    model = torch.nn.Linear(3, 2)
    model.register_buffer("running", torch.zeros(2))
    return model


def plan(seed: int = 42):
    rng = np.random.default_rng(seed)
    deltas = {(k, r): [rng.standard_normal(s).astype(np.float32) * 0.1 for s in PARAM_SHAPES]
              for k in range(WINDOWS) for r in range(WORLD)}
    stats = {(k, r): rng.standard_normal(2).astype(np.float32) for k in range(WINDOWS) for r in range(WORLD)}
    steps = {(k, r): int(rng.integers(1, 6)) for k in range(WINDOWS) for r in range(WORLD)}
    steps[1, 3] = 0  # a rank that did nothing in window 1: no mass, its params do not count
    return deltas, stats, steps


def reference(deltas, stats, steps, wire: int):
    """Independently: each window's weighted average, then DiLoCo via torch.optim.SGD."""
    init = make_rank_model()
    start = [p.detach().numpy().copy() for p in init.parameters()]
    master = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in start]
    opt = torch.optim.SGD(master, lr=LR, momentum=MOMENTUM, nesterov=True)
    received, received_buffers, plain = [], [], []
    for k in range(WINDOWS):
        mass = sum(steps[k, r] for r in range(WORLD))
        movers = [r for r in range(WORLD) if steps[k, r] > 0]
        avg = [sum(steps[k, r] * (start[i].astype(np.float64) + deltas[k, r][i]) for r in range(WORLD)) / mass
               for i in range(len(start))]
        buf = sum(stats[k, r].astype(np.float64) for r in movers) / len(movers)
        plain.append(avg)
        if k == 0:
            with torch.no_grad():
                for p, a in zip(master, avg):
                    p.copy_(torch.from_numpy(a.astype(np.float32)))
        else:
            opt.zero_grad()
            for p, a in zip(master, avg):
                p.grad = p.detach() - torch.from_numpy(a.astype(np.float32))
            opt.step()
        new = [p.detach().numpy().copy() for p in master]
        if wire == DTYPE_BF16:  # ranks receive the bf16 rounding of the f32 master
            new = [bf16_to_f32(f32_to_bf16(n.reshape(-1))).reshape(n.shape) for n in new]
        received.append(new)
        received_buffers.append([buf])
        start = new
    momentum = [opt.state[p]["momentum_buffer"].numpy().copy() for p in master]
    return received, received_buffers, plain, [p.detach().numpy().copy() for p in master], momentum


@pytest.mark.parametrize("wire", [DTYPE_F32, DTYPE_BF16], ids=["f32", "bf16"])
async def test_cluster_outer_optimizer_and_checkpoints(salt, tmp_path, wire):
    deltas, stats, steps = plan()
    got_params: dict[tuple[int, int], list[np.ndarray]] = {}
    got_buffers: dict[tuple[int, int], list[np.ndarray]] = {}
    final_models: dict[int, torch.nn.Module] = {}
    outer = DiLoCoNesterov(lr=LR, momentum=MOMENTUM)

    async def rank_main(cluster, rank: int) -> None:
        model = make_rank_model()
        async with connect_reduce_client(cluster.relay_address(rank), rank, WORLD, salt) as client:
            client.bf16_wire = wire == DTYPE_BF16
            for k in range(WINDOWS):
                await trio.sleep(0.05)  # "local training" (lets the writer keep up, usually)
                with torch.no_grad():
                    for p, d in zip(model.parameters(), deltas[k, rank]):
                        p.add_(torch.from_numpy(d))
                    model.running.copy_(torch.from_numpy(stats[k, rank]))
                result = await average_window(
                    client, list(model.parameters()), [model.running], steps[k, rank], rank=rank, world_size=WORLD
                )
                assert result.counts == [float(steps[k, r]) for r in range(WORLD)]
                with torch.no_grad():
                    for p, new in zip(model.parameters(), result.params):
                        p.copy_(new)
                    model.running.copy_(result.buffers[0])
                got_params[k, rank] = [t.numpy().copy() for t in result.params]
                got_buffers[k, rank] = [t.numpy().copy() for t in result.buffers]
        final_models[rank] = model

    async with ConsensusCheckpointer(tmp_path, keep=2, outer=outer) as sink:
        async with open_local_cluster(
            world_size=WORLD, hosts=HOSTS, salt=salt, outer_optimizer=outer, checkpoint=sink
        ) as cluster:
            async with trio.open_nursery() as nursery:
                for rank in range(WORLD):
                    nursery.start_soon(rank_main, cluster, rank)
            await cluster.controller.wait_finished()
            assert cluster.controller.stats.rounds == 3 * WINDOWS

    received, received_buffers, plain, master, momentum = reference(deltas, stats, steps, wire)
    tol = dict(rtol=1e-5, atol=1e-5) if wire == DTYPE_F32 else dict(rtol=2e-2, atol=2e-2)

    # what the ranks received: the DiLoCo-transformed consensus, identical on every rank
    for k in range(WINDOWS):
        for rank in range(WORLD):
            for i, (got, want) in enumerate(zip(got_params[k, rank], received[k])):
                np.testing.assert_allclose(got, want, **tol, err_msg=f"window {k} rank {rank} param {i}")
                np.testing.assert_array_equal(got, got_params[k, 0][i])
            np.testing.assert_allclose(got_buffers[k, rank][0], received_buffers[k][0], **tol)
        if k >= 1:  # ... and not the plain average
            assert not np.allclose(got_params[k, 0][0], plain[k][0], rtol=1e-3, atol=1e-3)
    assert outer.windows == WINDOWS

    # the checkpoints: keep=2 pruned the oldest, no temp files left. A writer that
    # fell behind on a loaded box may have skipped window 1 (latest wins); never the last.
    written = [w for w in range(WINDOWS) if w not in sink.skipped_windows]
    assert WINDOWS - 1 in written and sink.failures == 0
    assert files_in(tmp_path) == [f"window-{k:06d}.safetensors" for k in written[-2:]]
    assert latest_checkpoint(tmp_path) == tmp_path / "window-000002.safetensors"
    for k in written[-2:]:
        ckpt = load_checkpoint(tmp_path / f"window-{k:06d}.safetensors")
        assert ckpt.window == k
        assert ckpt.round_index == 3 * k + 2  # Control, params, buffers per window; 1-based
        assert ckpt.mass == sum(steps[k, r] for r in range(WORLD))
        assert ckpt.buffers_mass == sum(1 for r in range(WORLD) if steps[k, r] > 0)
        assert ckpt.wire_dtype == ("f32" if wire == DTYPE_F32 else "bf16")
        assert ckpt.outer_config == {"type": "DiLoCoNesterov", "lr": LR, "momentum": MOMENTUM}
        # exactly what the ranks adopted
        for got, want in zip(ckpt.params, got_params[k, 0]):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(ckpt.buffers[0], got_buffers[k, 0][0])
        # and what an independent computation says
        for got, want in zip(ckpt.params, received[k]):
            np.testing.assert_allclose(got, want, **tol)
    last = load_checkpoint(latest_checkpoint(tmp_path))
    assert last.outer["windows"].tolist() == [WINDOWS]
    for x_prev, params in zip((last.outer["x_prev.0"], last.outer["x_prev.1"]), last.params):
        # the master copy is f32; the ranks got it in the wire dtype
        want = x_prev if wire == DTYPE_F32 else bf16_to_f32(f32_to_bf16(x_prev.reshape(-1))).reshape(x_prev.shape)
        np.testing.assert_array_equal(params, want)
    for i in range(len(PARAM_SHAPES)):
        np.testing.assert_allclose(last.outer[f"x_prev.{i}"], master[i], **tol)
        np.testing.assert_allclose(last.outer[f"momentum.{i}"], momentum[i], **tol)

    # a rank resumes from the checkpoint
    fresh = torch.nn.Linear(3, 2)
    fresh.register_buffer("running", torch.full((2,), 7.0))
    restore_module(fresh, last)
    for a, b in zip(fresh.state_dict().values(), final_models[0].state_dict().values()):
        assert torch.equal(a, b)
    plain_linear = torch.nn.Linear(3, 2)
    restore_module(plain_linear, last, buffers=False)
    assert torch.equal(plain_linear.weight, final_models[0].weight)
    with pytest.raises(SchemaError, match="holds 1 float buffers, the module has 0"):
        restore_module(torch.nn.Linear(3, 2), last)

    # a resumed controller: outer state reloads and continues like the original
    resumed = DiLoCoNesterov(lr=LR, momentum=MOMENTUM)
    resumed.load_state_dict(last.outer)
    probe = model_frame([p + 0.01 for p in last.params], 5.0)
    for ta, tb in zip(outer(probe).tensors, resumed(probe).tensors):
        assert bytes(ta.data) == bytes(tb.data)


async def test_cluster_without_outer_checkpoints_the_plain_consensus(salt, tmp_path):
    rng = np.random.default_rng(13)
    values = {r: rng.standard_normal(5).astype(np.float32) for r in range(3)}
    received: dict[int, np.ndarray] = {}
    async with ConsensusCheckpointer(tmp_path) as sink:
        async with open_local_cluster(world_size=3, hosts=[[0], [1, 2]], salt=salt, checkpoint=sink) as cluster:
            async def rank_main(rank: int) -> None:
                async with connect_reduce_client(cluster.relay_address(rank), rank, 3, salt) as client:
                    result = await average_window(
                        client, [torch.from_numpy(values[rank].copy())], [], rank + 1, rank=rank, world_size=3
                    )
                    received[rank] = result.params[0].numpy().copy()

            async with trio.open_nursery() as nursery:
                for rank in range(3):
                    nursery.start_soon(rank_main, rank)
            await cluster.controller.wait_finished()
        # the only window had no buffers round: written when the checkpointer closes
    ckpt = load_checkpoint(latest_checkpoint(tmp_path))
    want = sum((r + 1) * values[r].astype(np.float64) for r in range(3)) / 6.0
    np.testing.assert_allclose(ckpt.params[0], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ckpt.params[0], received[0])
    assert ckpt.buffers == [] and ckpt.mass == 6.0 and ckpt.outer == {}
    assert json.loads(json.dumps(ckpt.metadata))["window"] == "0"


# ---------------------------------------------------------------------------
# fragmented windows: every file holds the whole model
# ---------------------------------------------------------------------------


async def test_fragmented_windows_are_saved_whole_once_every_fragment_has_one(tmp_path, caplog):
    """Three fragments in turn (each a run of every tensor's elements, the buffers with
    the last), every second window due: a file holds the model put back together from
    every fragment's newest pieces, in the shapes the Control round carries, and the
    newest buffers; windows before each fragment had one are not saved; a zero-mass
    window keeps its fragment's previous consensus."""
    from flodl_trio.wire.fragment import FragmentTag, piece_range

    model = [(2, 3), (4,), (1,), (5,)]
    sizes = [[b - a for a, b in (piece_range(int(np.prod(s)), 3, f) for s in model)] for f in range(3)]
    rng = np.random.default_rng(5)

    def tagged_control(fragment: int) -> RoundFrame:
        tag = FragmentTag(fragment, 3, tuple(model))
        return RoundFrame([*control_frame().tensors, *tag.payloads()], RoundKind.CONTROL, 0.0)

    def whole(pieces: dict[int, list[np.ndarray]]) -> list[np.ndarray]:
        return [np.concatenate([pieces[f][i] for f in range(3)]).reshape(s) for i, s in enumerate(model)]

    newest: dict[int, list[np.ndarray]] = {}
    newest_buffers = None
    expected: dict[int, tuple[list[np.ndarray], list[np.ndarray] | None, int]] = {}
    caplog.set_level(logging.INFO, logger="flodl_trio.checkpoint")
    async with ConsensusCheckpointer(tmp_path, every=2, keep=10) as sink:
        r = 1
        for window in range(9):
            fragment = window % 3
            params = [rng.standard_normal(n).astype(np.float32) for n in sizes[fragment]]
            mass = 0.0 if window == 7 else 4.0  # window 7 (fragment 1): nobody did any work
            sink(r, tagged_control(fragment))
            sink(r + 1, model_frame(params, mass))
            r += 2
            if mass > 0:
                newest[fragment] = params
            if fragment == 2:
                newest_buffers = [rng.standard_normal(3).astype(np.float32)]
                sink(r, model_frame(newest_buffers, 2.0))
                r += 1
            if window % 2 == 0 and len(newest) == 3 and mass > 0:
                expected[window] = (whole(newest), newest_buffers, fragment)
            await written(sink)
        # Window 9 (not due), then window 10, whose pieces do not cut the model as the
        # shapes say: it is not saved (and nothing else goes wrong).
        sink(r, tagged_control(0))
        sink(r + 1, model_frame([rng.standard_normal(n).astype(np.float32) for n in sizes[0]], 4.0))
        sink(r + 2, tagged_control(1))
        sink(r + 3, model_frame([np.zeros(3, np.float32)], 4.0))
        await written(sink)
    assert files_in(tmp_path) == window_files(*sorted(expected)) == window_files(2, 4, 6, 8)
    for window, (params, buffers, fragment) in expected.items():
        ckpt = load_checkpoint(tmp_path / f"window-{window:06d}.safetensors")
        assert ckpt.metadata["fragments"] == "3" and ckpt.metadata["fragment"] == str(fragment)
        assert [p.shape for p in ckpt.params] == model
        for got, want in zip(ckpt.params, params, strict=True):
            np.testing.assert_array_equal(got, want)
        for got, want in zip(ckpt.buffers, buffers, strict=True):
            np.testing.assert_array_equal(got, want)
    assert "window 10 not saved: the fragments' pieces [4, 1, 4] do not cut the model's 4 tensors" in caplog.text
    assert "window 0 not saved: fragments [1, 2] of 3 have had no window with mass yet" in caplog.text
