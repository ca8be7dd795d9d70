"""The daemons' error contract (docs/operations.md, "Exit codes and log lines"), as users
meet it: real ``python -m flodl_trio.controller/relay/shard`` processes.

- a bad setting - a flag or the environment variable standing for it, a port out of
  range, a missing salt, a bad local-leg directory - exits 2 with one line on stderr
  naming it (no usage block, no traceback); ``--help`` still prints the whole help;
- an OS-level start-up failure (a port in use, a host that does not resolve, a
  checkpoint directory that is a file) exits 1, and the last log line says why;
- a bad FLODL_NET_TIMEOUT_SCALE is warned about once, through the configured logging.

Every process runs under a subprocess timeout; none is left running.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodl_trio import SessionSalt
from flodl_trio.daemon.child_shard import child_env
from flodl_trio.daemon.controller import make_outer
from flodl_trio.daemon.relay import check_unix_dir
from flodl_trio.errors import ConfigError
from flodl_trio.fold.outer import DiLoCoNesterov, PlainAverage, SlowMo

SALT_HEX = "42" * 16
LOOP = "127.0.0.1"
CONTROLLER = "flodl_trio.controller"
RELAY = "flodl_trio.relay"
SHARD = "flodl_trio.shard"
# Arguments that would start each daemon (on a free port, towards nobody), but for the case's error.
STARTS = {
    CONTROLLER: ("--host", LOOP, "--port", "0", "--world-size", "1"),
    RELAY: ("--controller", f"{LOOP}:1", "--ranks", "0", "--world-size", "1", "--shard", "off", "--no-unix",
            "--data-port", "0", "--control-port", "0"),
    SHARD: ("--host", LOOP, "--port", "0"),
}


def run_cli(module: str, *args: str, env: dict[str, str] | None = None, salt: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a daemon to its exit (bounded): a clean FLODL_-free environment plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_") and k not in ("MASTER_PORT", "MASTER_ADDR")}
    if salt:
        base["FLODL_SALT_HEX"] = SALT_HEX
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, stdin=subprocess.DEVNULL, timeout=60)


def one_error_line(result: subprocess.CompletedProcess[str], module: str) -> str:
    """A bad setting: exit 2 and exactly one line on stderr, the parser's."""
    lines = result.stderr.splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"python -m {module}: error: "), lines[0]
    return lines[0]


