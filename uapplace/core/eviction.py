"""Minimal eviction sets (docs/placement-rules.md §4.4): the exact smallest set of residents whose
displacement frees what a candidate needs, on the GPU and in host RAM.

Pure integer arithmetic, no registry: the planner (:mod:`uapplace.core.planner`) turns
each eligible resident into an :class:`EvictionItem` (:func:`eviction_item`), rounds
the need up (:func:`ceil_mib`) and asks :func:`minimal_eviction` for the set.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from uapplace.core.conflicts import EPSILON_MIB
from uapplace.core.model import Resident


@dataclass(frozen=True)
class EvictionItem:
    """One eligible victim in integer MiB: what it frees on the GPU and on the host."""

    resident: Resident
    gpu_mib: int
    host_mib: int


def minimal_eviction(
    items: Sequence[EvictionItem], need_gpu: int, need_host: int = 0
) -> tuple[EvictionItem, ...] | None:
    """The exact minimal set freeing ``≥ need_gpu`` GPU MiB and ``≥ need_host`` host MiB.

    Minimal means, in order: the fewest GPU MiB freed, then the fewest victims,
    then the lexically smallest sorted list of ``model/config`` signatures.
    ``()`` when nothing needs freeing, ``None`` when even every item together
    is not enough. Fractions are the caller's business: pass what each victim
    frees rounded down and the need rounded up.

    Both methods below are exact subset-sum searches over integer MiB; neither
    is greedy (largest-first and smallest-first both miss the optimum).
    """
    need_gpu = max(0, need_gpu)
    need_host = max(0, need_host)
    if need_gpu == 0 and need_host == 0:
        return ()
    ordered = sorted(items, key=lambda it: (it.resident.signature, it.resident.device))
    if need_host == 0:
        chosen = _fewest_mib_bitsets([it.gpu_mib for it in ordered], need_gpu)
    else:
        chosen = _fewest_mib_states(ordered, need_gpu, need_host)
    return None if chosen is None else tuple(ordered[i] for i in chosen)


def _lowest_bit_from(bits: int, start: int) -> int | None:
    high = bits >> start
    return None if high == 0 else start + (high & -high).bit_length() - 1


def _fewest_mib_bitsets(weights: Sequence[int], need: int) -> tuple[int, ...] | None:
    """GPU need only: reachable sums as integer bitsets, layered by victim count.

    ``layers[k]`` has bit ``s`` set when some k items sum to exactly ``s``. Only
    sums below ``need + max weight`` matter (a minimal set minus any member
    falls short), which bounds every bitset. First pass: the smallest sum
    ``≥ need`` and the fewest items reaching it. Second pass: the same layers
    over each suffix ``items[i:]``, so the lexically first set is picked item by
    item. Cost: O(n²) shifts of (need + max weight)-bit integers, each a few
    hundred machine words on a 24 GiB card: well under a millisecond for 64
    residents, and independent of how the sums are spread.
    """
    if not weights:
        return None
    width = need + max(weights)
    mask = (1 << width) - 1
    layers = [1] + [0] * len(weights)
    for weight in weights:
        for count in range(len(weights), 0, -1):
            layers[count] |= (layers[count - 1] << weight) & mask
    reach = 0
    for layer in layers:
        reach |= layer
    target = _lowest_bit_from(reach, need)
    if target is None:
        return None
    fewest = next(k for k, layer in enumerate(layers) if layer >> target & 1)
    # suffix[i][k]: sums of exactly k items among weights[i:], for k ≤ fewest.
    suffix = [[1] + [0] * fewest]
    for weight in reversed(weights):
        after = suffix[-1]
        here = [after[0]] + [
            after[k] | ((after[k - 1] << weight) & mask) for k in range(1, fewest + 1)
        ]
        suffix.append(here)
    suffix.reverse()
    chosen: list[int] = []
    left, count = target, fewest
    for index, weight in enumerate(weights):
        if count == 0:
            break
        if weight <= left and suffix[index + 1][count - 1] >> (left - weight) & 1:
            chosen.append(index)
            left -= weight
            count -= 1
    return tuple(chosen)


def _fewest_mib_states(
    ordered: Sequence[EvictionItem], need_gpu: int, need_host: int
) -> tuple[int, ...] | None:
    """GPU and host need: a dynamic programme over (GPU MiB, host MiB capped at the need).

    Items come in signature order, so adding one appends it to every set's
    sorted signature list and keeps the (count, lexical) order between two
    sets: keeping only the best set per state is exact. A set meeting both
    needs is finished and never extended (a superset frees more); a set that
    can no longer reach the need, or frees more GPU MiB than the best finished
    one, is dropped. Cost: O(n · S) for S ≤ min(2ⁿ, (need_gpu + max weight) ·
    (need_host + 1)) states. It only runs when host RAM is short, which with a
    handful of residents per device stays in milliseconds; it grows
    exponentially past about 20 residents on one device.
    """
    left_gpu = list(itertools.accumulate(reversed([it.gpu_mib for it in ordered]), initial=0))
    left_host = list(itertools.accumulate(reversed([it.host_mib for it in ordered]), initial=0))
    left_gpu.reverse()
    left_host.reverse()
    # (gpu freed, host freed capped at the need) -> (victim count, indices)
    states: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {(0, 0): (0, ())}
    best: tuple[int, int, tuple[int, ...]] | None = None
    for index, item in enumerate(ordered):
        for (gpu, host), (count, chosen) in list(states.items()):
            if (
                gpu + left_gpu[index] < need_gpu
                or host + left_host[index] < need_host
                or (best is not None and gpu > best[0])
            ):
                del states[(gpu, host)]
                continue
            key = (gpu + item.gpu_mib, min(need_host, host + item.host_mib))
            grown = (count + 1, (*chosen, index))
            if key[0] >= need_gpu and key[1] >= need_host:
                if best is None or (key[0], *grown) < best:
                    best = (key[0], *grown)
                continue
            current = states.get(key)
            if current is None or grown < current:
                states[key] = grown
    return None if best is None else best[2]


def eviction_item(resident: Resident) -> EvictionItem:
    """``resident`` as an item: what it frees rounded down, so a fraction never tips a fit."""
    return EvictionItem(
        resident,
        math.floor(resident.gpu_mib or 0.0),
        math.floor(resident.host_rss_mib or 0.0),
    )


def ceil_mib(mib: float) -> int:
    """A need in whole MiB, rounded up (past float noise): the other half of the rounding."""
    return math.ceil(mib - EPSILON_MIB)
