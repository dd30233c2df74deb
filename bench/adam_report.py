"""What bench/adam.py prints from its timings: per-round paired ratios between methods, the kernel's goals
(docs/kernel.md) on them, and the bytes per parameter behind those goals."""
from __future__ import annotations

import statistics

BYTES_PER_PARAM = 28   # one pass of an Adam step, fp32 or bf16 (bench/adam.py's docstring); "GB/s" is this x N / s
# with bf16 moments a pass moves 8 B fewer per parameter (hardware/cpu_adam.py adam_kernel_bytes): their rows'
# "GB/s" counts the bytes they move
BF16_MOMENT_BYTES_SAVED = 8
# int8 moments: 1.25 B per moment and direction (a code + a quarter of a block's 4-byte scale) instead of 4, so
# p 4R 4W, g 4R (or 2R + a 2-B bf16 copy W), m 1.25R 1.25W, v 1.25R 1.25W = 17 B per parameter
INT8_MOMENT_BYTES_SAVED = 11


def fmt_size(n):
    return f"{n >> 20}M" if n % (1 << 20) == 0 else str(n)


def summary(times, n, bytes_per_param=BYTES_PER_PARAM):
    med = statistics.median(times)
    return med, min(times), max(times), bytes_per_param * n / med / 1e9


def bytes_per_param(method: str) -> int:
    if "int8 moments" in method:
        return BYTES_PER_PARAM - INT8_MOMENT_BYTES_SAVED
    return BYTES_PER_PARAM - (BF16_MOMENT_BYTES_SAVED if "bf16 moments" in method else 0)


# Ratios: the methods run round-robin, so round i of every method saw about the same machine load. Each
# ratio is therefore taken per round (time_a[i] / time_b[i]) and summarised by its median and quartiles.
RATIOS = [  # (label, numerator method, denominator method): > 1 means the denominator is faster
    ("ours in-place / ceiling (regular stores) [ceiling fraction]", "ceiling in-place", "ours in-place"),
    ("ours in-place / ceiling with streaming stores", "ceiling in-place, streaming", "ours in-place"),
    ("ceiling streaming vs regular stores, in-place", "ceiling in-place", "ceiling in-place, streaming"),
    ("ours streaming vs auto stores, in-place", "ours in-place", "ours in-place, streaming"),
    ("bf16 copy streamed (auto) vs regular stores, in-place", "ours in-place, regular", "ours in-place"),
    ("ours ping-pong / ping-pong ceiling", "ceiling ping-pong", "ours ping-pong"),
    ("ours vs torch fused", "torch fused", "ours in-place"),
    ("ours vs torch foreach", "torch foreach", "ours in-place"),
    ("ours vs DeepSpeedCPUAdam", "deepspeed", "ours in-place"),
    ("ours, 1 call per tensor vs DeepSpeedCPUAdam", "deepspeed", "ours in-place, 1 call per tensor"),
    ("one multi-tensor call vs 1 call per tensor", "ours in-place, 1 call per tensor", "ours in-place"),
    ("dynamic vs static block schedule", "ours in-place, static schedule", "ours in-place"),
    ("software prefetch vs none, in-place", "ours in-place", "ours in-place, prefetch"),
    ("software prefetch vs none, ping-pong", "ours ping-pong", "ours ping-pong, prefetch"),
    ("software prefetch vs none, ceiling in-place", "ceiling in-place", "ceiling in-place, prefetch"),
    ("software prefetch vs none, ceiling ping-pong", "ceiling ping-pong", "ceiling ping-pong, prefetch"),
    ("ping-pong with prefetch vs in-place with prefetch", "ours in-place, prefetch", "ours ping-pong, prefetch"),
    ("ping-pong vs in-place (ours)", "ours in-place", "ours ping-pong"),
    ("ping-pong vs in-place (ceiling)", "ceiling in-place", "ceiling ping-pong"),
    ("ping-pong: streaming (auto) vs regular stores", "ours ping-pong, regular", "ours ping-pong"),
    ("ours ping-pong vs torch fused (in-place)", "torch fused", "ours ping-pong"),
    ("ours ping-pong vs DeepSpeedCPUAdam", "deepspeed", "ours ping-pong"),
    ("bf16 moments: ours in-place / its ceiling [ceiling fraction]", "ceiling in-place, bf16 moments",
     "ours in-place, bf16 moments"),
    ("bf16 moments: ours ping-pong / its ceiling", "ceiling ping-pong, bf16 moments", "ours ping-pong, bf16 moments"),
    ("bf16 moments vs fp32 moments, in-place (speed-up)", "ours in-place", "ours in-place, bf16 moments"),
    ("bf16 moments vs fp32 moments, ping-pong (speed-up)", "ours ping-pong", "ours ping-pong, bf16 moments"),
    ("int8 moments: ours in-place / its ceiling [ceiling fraction]", "ceiling in-place, int8 moments",
     "ours in-place, int8 moments"),
    ("int8 moments: ours ping-pong / its ceiling", "ceiling ping-pong, int8 moments", "ours ping-pong, int8 moments"),
    ("int8 moments vs fp32 moments, in-place (speed-up)", "ours in-place", "ours in-place, int8 moments"),
    ("int8 moments vs fp32 moments, ping-pong (speed-up)", "ours ping-pong", "ours ping-pong, int8 moments"),
]