def failure_line(result: subprocess.CompletedProcess[str], daemon: str) -> str:
    """An OS-level failure: exit 1, log lines only, the last one ``<daemon> failed: ...``."""
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert lines and all(line.startswith("ts=") for line in lines), result.stderr
    assert "level=error" in lines[-1] and f'msg="{daemon} failed: ' in lines[-1], lines[-1]
    return lines[-1]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port held by a listening socket for the test."""
    with socket.socket() as sock:
        sock.bind((LOOP, 0))
        sock.listen()
        yield sock.getsockname()[1]


# --- 1. environment variables standing for flags with choices -----------------------------


@pytest.mark.parametrize(("var", "value", "allowed"), [
    ("FLODL_OUTER", "adam", "none, average, slowmo, diloco"),
    ("FLODL_OUTER", "SlowMo", "none, average, slowmo, diloco"),
    ("FLODL_LOG_FORMAT", "xml", "logfmt, json"),
    ("FLODL_LOG_LEVEL", "verbose", "DEBUG, INFO, WARNING, ERROR"),
])
def test_a_variable_outside_its_flags_choices_exits_2_naming_it(var, value, allowed):
    line = one_error_line(run_cli(CONTROLLER, *STARTS[CONTROLLER], env={var: value}), CONTROLLER)
    assert f"{var}={value!r}" in line and allowed in line, line


def test_make_outer_names_each_choice_and_refuses_any_other():
    assert make_outer("none", None, None) is None
    assert isinstance(make_outer("average", None, None), PlainAverage)
    assert isinstance(make_outer("slowmo", None, None), SlowMo)
    assert isinstance(make_outer("diloco", 0.5, None), DiLoCoNesterov)
    with pytest.raises(ConfigError, match="adam"):
        make_outer("adam", None, None)


# --- 2. bad integers in the environment -------------------------------------------------


@pytest.mark.parametrize(("module", "var", "value"), [
    (CONTROLLER, "FLODL_CONTROLLER_PORT", "abc"),
    (CONTROLLER, "MASTER_PORT", "abc"),
    (CONTROLLER, "FLODL_CHECKPOINT_EVERY", "x"),
    (CONTROLLER, "FLODL_CHECKPOINT_KEEP", "x"),
    (CONTROLLER, "FLODL_LANES", "x"),
    (CONTROLLER, "FLODL_FRAME_CEILING", "1GiB"),
    (CONTROLLER, "FLODL_METRICS_PORT", "x"),
    (CONTROLLER, "FLODL_WORLD_SIZE", "abc"),
    (CONTROLLER, "FLODL_CONTROLLER_PORT", "70000"),
    (RELAY, "FLODL_DATA_PORT", "x"),
    (RELAY, "FLODL_LANES", "x"),
    (SHARD, "FLODL_SHARD_PORT", "x"),
    (SHARD, "FLODL_FRAME_CEILING", "0"),
])
def test_a_bad_integer_variable_exits_2_naming_it_and_help_still_works(module, var, value):
    args = [*STARTS[module]]
    flag = {"FLODL_CONTROLLER_PORT": "--port", "MASTER_PORT": "--port", "FLODL_WORLD_SIZE": "--world-size",
            "FLODL_DATA_PORT": "--data-port", "FLODL_SHARD_PORT": "--port"}.get(var)
    if flag in args:  # the variable stands for a flag only when the flag is not given
        del args[args.index(flag):args.index(flag) + 2]
    line = one_error_line(run_cli(module, *args, env={var: value}), module)
    assert f"{var}={value!r}" in line, line
    helped = run_cli(module, "--help", env={var: value})
    assert helped.returncode == 0 and "usage:" in helped.stdout and helped.stderr == "", helped.stderr


@pytest.mark.parametrize(("env", "args"), [
    ({"MASTER_PORT": "abc"}, ("--port", "0")),
    ({"FLODL_CONTROLLER_PORT": "70000"}, ("--port", "0")),
    ({"FLODL_OUTER": "adam"}, ("--outer", "none")),
    ({"FLODL_LOG_LEVEL": "verbose"}, ("--log-level", "INFO")),
    ({"FLODL_CONTROLLER_OUTAGE": "x"}, ("--controller-outage", "5")),
])
def test_a_flag_given_wins_over_its_bad_variable(env, args):
    """The run gets past the variable: it stops at the next bad setting, a world of 0."""
    line = one_error_line(run_cli(CONTROLLER, "--host", LOOP, "--world-size", "0", *args, env=env), CONTROLLER)
    assert "--world-size must be > 0" in line, line


@pytest.mark.parametrize(("module", "var", "value"), [
    (CONTROLLER, "FLODL_WORLD_SIZE", "0"),
    (CONTROLLER, "FLODL_HEARTBEAT_TIMEOUT", "nan"),
    (CONTROLLER, "FLODL_HEARTBEAT_TIMEOUT", "0"),
    (CONTROLLER, "FLODL_REJOIN_TIMEOUT", "inf"),
    (CONTROLLER, "FLODL_FORMATION_TIMEOUT", "-1"),
    (CONTROLLER, "FLODL_CHECKPOINT_KEEP", "0"),
    (CONTROLLER, "FLODL_LANES", "65"),
    (CONTROLLER, "FLODL_OUTER_LR", "nan"),
    (CONTROLLER, "FLODL_OUTER_MOMENTUM", "-0.5"),
    (RELAY, "FLODL_LANES", "0"),
    (RELAY, "FLODL_RELAY_MEMORY_BUDGET", "inf"),
    (RELAY, "FLODL_RANKS", "0,x"),
])
def test_a_variable_out_of_its_flags_range_exits_2_naming_the_variable_and_value(module, var, value):
    """A variable that parses (a number) but is out of its flag's range is as bad as one
    that does not parse: one line that names the variable and its value, so an operator
    who never typed the flag sees which of their variables to fix."""
    env = {var: value}
    if var.startswith("FLODL_OUTER_"):
        env["FLODL_OUTER"] = "diloco"
    args = [a for a in STARTS[module]]
    if var == "FLODL_WORLD_SIZE":  # the variable, not the flag, must say it
        args = args[:args.index("--world-size")] + args[args.index("--world-size") + 2:]
    if var == "FLODL_RANKS":
        args = args[:args.index("--ranks")] + args[args.index("--ranks") + 2:]
    line = one_error_line(run_cli(module, *args, env=env), module)
    assert f"{var}={value!r}" in line, line


# --- 3. OS-level start-up failures -------------------------------------------------------


def test_a_controller_port_in_use_is_one_log_line_exit_1(busy_port):
    line = failure_line(run_cli(CONTROLLER, "--host", LOOP, "--port", str(busy_port), "--world-size", "1"), "controller")
    assert f"{LOOP}:{busy_port}" in line and "in use" in line, line


def test_a_metrics_port_in_use_is_one_log_line_exit_1(busy_port):
    line = failure_line(run_cli(CONTROLLER, *STARTS[CONTROLLER], "--metrics-port", str(busy_port)), "controller")
    assert f"metrics on {LOOP}:{busy_port}" in line, line


def test_a_relay_data_port_in_use_is_one_log_line_exit_1(busy_port):
    args = [*STARTS[RELAY]]
    args[args.index("--data-port") + 1] = str(busy_port)
    line = failure_line(run_cli(RELAY, *args), "relay")
    assert f"data channel on {LOOP}:{busy_port}" in line, line


def test_a_shard_port_in_use_is_one_log_line_exit_1(busy_port):
    line = failure_line(run_cli(SHARD, "--host", LOOP, "--port", str(busy_port)), "shard")
    assert f"{LOOP}:{busy_port}" in line, line


def test_an_unresolvable_host_is_one_log_line_exit_1():
    line = failure_line(run_cli(CONTROLLER, "--host", "no.such.host.invalid", "--port", "0", "--world-size", "1"),
                        "controller")
    assert "no.such.host.invalid" in line, line


def test_a_checkpoint_dir_that_is_a_file_is_one_log_line_exit_1(tmp_path):
    a_file = tmp_path / "afile"
    a_file.write_text("")
    line = failure_line(run_cli(CONTROLLER, *STARTS[CONTROLLER], "--checkpoint-dir", str(a_file)), "controller")
    assert str(a_file) in line, line


def test_a_failure_at_debug_level_comes_with_its_traceback(busy_port):
    result = run_cli(CONTROLLER, "--host", LOOP, "--port", str(busy_port), "--world-size", "1", "--log-level", "DEBUG")
    assert result.returncode == 1 and "controller failed: " in result.stderr and "Traceback" in result.stderr


def test_a_relays_shard_that_cannot_start_fails_the_relay_at_once():
    """The shard child's own line says why; the relay does not wait out the start bound."""
    args = [*STARTS[RELAY]]
    args[args.index("--shard") + 1] = "no.such.host.invalid:5000"
    result = run_cli(RELAY, *args)
    line = failure_line(result, "relay")
    assert "exited (status 1) before listening" in line, line
    assert 'msg="shard failed: starting on no.such.host.invalid:5000' in result.stderr, result.stderr


