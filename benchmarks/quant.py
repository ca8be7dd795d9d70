"""The delta codecs (flodl_trio.wire.quant): speed, error and bytes, by code and block size.

Run from the repository root::

    python benchmarks/quant.py              # 16 MiB of f32 deltas, best of 5
    python benchmarks/quant.py --mib 64 --reps 3

For int8, int4 and fp4 at blocks of 256 to 4096 elements it prints a markdown
table: bytes per value (the scales included), encode and decode rates on one
core (MB/s of f32 input), the error of one encode (RMS of what it drops,
relative to the delta's RMS) on two kinds of delta - Gaussian, and
heavy-tailed (Student's t, 3 degrees of freedom: a few large values set each
block's scale, as in real pseudo-gradients) - and what the payload costs on a
200 Mbit/s and a 1 Gbit/s link, next to the f32 frame's time there. Then the
CPU floor of a round's codec work beside the link floor. A benchmark, not a
test: pytest never collects it.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _machine import best_time, cpu_model  # noqa: E402  (this script's folder is on sys.path)

from flodl_trio.wire.quant import Code, decode, encode, payload_bytes  # noqa: E402

MB = 1_000_000
MiB = 1 << 20
BLOCKS = (256, 512, 1024, 2048, 4096)
LINKS = {"200 Mbit/s": 200e6 / 8, "1 Gbit/s": 1e9 / 8}


def deltas(numel: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "gaussian": rng.normal(0, 1e-3, numel).astype(np.float32),
        "heavy-tailed": (rng.standard_t(3, numel) * 1e-3).astype(np.float32),
    }


def relative_error(values: np.ndarray, code: Code, block: int) -> float:
    """RMS of what one encode drops, over the delta's RMS."""
    payload = bytearray(payload_bytes(code, values.size, block))
    residual = np.empty_like(values)
    encode(values, payload, code, block, residual=residual)
    return float(np.sqrt(np.mean(residual.astype(np.float64) ** 2)) / np.sqrt(np.mean(values.astype(np.float64) ** 2)))


def row(code: Code, block: int, kinds: dict[str, np.ndarray], reps: int) -> tuple[list[str], float]:
    values = kinds["heavy-tailed"]
    numel = values.size
    payload = bytearray(payload_bytes(code, numel, block))
    residual = np.empty_like(values)
    out = np.empty_like(values)
    t_encode = best_time(lambda: encode(values, payload, code, block, residual=residual), reps)
    t_decode = best_time(lambda: decode(payload, code, block, numel, out, add=True), reps)
    nbytes = len(payload)
    cells = [
        code.value, str(block), f"{8 * nbytes / numel:.3f}",
        f"{4 * numel / t_encode / MB:,.0f}", f"{4 * numel / t_decode / MB:,.0f}",
        *(f"{relative_error(kinds[k], code, block):.4f}" for k in ("gaussian", "heavy-tailed")),
        *(f"{nbytes / rate * 1e3:.0f}" for rate in LINKS.values()),
    ]
    return cells, t_encode + t_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=16, help="MiB of f32 deltas (default 16)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions, best taken (default 5)")
    args = ap.parse_args()
    numel = args.mib * MiB // 4
    kinds = deltas(numel, np.random.default_rng(0))
    print(f"python {platform.python_version()}, numpy {np.__version__}, {cpu_model()}; {args.mib} MiB of f32 deltas, "
          f"best of {args.reps}; rates on one core, MB/s of f32 input")
    f32_ms = {name: 4 * numel / rate * 1e3 for name, rate in LINKS.items()}
    print("f32 frame on the link: " + ", ".join(f"{name} {ms:.0f} ms" for name, ms in f32_ms.items()))
    print()
    header = ["code", "block", "bits/value", "encode MB/s", "decode MB/s", "rel. error gaussian",
              "rel. error heavy-tailed", *(f"ms on {name}" for name in LINKS)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    cpu: dict[tuple[Code, int], float] = {}
    for code in Code:
        for block in BLOCKS:
            cells, seconds = row(code, block, kinds, args.reps)
            cpu[code, block] = seconds
            print("| " + " | ".join(cells) + " |")
    print()
    for code in Code:
        seconds = cpu[code, 1024]
        nbytes = payload_bytes(code, numel, 1024)
        links = ", ".join(f"{name} {nbytes / rate * 1e3:.0f} ms" for name, rate in LINKS.items())
        print(f"{code.value} (block 1024): CPU floor of one encode + one decode {seconds * 1e3:.0f} ms on one core; "
              f"link floor of the payload {links}")


if __name__ == "__main__":
    main()
