"""Throughput of the wire codec on a 64 MiB f32 frame.

Run from the repository root::

    python benchmarks/codec.py            # default: 64 MiB, 7 repetitions
    python benchmarks/codec.py --mib 16 --reps 5

It prints the machine and versions, a markdown table (MB/s and ms per
operation, best of ``--reps`` after one warm-up), and a PASS/FAIL line per
target. The exit code is non-zero when a target fails. This is a benchmark,
not a test: pytest never collects it.

Targets:
* encode+sign and decode+verify each run at >= 70% of the raw
  HMAC-SHA256 rate measured in the same run (the MAC is the floor: every
  payload byte must be hashed once, and nothing else should cost as much);
* f32 -> bf16 encode >= 1000 MB/s (counted in input f32 bytes);
* fold (4 frames summed, then re-encoded) >= 1000 MB/s (counted in total
  input bytes), for f32 frames and for bf16 frames.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _machine import best_time, cpu_model  # noqa: E402  (this script's folder is on sys.path)

from flodl_trio.fold import FoldAccumulator
from flodl_trio.wire import (
    DTYPE_BF16,
    DTYPE_F32,
    RoundFrame,
    RoundKind,
    SessionSalt,
    TensorPayload,
    decode_round_frame,
    encode_round_frame_chunks,
    f32_to_bf16,
)

MB = 1_000_000  # rates are decimal MB/s; sizes are binary MiB
HMAC_RATIO_TARGET = 0.70
BF16_TARGET_MBPS = 1000.0
FOLD_TARGET_MBPS = 1000.0
N_FOLD = 4



def make_frame(mib: int, dtype: int, rng: np.random.Generator, n_tensors: int = 3) -> RoundFrame:
    """A frame of ``n_tensors`` large tensors totalling ``mib`` MiB of payload."""
    total_elems = (mib << 20) // (4 if dtype == DTYPE_F32 else 2)
    sizes = [total_elems // n_tensors] * n_tensors
    sizes[-1] += total_elems - sum(sizes)
    tensors = []
    for n in sizes:
        values = rng.standard_normal(n, dtype=np.float32)
        data = values if dtype == DTYPE_F32 else f32_to_bf16(values)
        tensors.append(TensorPayload(dtype, (n,), data))
    return RoundFrame(tensors, RoundKind.MODEL, 1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="frame payload size in MiB (default 64)")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per case (default 7)")
    args = ap.parse_args()
    mib, reps = args.mib, args.reps
    nbytes = mib << 20

    print(f"machine: {cpu_model()}, {os.cpu_count()} logical cores, {platform.machine()}")
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, "
        f"{hashlib.sha256().name} via {getattr(__import__('ssl'), 'OPENSSL_VERSION', 'unknown OpenSSL')}"
    )
    print(f"frame: {mib} MiB f32 payload in 3 tensors, best of {reps} after a warm-up")
    print()

    rng = np.random.default_rng(1234)
    salt = SessionSalt(bytes(range(16)))
    frame = make_frame(mib, DTYPE_F32, rng)
    rows: list[tuple[str, float, float, float | None]] = []  # name, bytes counted, seconds, ratio

    # (e) raw HMAC-SHA256 over the same bytes: the floor of anything signed.
    raw = np.concatenate([np.frombuffer(t.data, dtype=np.uint8) for t in frame.tensors])
    assert raw.size == nbytes
    key = salt.raw
    t_hmac = best_time(lambda: hmac.new(key, raw, "sha256").digest(), reps)
    hmac_rate = nbytes / t_hmac

    # (a) encode + sign: the chunks and the MAC, no join.
    t_enc = best_time(lambda: encode_round_frame_chunks(frame, salt), reps)
    encoded = encode_round_frame_chunks(frame, salt).tobytes()
    frame_len = len(encoded)

    # (b) decode + verify over the whole encoded message.
    t_dec = best_time(lambda: decode_round_frame(encoded, salt), reps)
    assert decode_round_frame(encoded, salt) == frame

    # (c) f32 -> bf16 of 64 MiB of f32 (into a preallocated output, as relays do).
    f32_values = np.frombuffer(raw, dtype=np.float32)
    bf16_out = np.empty(f32_values.size, dtype=np.uint16)
    t_bf16 = best_time(lambda: f32_to_bf16(f32_values, out=bf16_out), reps)
    t_bf16_alloc = best_time(lambda: f32_to_bf16(f32_values), reps)

    # (d) fold of N_FOLD frames, then result(); f32 and bf16 frames.
    def fold_case(frames: list[RoundFrame]) -> Callable[[], object]:
        def run() -> object:
            acc = FoldAccumulator()
            for i, f in enumerate(frames):
                acc.add(f, f"rank {i}")
            return acc.result()

        return run

    f32_frames = [make_frame(mib, DTYPE_F32, rng) for _ in range(N_FOLD)]
    t_fold = best_time(fold_case(f32_frames), reps)
    del f32_frames
    bf16_frames = [make_frame(mib, DTYPE_BF16, rng) for _ in range(N_FOLD)]
    bf16_fold_bytes = sum(t.nbytes for f in bf16_frames for t in f.tensors)
    t_fold_bf16 = best_time(fold_case(bf16_frames), reps)
    del bf16_frames

    rows = [
        ("raw HMAC-SHA256 (hashlib)", nbytes, t_hmac, 1.0),
        ("RoundFrame encode+sign (chunks + MAC)", frame_len, t_enc, None),
        ("RoundFrame decode+verify", frame_len, t_dec, None),
        ("f32 -> bf16 (into preallocated out)", nbytes, t_bf16, None),
        ("f32 -> bf16 (allocating)", nbytes, t_bf16_alloc, None),
        (f"fold {N_FOLD} x f32 frames + result()", N_FOLD * nbytes, t_fold, None),
        (f"fold {N_FOLD} x bf16 frames + result()", bf16_fold_bytes, t_fold_bf16, None),
    ]
    print("| operation | input bytes | ms | MB/s | vs raw HMAC |")
    print("|---|---:|---:|---:|---:|")
    for name, counted, secs, _ in rows:
        rate = counted / secs
        ratio = f"{rate / hmac_rate:.2f}x" if ("HMAC" in name or "RoundFrame" in name) else ""
        print(f"| {name} | {counted / (1 << 20):.0f} MiB | {secs * 1e3:.1f} | {rate / MB:,.0f} | {ratio} |")
    print()

    enc_ratio = (frame_len / t_enc) / hmac_rate
    dec_ratio = (frame_len / t_dec) / hmac_rate
    checks = [
        ("encode+sign >= 70% of raw HMAC", enc_ratio >= HMAC_RATIO_TARGET, f"{enc_ratio:.0%}"),
        ("decode+verify >= 70% of raw HMAC", dec_ratio >= HMAC_RATIO_TARGET, f"{dec_ratio:.0%}"),
        (
            "bf16 encode >= 1000 MB/s (allocating call, the slower of the two)",
            nbytes / t_bf16_alloc / MB >= BF16_TARGET_MBPS,
            f"{nbytes / t_bf16_alloc / MB:,.0f} MB/s",
        ),
        (
            "fold (f32) >= 1000 MB/s",
            N_FOLD * nbytes / t_fold / MB >= FOLD_TARGET_MBPS,
            f"{N_FOLD * nbytes / t_fold / MB:,.0f} MB/s",
        ),
        (
            "fold (bf16) >= 1000 MB/s",
            bf16_fold_bytes / t_fold_bf16 / MB >= FOLD_TARGET_MBPS,
            f"{bf16_fold_bytes / t_fold_bf16 / MB:,.0f} MB/s",
        ),
    ]
    failed = 0
    for name, ok, got in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {name} (got {got})")
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