# --- 4. argparse-level errors: one line -------------------------------------------------


@pytest.mark.parametrize(("extra", "needle"), [
    (("--outer", "adam"), "argument --outer: invalid choice: 'adam'"),
    (("--world-size", "abc"), "argument --world-size: invalid int value: 'abc'"),
    (("--bogus",), "unrecognized arguments: --bogus"),
    (("--heartbeat-timeout", "nan"), "--heartbeat-timeout must be a finite number > 0, got nan"),
    (("--heartbeat-timeout", "inf"), "--heartbeat-timeout must be a finite number > 0, got inf"),
])
def test_a_bad_flag_is_one_line_on_stderr_exit_2(extra, needle):
    line = one_error_line(run_cli(CONTROLLER, *STARTS[CONTROLLER], *extra), CONTROLLER)
    assert needle in line, line


@pytest.mark.parametrize(("args", "env"), [
    (("--shards", f"{LOOP}:5000", "--lanes", "1"), {}),
    (("--lanes", "1"), {"FLODL_SHARDS": f"{LOOP}:5000,{LOOP}:5001"}),
])
def test_shards_named_with_one_lane_cannot_work_together_exit_2(args, env):
    """Shards reduce lanes 1.. of a round: named shards with ``--lanes 1`` is a bad setting
    (one line, exit 2), found before anything starts, not a failure of the started daemon."""
    line = one_error_line(run_cli(CONTROLLER, *STARTS[CONTROLLER], *args, env=env), CONTROLLER)
    assert "need lanes >= 2, got 1" in line, line