def paired(alltimes, k, num, den):
    if (k, num) not in alltimes or (k, den) not in alltimes:
        return None
    rs = sorted(a / b for a, b in zip(alltimes[(k, num)], alltimes[(k, den)]))
    q = statistics.quantiles(rs, n=4) if len(rs) >= 2 else [rs[0], rs[0], rs[0]]
    return statistics.median(rs), q[0], q[2], rs[0], rs[-1]


def print_ratios(configs, alltimes):
    """Per-round paired ratios, then the kernel's goals on their medians."""
    print("Paired ratios (per round, time_numerator / time_denominator; > 1: the second-named side is faster): "
          "median [quartiles] (min-max)")
    goals = []
    for k in configs:
        n, nt, mode = k
        tag = f"{fmt_size(n)} x{nt} {mode}"
        for label, num, den in RATIOS:
            r = paired(alltimes, k, num, den)
            if r is not None:
                print(f"  {tag:<14} {label:<62} {r[0]:5.2f} [{r[1]:.2f}-{r[2]:.2f}] ({r[3]:.2f}-{r[4]:.2f})")
        get = lambda num, den: (paired(alltimes, k, num, den) or [None])[0]  # noqa: E731
        if mode == "fp32" and n >= 128 << 20:
            goals.append((f"{tag}: ours >= 95% of ceiling", get("ceiling in-place", "ours in-place"), 0.95))
            goals.append((f"{tag}: ours >= 1.1x torch fused", get("torch fused", "ours in-place"), 1.1))
        if mode == "bf16":
            goals.append((f"{tag}: ours >= 1.8x torch fused + casts", get("torch fused", "ours in-place"), 1.8))
        goals.append((f"{tag}: ping-pong no slower than in-place (within 3% noise)",
                      get("ours in-place", "ours ping-pong"), 0.97))
        goals.append((f"{tag}: never slower than DeepSpeedCPUAdam", get("deepspeed", "ours in-place"), 1.0))
        if n >= 128 << 20:
            goals.append((f"{tag}: bf16 moments >= 95% of their ceiling",
                          get("ceiling in-place, bf16 moments", "ours in-place, bf16 moments"), 0.95))
        if n >= 128 << 20:
            goals.append((f"{tag}: int8 moments >= 95% of their ceiling",
                          get("ceiling in-place, int8 moments", "ours in-place, int8 moments"), 0.95))
        if mode == "fp32" and n >= 128 << 20:   # 28 / 20 B per parameter: 1.4x at the memory ceiling
            goals.append((f"{tag}: bf16 moments >= 1.3x the fp32-moment step",
                          get("ours in-place", "ours in-place, bf16 moments"), 1.3))
        print()
    print("Goals, on the medians of the paired ratios")
    for text, value, goal in goals:
        state = "n/a " if value is None else ("PASS" if value >= goal else "MISS")
        shown = "not measured" if value is None else f"{value:.2f} (goal >= {goal})"
        print(f"  [{state}] {text}: {shown}")


# Bytes per parameter that each method must move through DRAM at 128M params (nothing stays in cache). A
# regular store to a line that is not in cache first reads it (read-for-ownership, RFO), a streaming store
# does not; a store to a line the same pass just read needs no extra read.
TORCH_CASTS_BYTES = {
    "cast grads bf16 -> fp32 .grad (read 2, write 4, RFO 4)": 10,
    "fused AdamW, in place (read 16, write 12)": 28,
    "cast params fp32 -> bf16 copy (read 4, write 2, RFO 2)": 8,
}


def print_bytes_arithmetic(configs, alltimes):
    torch_b = sum(TORCH_CASTS_BYTES.values())
    print("\nBytes per parameter behind the goals (DRAM traffic at sizes far above the caches)")
    print("  fp32 in place: ours 28 B = torch fused 28 B = the ceiling's 28 B. At equal bandwidth the best possible "
          "ratio is 28/28 = 1.00x; 1.1x over a torch that runs at the ceiling needs <= 28/1.1 = 25.5 B/param, "
          "less than the step's own reads and writes.")
    print("  bf16 grads in, bf16 param copy out: ours 28 B (read p 4, g 2, m 4, v 4; write p m v 12, bf16 copy 2 "
          "streamed, no RFO); torch fused + casts " + " + ".join(f"{b}" for b in TORCH_CASTS_BYTES.values())
          + f" = {torch_b} B:")
    for text, b in TORCH_CASTS_BYTES.items():
        print(f"      {b:2d} B  {text}")
    print(f"    best possible ratio at equal bandwidth {torch_b}/28 = {torch_b / 28:.2f}x (without the RFOs "
          f"{torch_b - 6}/28 = {(torch_b - 6) / 28:.2f}x); 1.8x would need ours <= {torch_b / 1.8:.1f} B/param.")
    for k in configs:
        n, nt, mode = k
        r = paired(alltimes, k, "torch fused", "ceiling in-place")
        if mode == "bf16" and r is not None:
            print(f"    {fmt_size(n)} x{nt}: torch fused + casts took {r[0]:.2f}x the 28-B ceiling pass, i.e. it moved "
                  f"~{28 * r[0]:.0f} B/param at ceiling speed")
