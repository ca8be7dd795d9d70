"""ConsensusCheckpointer.reopen_window: a controller started again on its resume record
tells its new checkpointer the run's window count, and the checkpointer numbers the
next window from it (docs/outer-and-checkpoints.md, "Numbering"), fed directly here."""

from __future__ import annotations

import numpy as np
import trio

from flodl_trio.controller.checkpointer import ConsensusCheckpointer
from flodl_trio.wire.checkpoint import list_checkpoints
from tests.controller.test_checkpoint import feed_window, model_frame, random_window, written


async def _windows(directory, count: int, every: int, **options) -> ConsensusCheckpointer:
    rng = np.random.default_rng(3)
    with trio.fail_after(10):
        async with ConsensusCheckpointer(directory, every=every, keep=100, **options) as sink:
            r = 1
            for _ in range(count):
                r = feed_window(sink, r, *random_window(rng))
                await written(sink)  # (a writer behind keeps only the newest window)
    return sink


async def _reopened(directory, every: int, model_rounds: int, windows: int, **options) -> list[int]:
    """A new checkpointer reopened at the run's place, then two more windows: the files."""
    rng = np.random.default_rng(4)
    with trio.fail_after(10):
        async with ConsensusCheckpointer(directory, every=every, keep=100, **options) as sink:
            sink.reopen_window(model_rounds, None, windows=windows)
            r = 100
            if model_rounds == 0:  # the open window's params and buffers rounds are still to come
                params, buffers = random_window(rng)
                sink(r, model_frame(params, 4.0))
                sink(r + 1, model_frame(buffers, 4.0))
                await written(sink)
                r += 2
            for _ in range(2):
                r = feed_window(sink, r, *random_window(rng))
                await written(sink)
    return [w for w, _ in list_checkpoints(directory)]


async def test_the_next_window_is_numbered_from_the_runs_window_count(tmp_path):
    await _windows(tmp_path, 4, every=2)  # windows 0..3: files 0 and 2
    assert await _reopened(tmp_path, 2, model_rounds=2, windows=4) == [0, 2, 4]  # 4 and 5 after it: 4 is due


async def test_a_window_whose_params_round_is_still_to_come_keeps_its_number(tmp_path):
    await _windows(tmp_path, 4, every=2)
    # window 4 opened (its step counts in the record), no params round yet: it is window 4
    assert await _reopened(tmp_path, 2, model_rounds=0, windows=5) == [0, 2, 4, 6]


async def test_after_an_earlier_runs_newer_files_it_numbers_on_after_them(tmp_path):
    await _windows(tmp_path, 10, every=1)  # an earlier run's files 0..9; this run resumed after them
    assert await _reopened(tmp_path, 1, model_rounds=2, windows=3) == list(range(12))


async def test_a_start_window_given_is_left_as_given(tmp_path):
    await _windows(tmp_path, 4, every=2)
    assert await _reopened(tmp_path, 2, model_rounds=2, windows=4, start_window=10) == [0, 2, 10]
