"""In-process latency of ``Admission.decide`` (the admit hot path), run by hand.

    .venv/bin/python bench/bench_admission.py [--iterations N] [--rounds R]

Grid: 1 / 100 / 1,000 pending entries × 1 / 16 / 64 residents, for three
answers: a forward (by an advertised id), a park that hits the dedupe map, and
a park that creates a new entry (removed again outside the timed call, so the
pending count stays put). Prints median and p99 in µs per cell and, per
answer, the ratio of the largest case (1,000 × 64) to the smallest (1 × 1)
measured in the same run. The cells are interleaved over several shuffled
rounds (each with its own warm-up) so that drift hits every cell alike.
Target: flat (ratio ≤ 1.2) and well under 1 ms.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable

from uapplace.core.admission import Admission
from uapplace.core.model import (
    Config,
    ConfigStatus,
    Device,
    DeviceKind,
    Model,
    Registry,
    Resident,
    ResidentState,
)

PENDING = (1, 100, 1_000)
RESIDENTS = (1, 16, 64)
KINDS = ("forward", "dedupe park", "new park")
WARMUP = 500
NOW = 1_800_000_000.0
SPARE = "spare-model"


def build_registry(models: int) -> Registry:
    config = Config(
        "cfg",
        ConfigStatus.MEASURED,
        resident_gpu_mib=1_000,
        host_rss_mib=1_000,
        kv_resident_cells=32_768,
        measured_at="2026-10-08T14:02:00Z",
        measured_on="gpu0",
    )
    entries = {}
    for i in range(models):
        key = f"model-{i:03}"
        cfg = Config(**{**config.__dict__, "key": f"cfg-{i:03}"})
        entries[key] = Model(key, key, "llama.cpp", {cfg.key: cfg}, advertises=(f"adv-{i:03}",))
    spare_cfg = Config(**{**config.__dict__, "key": "spare-cfg"})
    entries[SPARE] = Model(SPARE, SPARE, "llama.cpp", {spare_cfg.key: spare_cfg})
    devices = {f"gpu{i}": Device(f"gpu{i}", DeviceKind.GPU, 143_771, 2_048) for i in range(4)}
    return Registry(devices, entries)


def build_admission(registry: Registry, pending: int, residents: int) -> Admission:
    admission = Admission(registry)
    admission.set_residents(
        [
            Resident(
                model=f"model-{i:03}",
                config=f"cfg-{i:03}",
                device=f"gpu{i % 4}",
                engine="llama.cpp",
                endpoint=f"http://127.0.0.1:{8080 + i}",
                unit=f"unit-{i:03}",
                state=ResidentState.HOT,
                gpu_mib=1_000,
                host_rss_mib=1_000,
                since="2026-10-08T09:14:02Z",
            )
            for i in range(residents)
        ]
    )
    for i in range(pending):
        admission.decide(SPARE, f"seed-{i}", "session", None, NOW)
    assert len(admission.pending) == pending
    return admission


def timed(call: Callable[[int], object], iterations: int) -> list[int]:
    for i in range(WARMUP):
        call(i)
    gc.collect()
    samples = []
    clock = time.perf_counter_ns
    for i in range(iterations):
        start = clock()
        call(i)
        samples.append(clock() - start)
    return samples


def measure(admission: Admission, residents: int, kind: str, iterations: int) -> list[int]:
    forward_id = f"adv-{residents - 1:03}"
    if kind == "forward":

        def call(_: int) -> object:
            decision, _entry = admission.decide(forward_id, "bench", None, None, NOW)
            return decision

        samples = timed(call, iterations)
        assert admission.decide(forward_id, "bench", None, None, NOW)[0].decision == "forward"
        return samples
    if kind == "dedupe park":

        def call(_: int) -> object:
            return admission.decide(SPARE, "seed-0", None, None, NOW)

        return timed(call, iterations)

    clock = time.perf_counter_ns
    samples = []
    for i in range(WARMUP + iterations):
        start = clock()
        _, entry = admission.decide(SPARE, f"new-{i}", None, None, NOW)
        elapsed = clock() - start
        assert entry is not None
        admission.remove(entry.id)
        if i >= WARMUP:
            samples.append(elapsed)
    return samples


def p99(samples: list[int]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40_000, help="timed calls per cell")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved passes over the grid")
    args = parser.parse_args()
    registry = build_registry(max(RESIDENTS))
    admissions = {
        (pending, residents): build_admission(registry, pending, residents)
        for pending in PENDING
        for residents in RESIDENTS
    }
    cells = [(kind, p, r) for kind in KINDS for (p, r) in admissions]
    per_round = max(1, args.iterations // args.rounds)
    samples: dict[tuple[str, int, int], list[int]] = {cell: [] for cell in cells}
    round_medians: dict[tuple[str, int, int], list[float]] = {cell: [] for cell in cells}
    # Interleave the cells over several shuffled passes, so that clock ramp-up or a
    # neighbour's burst lands on every cell alike instead of on whichever ran first.
    order = random.Random(4)
    for _ in range(args.rounds):
        order.shuffle(cells)
        for kind, pending, residents in cells:
            admission = admissions[(pending, residents)]
            got = measure(admission, residents, kind, per_round)
            samples[(kind, pending, residents)] += got
            round_medians[(kind, pending, residents)].append(statistics.median(got) / 1_000)
    results = {
        cell: (statistics.median(s) / 1_000, p99(s), min(round_medians[cell]))
        for cell, s in samples.items()
    }
    total = per_round * args.rounds
    print(f"Admission.decide: {total} timed calls per cell in {args.rounds} interleaved rounds")
    print("best round = the lowest of the per-round medians (least disturbed by neighbours)\n")
    header = f"{'answer':<12} {'pending':>8} {'residents':>10}"
    print(f"{header} {'median µs':>10} {'p99 µs':>8} {'best round µs':>14}")
    for kind in KINDS:
        for pending in PENDING:
            for residents in RESIDENTS:
                median, tail, best = results[(kind, pending, residents)]
                row = f"{kind:<12} {pending:>8} {residents:>10}"
                print(f"{row} {median:>10.2f} {tail:>8.2f} {best:>14.2f}")
    print("\nratio largest (1000 pending × 64 residents) / smallest (1 × 1):")
    print(f"  {'answer':<12} {'median':>7} {'p99':>7} {'best round':>11}")
    for kind in KINDS:
        small = results[(kind, PENDING[0], RESIDENTS[0])]
        large = results[(kind, PENDING[-1], RESIDENTS[-1])]
        ratios = [f"{big / little:.2f}×" for big, little in zip(large, small, strict=True)]
        print(f"  {kind:<12} {ratios[0]:>7} {ratios[1]:>7} {ratios[2]:>11}")


if __name__ == "__main__":
    main()