@pytest.mark.parametrize(("args", "env", "needle"), [
    (("--outer-lr", "0.5"), {}, "--outer-lr given with --outer none"),
    (("--outer", "average", "--outer-momentum", "0.5"), {}, "--outer-momentum given with --outer average"),
    ((), {"FLODL_OUTER_LR": "0.5"}, "(from FLODL_OUTER_LR='0.5')"),
])
def test_an_outer_hyperparameter_without_an_outer_optimizer_exits_2(args, env, needle):
    """An outer learning rate or momentum with no optimizer to use it means --outer was
    forgotten: the run would average plainly where DiLoCo was meant. Refused, not ignored."""
    line = one_error_line(run_cli(CONTROLLER, *STARTS[CONTROLLER], *args, env=env), CONTROLLER)
    assert needle in line, line


@pytest.mark.parametrize("module", [CONTROLLER, RELAY, SHARD])
def test_help_still_prints_the_whole_help(module):
    result = run_cli(module, "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stderr
    assert "--frame-ceiling" in result.stdout and "--log-format" in result.stdout


# --- 5. ports and the frame ceiling out of range -----------------------------------------


@pytest.mark.parametrize(("module", "flag", "value"), [
    (CONTROLLER, "--port", "70000"),
    (CONTROLLER, "--port", "-1"),
    (CONTROLLER, "--metrics-port", "70000"),
    (CONTROLLER, "--frame-ceiling", "0"),
    (CONTROLLER, "--frame-ceiling", "-5"),
    (RELAY, "--data-port", "70000"),
    (RELAY, "--control-port", "65536"),
    (RELAY, "--metrics-port", "70000"),
    (SHARD, "--port", "70000"),
])
def test_an_out_of_range_port_or_ceiling_exits_2(module, flag, value):
    line = one_error_line(run_cli(module, *STARTS[module], flag, value), module)
    assert f"argument {flag}" in line and value.lstrip("-") in line, line


@pytest.mark.parametrize(("args", "env", "needle"), [
    (("--controller", f"{LOOP}:70000"), {}, "argument --controller: address 127.0.0.1:70000: port 70000 is out of range"),
    ((), {"FLODL_CONTROLLER": "nohostport"}, "FLODL_CONTROLLER='nohostport' (for --controller): address must be host:port"),
    (("--controller", f"{LOOP}:65534"), {}, "the controller's port + 4): port 65538 is out of range"),
    ((), {"MASTER_PORT": "70000"}, "MASTER_PORT=70000: port 70000 is out of range"),
])
def test_a_relays_bad_controller_address_or_derived_port_exits_2(args, env, needle):
    line = one_error_line(run_cli(RELAY, "--ranks", "0", "--world-size", "1", "--shard", "off", *args, env=env), RELAY)
    assert needle in line, line


# --- 6. FLODL_NET_TIMEOUT_SCALE's warning goes through the configured logging -----------


def test_a_bad_timeout_scale_is_warned_once_in_the_chosen_format(busy_port):
    args = ("--host", LOOP, "--port", str(busy_port), "--world-size", "1", "--log-format", "json")
    result = run_cli(CONTROLLER, *args, env={"FLODL_NET_TIMEOUT_SCALE": "0.01"})
    assert result.returncode == 1, result.stderr
    records = [json.loads(line) for line in result.stderr.splitlines()]  # every line is JSON
    warnings = [r for r in records if "FLODL_NET_TIMEOUT_SCALE" in r["msg"]]
    assert len(warnings) == 1 and warnings[0]["level"] == "warning", records
    assert records[-1]["level"] == "error" and records[-1]["msg"].startswith("controller failed: ")


def test_a_bad_timeout_scale_is_not_printed_under_log_level_error(busy_port):
    args = ("--host", LOOP, "--port", str(busy_port), "--world-size", "1", "--log-level", "ERROR")
    result = run_cli(CONTROLLER, *args, env={"FLODL_NET_TIMEOUT_SCALE": "abc"})
    assert result.returncode == 1 and "FLODL_NET_TIMEOUT_SCALE" not in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_a_relays_shard_child_gets_the_scale_already_read(monkeypatch):
    """So the child does not warn about a bad value a second time."""
    salt = SessionSalt(bytes.fromhex(SALT_HEX))
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "abc")
    assert child_env(salt)["FLODL_NET_TIMEOUT_SCALE"] == "1.0"
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "0.5")
    assert child_env(salt)["FLODL_NET_TIMEOUT_SCALE"] == "0.5"
    monkeypatch.delenv("FLODL_NET_TIMEOUT_SCALE")
    assert "FLODL_NET_TIMEOUT_SCALE" not in child_env(salt)


