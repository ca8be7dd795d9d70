"""The protocol floor the benchmark prints beside its speed targets (benchmarks/_floor.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from flodl_trio.wire.constants import DTYPE_BF16, DTYPE_F32, MUX_HEADER_LEN
from flodl_trio.wire.round_frame import schema_frame_len

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "_floor.py"
_spec = importlib.util.spec_from_file_location("_floor", _PATH)
assert _spec is not None and _spec.loader is not None
floor = importlib.util.module_from_spec(_spec)
sys.modules["_floor"] = floor  # dataclasses look their module up by name
_spec.loader.exec_module(floor)

MiB = 1 << 20
# docs/performance.md's machine: HMAC-SHA256 at 1.43 GB/s, 2 cores; no loopback cost, to check the hash arithmetic alone.
DOC_MACHINE = floor.MachineCosts(hmac_bytes_per_s=1.43e9, loopback_cpu_s_per_byte=0.0, cores=2)
F32_FRAME_16MIB = 25 + 14 + 16 * MiB  # one 1-D f32 tensor: frame header + tensor header + data + MAC


def test_mux_header_matches_the_wire_layer() -> None:
    assert floor.MUX_HEADER == MUX_HEADER_LEN


@pytest.mark.parametrize(("dtype", "tag"), [("f32", DTYPE_F32), ("bf16", DTYPE_BF16)])
@pytest.mark.parametrize("numel", [0, 1, 1000, 4 * MiB])
def test_frame_len_matches_the_wire_layer(dtype: str, tag: int, numel: int) -> None:
    assert floor.frame_len(numel, dtype) == schema_frame_len([(tag, (numel,))])


@pytest.mark.parametrize(
    ("rate", "bits"),
    [
        ("1gbit", 1e9), ("500mbit", 5e8), ("200Mbit", 2e8), ("64kbit", 64e3), ("10mbps", 8e7), ("1.5gbit", 1.5e9),
        ("1000000", 1e6), ("8bit", 8.0), ("1mibit", 2**20), ("1KiBps", 8 * 2**10),
    ],
)
def test_parse_rate_reads_tc_rates(rate: str, bits: float) -> None:
    assert floor.parse_rate(rate) == pytest.approx(bits)


@pytest.mark.parametrize("rate", ["", "fast", "1 gigabit", "-1gbit", "0mbit", "0", "1gbitt", "1xbit"])
def test_parse_rate_names_what_it_cannot_read(rate: str) -> None:
    with pytest.raises(ValueError, match="rate"):
        floor.parse_rate(rate)


def test_two_host_floor_is_link_plus_the_remote_hosts_hashing() -> None:
    got = floor.two_host_floor(DOC_MACHINE, F32_FRAME_16MIB, "1gbit", ranks_per_host=2)
    link_ms = 2 * (F32_FRAME_16MIB + 25) * 8 / 1e9 * 1e3
    assert got.link_ms == pytest.approx(link_ms)
    assert link_ms == pytest.approx(268.4, abs=0.1)  # 16 MiB up then 16 MiB down at 1 Gbit/s
    assert got.hash_passes == 6  # 2 ranks sign, the relay verifies 2 frames and signs its HostFrame twice
    assert got.ms == pytest.approx(link_ms + 6 * F32_FRAME_16MIB / 1.43e9 / 2 * 1e3)
    assert got.ms == pytest.approx(303.6, abs=0.2)  # the figure docs/performance.md derives by hand


def test_two_host_floor_counts_loopback_copies_and_scales_with_ranks() -> None:
    priced = floor.MachineCosts(hmac_bytes_per_s=1e9, loopback_cpu_s_per_byte=1e-9, cores=4)
    got = floor.two_host_floor(priced, 1_000_000, "8mbit", ranks_per_host=3)
    # link: 2 x 1,000,025 bytes at 1 MB/s; CPU: (8 passes + 3 transfers) x 1 ms, over 4 cores
    assert got.hash_passes == 8
    assert got.ms == pytest.approx(2 * 1_000_025 / 1e6 * 1e3 + 11 / 4)


def test_one_host_floor_is_the_mandatory_cpu_over_the_cores() -> None:
    got = floor.one_host_floor(DOC_MACHINE, 64 * MiB, ranks=4)
    assert got.hash_passes == 18 and got.link_ms == 0
    assert got.ms == pytest.approx(18 * 64 * MiB / 1.43e9 / 2 * 1e3)
    priced = floor.MachineCosts(hmac_bytes_per_s=1e9, loopback_cpu_s_per_byte=1e-9, cores=1)
    # 3K + 6 passes and 2K + 2 transfers of 1 ms each for K = 2
    assert floor.one_host_floor(priced, 1_000_000, ranks=2).ms == pytest.approx(12 + 6)


def test_the_local_leg_takes_the_ranks_hash_passes_out_of_the_floor() -> None:
    priced = floor.MachineCosts(hmac_bytes_per_s=1e9, loopback_cpu_s_per_byte=1e-9, cores=1, unix_cpu_s_per_byte=5e-10)
    one = floor.one_host_floor(priced, 1_000_000, ranks=4, local_leg=True)
    # 6 passes (relay and controller only), 2 TCP transfers of 1 ms, 8 Unix ones of 0.5 ms
    assert one.hash_passes == 6 and one.ms == pytest.approx(6 + 2 + 4)
    two = floor.two_host_floor(priced, 1_000_000, "8mbit", ranks_per_host=3, local_leg=True)
    # the relay signs its HostFrame twice; 3 frames cross the Unix socket
    assert two.hash_passes == 2
    assert two.ms == pytest.approx(2 * 1_000_025 / 1e6 * 1e3 + 2 + 1.5)
    assert floor.one_host_floor(DOC_MACHINE, 64 * MiB, 4, local_leg=True).ms < floor.one_host_floor(DOC_MACHINE, 64 * MiB, 4).ms


def test_more_cores_lower_the_floor_but_never_below_the_link() -> None:
    many = floor.MachineCosts(hmac_bytes_per_s=1.43e9, loopback_cpu_s_per_byte=5e-10, cores=64)
    few = floor.MachineCosts(hmac_bytes_per_s=1.43e9, loopback_cpu_s_per_byte=5e-10, cores=2)
    on_many = floor.two_host_floor(many, F32_FRAME_16MIB, "1gbit", 2)
    on_few = floor.two_host_floor(few, F32_FRAME_16MIB, "1gbit", 2)
    assert on_many.link_ms < on_many.ms < on_few.ms


def test_measured_costs_are_this_machines_and_plausible() -> None:
    costs = floor.measure_costs(nbytes=4 * MiB, repeats=2)
    assert costs.cores >= 1
    assert 50e6 < costs.hmac_bytes_per_s < 50e9  # SHA-256 runs at 0.05-50 GB/s on anything real
    assert 0 < costs.loopback_cpu_s_per_byte < 1e-6  # a loopback byte costs less than a microsecond
    assert costs.unix_cpu_s_per_byte is not None and 0 < costs.unix_cpu_s_per_byte < 1e-6
    assert "GB/s" in costs.describe() and f"{costs.cores} cores" in costs.describe()



def test_every_timed_function_of_the_timing_mode_exists() -> None:
    """``--timing`` skips a target it cannot find, so a renamed module would silently time nothing."""
    import importlib

    bench_dir = str(_PATH.parent)
    sys.path.insert(0, bench_dir)
    try:
        spec = importlib.util.spec_from_file_location("bench_allreduce", _PATH.parent / "allreduce.py")
        assert spec is not None and spec.loader is not None
        bench = importlib.util.module_from_spec(spec)
        sys.modules["bench_allreduce"] = bench  # dataclasses look their module up by name
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(bench_dir)
        sys.modules.pop("bench_allreduce", None)
    found: dict[str, int] = {}
    for module_name, dotted in bench.TIMED_FUNCTIONS:
        owner = importlib.import_module(module_name)  # every module named exists
        for part in dotted.split("."):
            owner = getattr(owner, part, None)
        found[dotted] = found.get(dotted, 0) + (owner is not None)
    missing = sorted(name for name, hits in found.items() if hits == 0)
    assert missing == [], f"timed nowhere: {missing}"


def test_two_host_floor_with_lanes_overlaps_all_but_the_last_lanes_downlink() -> None:
    one = floor.two_host_floor(DOC_MACHINE, F32_FRAME_16MIB, "1gbit", ranks_per_host=2)
    four = floor.two_host_floor(DOC_MACHINE, F32_FRAME_16MIB, "1gbit", ranks_per_host=2, lanes=4)
    header = 25 * 8 / 1e9 * 1e3  # one MuxRecord header at 1 Gbit/s, in ms
    assert four.link_ms == pytest.approx((1 + 1 / 4) / 2 * one.link_ms + 1.25 * 3 * header)
    assert four.link_ms == pytest.approx(167.8, abs=0.1)  # 16 MiB up, then the last 4 MiB down
    assert four.hash_passes == one.hash_passes
    assert four.ms - four.link_ms == pytest.approx(one.ms - one.link_ms)
