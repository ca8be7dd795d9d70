"""A relay daemon's reduction shard, run as a child process of its own.

The shard a relay daemon serves by default (``--shard auto``) sums lanes of
every host's rounds: in a process of its own it has its own interpreter lock
and its own memory, so it neither slows the relay's event loop nor counts
against the relay's memory budget. It lives and dies with its relay: it
leaves once its standard input closes (``--with-parent``), which happens when
the relay daemon exits however it exits, SIGKILL included; a shard that a
controller uses serves on until that controller lets go, for at most the
handshake bound, since other hosts' rounds may still need it.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from ..errors import ConfigError
from ..transport.settings import (
    OUTAGE_ENV,
    SALT_FILE_ENV,
    SALT_HEX_ENV,
    TIMEOUT_SCALE_ENV,
    NetBounds,
    timeout_scale,
)
from ..wire.salt import SessionSalt

log = logging.getLogger("flodl_trio.relay")

# The least time a shard process is given to start listening: a process start (imports
# included) on a loaded host, which a short handshake bound must not cut off.
SHARD_START_S = 15.0

_LISTENING = re.compile(rb"^listening (\d+)$")
_SET_UP = re.compile(rb"^set up \d+$")


@attrs.define(eq=False)
class ChildShard:
    """The shard process: the port it listens on, and whether a controller set it up."""

    process: trio.Process
    port: int = 0
    used: bool = False
    started: trio.Event = attrs.field(factory=trio.Event)


def shard_command(host: str, port: int, *, ceiling: int, log_level: str, log_format: str) -> list[str]:
    return [
        sys.executable, "-m", "flodl_trio.shard", "--with-parent", "--host", host, "--port", str(port),
        "--frame-ceiling", str(ceiling), "--log-level", log_level, "--log-format", log_format,
    ]


async def _lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[bytes]:
    pending = b""
    async for chunk in stream:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line


async def _relay_its_log(stream: trio.abc.ReceiveStream) -> None:
    """The child's log lines go on to this daemon's stderr."""
    async for line in _lines(stream):
        sys.stderr.buffer.write(line + b"\n")
        sys.stderr.buffer.flush()


async def _follow_its_word(shard: ChildShard, stream: trio.abc.ReceiveStream) -> None:
    """What the child says on its stdout, whatever its log level: its port, and that a
    controller set it up."""
    async for line in _lines(stream):
        listening = _LISTENING.match(line)
        if listening is not None and not shard.started.is_set():
            shard.port = int(listening.group(1))
            shard.started.set()
        shard.used = shard.used or _SET_UP.match(line) is not None
    shard.started.set()  # its stdout closed, it exited: whoever waits for its port stops waiting (port stays 0)


# Variables the shard's parser would read that this relay daemon has already settled: its
# flags won over them (operations.md: a flag given wins, even over a bad variable), or
# they mean nothing to a shard, and what the shard needs goes on its command line. Left
# in its environment, a bad one the relay's own flag overrode would stop the child (exit
# 2) and with it the relay.
SETTLED_BY_THE_RELAY = (
    "FLODL_SHARD_HOST", "FLODL_SHARD_PORT", "FLODL_FRAME_CEILING", "FLODL_LOG_LEVEL", "FLODL_LOG_FORMAT",
    "FLODL_DETERMINISTIC", "FLODL_LANES", OUTAGE_ENV,
)


def child_env(salt: SessionSalt) -> dict[str, str]:
    """The child's environment: the salt as hex (never on its command line), the timeout
    scale this process already read, so a bad one is warned about once, here, and none of
    the settings this daemon already decided (``SETTLED_BY_THE_RELAY``)."""
    env = {**os.environ, SALT_HEX_ENV: salt.raw.hex()}
    env.pop(SALT_FILE_ENV, None)
    for name in SETTLED_BY_THE_RELAY:
        env.pop(name, None)
    if env.get(TIMEOUT_SCALE_ENV, "").strip():
        env[TIMEOUT_SCALE_ENV] = repr(timeout_scale(env))
    return env


def _not_listening(host: str, port: int, start_s: float, status: int | None) -> str:
    if status is None:
        return f"the shard process did not start listening on {host}:{port} within {start_s:g} s"
    return f"the shard process exited (status {status}) before listening on {host}:{port}; its log line above says why"


@asynccontextmanager
async def child_shard(
    host: str, port: int, *, salt: SessionSalt, ceiling: int, bounds: NetBounds, log_level: str = "INFO",
    log_format: str = "logfmt",
) -> AsyncIterator[ChildShard]:
    """Run ``python -m flodl_trio.shard`` on ``host:port`` (0: a free port) for the block;
    the handle's ``port`` is bound on entry. The salt goes in the child's environment,
    never its command line."""
    env = child_env(salt)
    cmd = shard_command(host, port, ceiling=ceiling, log_level=log_level, log_format=log_format)
    async with trio.open_nursery() as nursery:
        process = await trio.lowlevel.open_process(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )
        shard = ChildShard(process)
        assert process.stderr is not None and process.stdin is not None and process.stdout is not None
        nursery.start_soon(_relay_its_log, process.stderr)
        nursery.start_soon(_follow_its_word, shard, process.stdout)
        try:
            start_s = max(bounds.handshake, SHARD_START_S)
            with trio.move_on_after(start_s):
                await shard.started.wait()
            if not shard.port:
                with trio.move_on_after(1):  # it exited (its log said why), or is about to
                    await process.wait()
                raise ConfigError(_not_listening(host, port, start_s, process.poll()))
            yield shard
            if shard.used:  # other hosts' rounds may still need it: until its controller lets go
                with trio.move_on_after(bounds.handshake):
                    await process.wait()
        finally:
            with trio.CancelScope(shield=True):
                await process.stdin.aclose()  # it leaves once its standard input closes
                with trio.move_on_after(5):
                    await process.wait()
                if process.poll() is None:
                    process.kill()
                    await process.wait()
            nursery.cancel_scope.cancel()


# How many times a relay daemon starts its shard again after it exits on its own.
MAX_SHARD_RESTARTS = 3


@attrs.define(eq=False)
class ShardKeeper:
    """A relay daemon's shard process, kept running while the relay runs: one that exits
    on its own (a crash, the OOM killer) is started again on a free port and offered to
    the controller again (``offer``), which serves a lost shard with it (docs/wire.md, "A
    lost shard served again"), at most MAX_SHARD_RESTARTS times. ``stop()`` lets the
    current one end as :func:`child_shard` ends it."""

    host: str
    port: int
    salt: SessionSalt
    ceiling: int
    bounds: NetBounds
    log_level: str = "INFO"
    log_format: str = "logfmt"
    offer: Callable[[int], bool] | None = None  # the data relay's offer_shard, once it runs
    restarts: int = 0
    _stopping: bool = attrs.field(default=False, init=False)
    _waiting: trio.CancelScope = attrs.field(factory=trio.CancelScope, init=False)  # the wait for its exit

    def stop(self) -> None:
        self._stopping = True
        self._waiting.cancel()

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the shard (``task_status`` gets the first one's port) until ``stop()``."""
        while not self._stopping:
            try:
                async with child_shard(self.host, self.port, salt=self.salt, ceiling=self.ceiling,
                                       bounds=self.bounds, log_level=self.log_level,
                                       log_format=self.log_format) as shard:
                    if self.restarts == 0:
                        task_status.started(shard.port)
                    elif self.offer is None or not self.offer(shard.port):
                        log.warning("relay: its shard listens again on port %d, but no data channel runs to "
                                    "offer it", shard.port)
                    else:
                        log.info("relay: its shard listens again on port %d; offered to the controller", shard.port)
                    with self._waiting:
                        await shard.process.wait()
                    if self._stopping:
                        return
                    self._waiting = trio.CancelScope()
            except ConfigError as exc:
                if self.restarts == 0:
                    raise
                log.warning("relay: its shard could not be started again (%s); it serves none now", exc)
                return
            log.warning("relay: its shard process exited (status %s)%s", shard.process.returncode,
                        "; starting it again" if self.restarts < MAX_SHARD_RESTARTS else
                        f"; {MAX_SHARD_RESTARTS} restarts already: it serves none now")
            if self.restarts >= MAX_SHARD_RESTARTS:
                return
            self.restarts += 1


__all__ = ["MAX_SHARD_RESTARTS", "ChildShard", "ShardKeeper", "child_shard", "shard_command"]