# --- 7. the shard daemon -----------------------------------------------------------------


def test_a_shard_without_salt_exits_2_as_the_others_do():
    for module in (SHARD, CONTROLLER, RELAY):
        line = one_error_line(run_cli(module, *STARTS[module], salt=False), module)
        assert "no session salt" in line, line


def test_the_shard_offers_no_metrics_flag():
    assert "--metrics-port" not in run_cli(SHARD, "--help").stdout
    line = one_error_line(run_cli(SHARD, *STARTS[SHARD], "--metrics-port", "9100"), SHARD)
    assert "unrecognized arguments: --metrics-port" in line, line


# --- 8. --unix-dir ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o755, 0o744, 0o750, 0o701])
def test_a_unix_dir_open_to_group_or_others_exits_2(tmp_path, mode):
    directory = tmp_path / "leg"
    directory.mkdir()
    directory.chmod(mode)
    args = [a for a in STARTS[RELAY] if a != "--no-unix"]
    line = one_error_line(run_cli(RELAY, *args, "--unix-dir", str(directory)), RELAY)
    assert str(directory) in line and f"{mode:04o}" in line and "0700" in line, line


def test_check_unix_dir_takes_a_private_dir_and_leaves_a_missing_one_for_the_start(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    check_unix_dir(str(private))
    check_unix_dir(str(tmp_path / "not-yet"))
    assert not (tmp_path / "not-yet").exists()
    a_file: Path = tmp_path / "afile"
    a_file.write_text("")
    with pytest.raises(ConfigError):
        check_unix_dir(str(a_file))


# --- switches: a variable standing for an on/off flag -------------------------------------


@pytest.mark.parametrize(("module", "var", "value"), [
    (CONTROLLER, "FLODL_DETERMINISTIC", "ture"),
    (CONTROLLER, "FLODL_KEEP_SERVING", "maybe"),
    (RELAY, "FLODL_DETERMINISTIC", "2"),
    (RELAY, "FLODL_NO_UNIX", "sometimes"),
])
def test_a_switch_variable_that_is_not_on_or_off_exits_2_naming_it(module, var, value):
    """A typo in a switch's variable never silently means off (a controller and relays
    that disagree on deterministic mode would give other bytes, quietly)."""
    args = [arg for arg in STARTS[module] if arg != "--no-unix"]
    line = one_error_line(run_cli(module, *args, env={var: value}), module)
    assert f"{var}={value!r}" in line and "give 1 (on) or 0 (off)" in line, line


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("YES", True), ("on", True),
                                           ("0", False), ("false", False), ("No", False), ("off", False)])
