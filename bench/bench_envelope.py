"""The enforcement envelope as ``uapplace measure --envelope`` measures it (issue 12).

Builds the demo's sandbox (:class:`uapplace.demo.sandbox.Sandbox`: contained ``systemd --user``,
simulated GPU, fake engines as real units running the vLLM sleep API, ``uapplaced``) with
a slow cold start and wake (default 20 s and 1.5 s, like the issue's bench), then calls
``MeasureEnvelope`` over the bus for ``coder-7b`` and prints the envelope, how far each
figure lies above the engine's own delay (the measurement's overhead and resolution),
and the waits enforcement derives from it (:class:`uapplace.files.timeouts.Timeouts`).
Needs root (contained manager). Run by hand, never as a test::

    .venv/bin/python bench/bench_envelope.py [--cold-secs 20] [--wake-secs 1.5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from contextlib import AsyncExitStack
from typing import Any

from uapplace.bus.client import PlacementClient
from uapplace.core.model import Config, ConfigStatus, Envelope
from uapplace.demo.sandbox import CODER, Sandbox, SandboxSpec
from uapplace.files.timeouts import Timeouts


async def resident(client: PlacementClient, model: str, guard_s: float) -> None:
    deadline = time.monotonic() + guard_s
    while time.monotonic() < deadline:
        state = await client.get_state()
        if any(r["model"] == model and r["state"] == "hot" for r in state["residents"]):
            return
        await asyncio.sleep(0.1)
    raise SystemExit(f"{model} not resident after {guard_s:g}s")


async def run(cold_s: float, wake_s: float) -> dict[str, Any]:
    spec = SandboxSpec(load_secs=cold_s, wake_secs=wake_s, resident=CODER, shim=False)
    async with AsyncExitStack() as stack:
        box = await Sandbox.create(stack, spec, contain=True)
        client = await PlacementClient.connect(box.bus_address, call_timeout=20 * cold_s + 120)
        stack.callback(client.disconnect)
        await resident(client, CODER.key, 3 * cold_s + 30)
        started = time.monotonic()
        impact: dict[str, Any] = await client.preview_unload(CODER.key)
        result: dict[str, Any] = await client.measure_envelope(
            CODER.key, CODER.config, impact["signature"]
        )
        result["took_s"] = round(time.monotonic() - started, 2)
        return result


def report(result: dict[str, Any], cold_s: float, wake_s: float) -> None:
    raw = result["envelope"]
    envelope = Envelope(**raw)
    print(f"envelope of {result['model']}/{result['config']} ({result['took_s']}s to measure):")
    delays = {"cold_start_s": cold_s, "warm_start_s": cold_s, "wake_s": wake_s}
    for name, value in raw.items():
        over = ""
        if name in delays:
            over = f"  (+{(value - delays[name]) * 1000:.0f} ms over the engine's delay)"
        print(f"  {name:16} {value}{over}")
    config = Config(key="c", status=ConfigStatus.MEASURED, envelope=envelope)
    timeouts = Timeouts()
    label = f"{result['model']}/{result['config']}"
    print("derived waits (Timeouts defaults):")
    for what, bound in (
        ("drain", timeouts.drain_bound((label, config), [(label, config)])),
        ("verify-free", timeouts.verify_free_bound([(label, config)])),
        ("verify-up", timeouts.verify_up_bound(label, config, timeouts.verify_up_s)),
        ("wake", timeouts.wake_bound(label, config, timeouts.verify_up_s)),
    ):
        print(f"  {what:12} {bound.text()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold-secs", type=float, default=20.0)
    parser.add_argument("--wake-secs", type=float, default=1.5)
    args = parser.parse_args()
    result = asyncio.run(run(args.cold_secs, args.wake_secs))
    report(result, args.cold_secs, args.wake_secs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
