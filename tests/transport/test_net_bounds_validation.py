"""NetBounds refuses what docs/api.md says it refuses, at construction (a ConfigError
naming the field), so nothing fails later with a TypeError mid-dial."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flodl_trio import ConfigError, NetBounds, SessionSalt, connect_reduce_client

TIME_FIELDS = ["handshake", "channel_magic", "write_stall", "mid_frame_starvation", "connect_interval", "heartbeat_timeout"]


@pytest.mark.parametrize("field", TIME_FIELDS)
@pytest.mark.parametrize("value", [0, -1, math.inf, -math.inf, math.nan, True, False, "5", None])
def test_a_time_bound_that_is_not_a_finite_number_above_0_is_a_config_error(field, value):
    with pytest.raises(ConfigError, match=f"NetBounds.{field}"):
        NetBounds(**{field: value})


@pytest.mark.parametrize("field", TIME_FIELDS)
@pytest.mark.parametrize("value", [1, 0.25, np.float64(2.5), np.int64(3)])
def test_a_time_bound_takes_any_finite_positive_number(field, value):
    assert getattr(NetBounds(**{field: value}), field) == value


@pytest.mark.parametrize("value", [0, -3, 1.5, 2.0, math.nan, math.inf, True, "3", None])
def test_connect_attempts_must_be_an_int_of_at_least_1(value):
    with pytest.raises(ConfigError, match="NetBounds.connect_attempts"):
        NetBounds(connect_attempts=value)


@pytest.mark.parametrize("value", [1, 60, np.int64(4)])
def test_connect_attempts_takes_a_positive_int(value):
    assert NetBounds(connect_attempts=value).connect_attempts == value


@pytest.mark.parametrize("value", [-1, math.inf, math.nan, True, "0"])
def test_controller_outage_must_be_none_or_a_finite_number_of_at_least_0(value):
    with pytest.raises(ConfigError, match="NetBounds.controller_outage"):
        NetBounds(controller_outage=value)


@pytest.mark.parametrize("value", [None, 0, 0.0, 12.5])
def test_controller_outage_takes_none_0_or_more(value):
    assert NetBounds(controller_outage=value).controller_outage == value


def test_a_bad_connect_attempts_override_is_refused_before_any_traffic():
    with pytest.raises(ConfigError, match="connect_attempts"):
        connect_reduce_client(("127.0.0.1", 1), 0, 1, SessionSalt.generate(), connect_attempts=1.5)
    with pytest.raises(ConfigError, match="connect_attempts"):
        connect_reduce_client(("127.0.0.1", 1), 0, 1, SessionSalt.generate(), bounds=NetBounds(), connect_attempts=math.inf)


def test_scaled_is_the_defaults_at_a_scale_and_reads_no_environment(monkeypatch):
    monkeypatch.setenv("FLODL_CONTROLLER_OUTAGE", "7")
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "3")
    defaults = NetBounds()
    assert NetBounds.scaled(2) == NetBounds(
        handshake=defaults.handshake * 2, channel_magic=defaults.channel_magic * 2,
        write_stall=defaults.write_stall * 2, connect_interval=defaults.connect_interval * 2,
        heartbeat_timeout=defaults.heartbeat_timeout * 2,
    )
    # A classmethod: on an instance it still starts from the defaults.
    assert NetBounds(controller_outage=4, connect_attempts=2).scaled(2) == NetBounds.scaled(2)
    with pytest.raises(ConfigError):
        NetBounds.scaled(0)