def test_a_switch_variable_reads_the_usual_words_for_on_and_off(monkeypatch, value, on):
    from flodl_trio.daemon import controller, relay

    for name in ("FLODL_DETERMINISTIC", "FLODL_KEEP_SERVING", "FLODL_NO_UNIX"):
        monkeypatch.setenv(name, value)
    args = controller.build_parser().parse_args(list(STARTS[CONTROLLER]))
    assert (args.deterministic, args.keep_serving) == (on, on)
    relay_args = relay.build_parser().parse_args([a for a in STARTS[RELAY] if a != "--no-unix"])
    assert (relay_args.deterministic, relay_args.no_unix) == (on, on)
    assert controller.build_parser().parse_args([*STARTS[CONTROLLER], "--deterministic"]).deterministic


def test_the_clients_read_flodl_no_unix_as_the_relay_does(monkeypatch):
    from flodl_trio.errors import ConfigError
    from flodl_trio.transport.local_leg import local_leg_enabled

    assert local_leg_enabled({}) and local_leg_enabled({"FLODL_NO_UNIX": " "})
    assert local_leg_enabled({"FLODL_NO_UNIX": "false"}) and not local_leg_enabled({"FLODL_NO_UNIX": "1"})
    with pytest.raises(ConfigError, match="FLODL_NO_UNIX: 'perhaps' is not a switch value"):
        local_leg_enabled({"FLODL_NO_UNIX": "perhaps"})


# --- 8. a relay daemon's flags win for its shard child too -------------------------------


@pytest.mark.parametrize(("env", "args"), [
    ({"FLODL_DETERMINISTIC": "ture"}, ("--deterministic",)),
    ({"FLODL_CONTROLLER_OUTAGE": "x"}, ("--controller-outage", "5")),
    ({"FLODL_LANES": "many"}, ("--lanes", "4")),
])
def test_a_relay_flag_that_wins_over_its_bad_variable_wins_for_its_shard_too(env, args):
    """The shard child is started with the relay's environment: a bad variable the relay's
    own flag overrode must not stop the child, and the relay with it. The relay starts and
    then fails only as any relay towards nobody does: its upstream connect gives up."""
    relay_args = [*STARTS[RELAY]]
    relay_args[relay_args.index("--shard") + 1] = f"{LOOP}:0"
    result = run_cli(RELAY, *relay_args, *args, env={**env, "FLODL_NET_TIMEOUT_SCALE": "0.1"})
    line = failure_line(result, "relay")
    assert f"upstream: connect to {LOOP}:1 failed" in line, result.stderr
    assert "shard failed" not in result.stderr and "error: " not in result.stderr, result.stderr


def test_the_shard_daemon_reads_no_controller_outage_variable():
    """A shard holds for a lost controller as long as that controller tells it, so
    FLODL_CONTROLLER_OUTAGE (for the relays and ranks beside it) is none of its settings:
    even a bad value lets it start. ``--with-parent`` with standard input closed: it
    listens, says so, and leaves at once (exit 0)."""
    result = run_cli(SHARD, *STARTS[SHARD], "--with-parent", env={"FLODL_CONTROLLER_OUTAGE": "x"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("listening "), result.stdout
    assert "FLODL_CONTROLLER_OUTAGE" not in result.stderr, result.stderr
