"""The controller without a bus: real registry files, real ledger, simulated GPU."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from controller_fixtures import alpha_resident, registry, registry_paths

from tests.worlds.seed_docs import alpha_model
from uapplace.controller import views
from uapplace.controller.controller import Controller
from uapplace.controller.holds import ProxyHolders
from uapplace.controller.ports import ResidentRow
from uapplace.core.admission import REFUSED_WINDOW_S
from uapplace.core.alerts import Alert
from uapplace.core.errors import NotAuthorized, NotFound, UnknownModel
from uapplace.core.model import (
    Holder,
    ParkReason,
    PendingEntry,
    ResidentState,
    parse_iso,
)
from uapplace.files.ledger import Ledger, LedgerDoc
from uapplace.files.paths import Paths
from uapplace.io.engines import ProxyClient, ProxyTokenRejected
from uapplace.sim.engine import FakeEngine, parse_options

REGISTRY = registry({"alpha": alpha_model(rails=1, advertises=["alpha-chat"])})
START = parse_iso("2026-06-01T12:00:00Z")


class Recorder:
    """Collects what the controller reports (the bus service's side of the port)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def on_parked(self, entry: PendingEntry) -> None:
        self.seen.append(("parked", entry.id))

    def on_resolved(self, placement_id: str, outcome: str) -> None:
        self.seen.append(("resolved", (placement_id, outcome)))

    def on_resident_changed(self, row: ResidentRow) -> None:
        self.seen.append(("resident", row))

    def on_enforcement_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        self.seen.append(("step", (run_id, step, ok, detail)))

    def on_pending_count(self, count: int) -> None:
        self.seen.append(("pending_count", count))

    def on_residents(self, rows: list[ResidentRow]) -> None:
        self.seen.append(("residents", rows))

    def on_alert(self, alert: Alert) -> None:
        self.seen.append(("alert", (alert.kind.value, alert.severity.value, alert.subject)))

    def of(self, kind: str) -> list[Any]:
        return [value for seen_kind, value in self.seen if seen_kind == kind]


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return registry_paths(tmp_path, REGISTRY)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def events() -> Recorder:
    return Recorder()


@pytest.fixture
def controller(paths: Paths, clock: Clock, events: Recorder) -> Controller:
    return Controller.open(paths, clock=clock, events=events)


async def settle(controller: Controller) -> None:
    """Let scheduled after-answer work (Parked, planning) run to completion."""
    await asyncio.sleep(0)
    await controller.background_done()


async def test_a_new_park_is_reported_after_the_answer(
    controller: Controller, events: Recorder
) -> None:
    decision = controller.admit("alpha", "c1", "s", 0)
    assert decision.decision == "park" and decision.reason == "not_resident"
    assert events.of("parked") == []  # nothing runs before the answer is sent
    await settle(controller)
    assert events.of("parked") == [decision.placement_id]
    assert events.of("pending_count") == [1]
    entry = controller.admission.get(decision.placement_id)
    assert entry is not None and entry.options[0].config == "alpha-q4"

    again = controller.admit("alpha", "c1", "s", 0)
    await settle(controller)
    assert again.placement_id == decision.placement_id
    assert events.of("parked") == [decision.placement_id]


async def test_a_forward_touches_usage_and_persists_it(
    controller: Controller, clock: Clock, paths: Paths
) -> None:
    controller.upsert_resident(alpha_resident())
    decision = controller.admit("alpha-chat", "c1", "", 0)
    assert decision.decision == "forward"
    assert decision.target_id == "gpu0:http://127.0.0.1:18080"
    assert controller.usage == {"alpha": clock.now}
    await controller.flush()
    stored = Ledger(paths.ledger).read()
    assert stored.usage == {"alpha": clock.now}
    assert [r.model for r in stored.residents] == ["alpha"]
    assert stored.devices["gpu0"].source.value == "sim"


async def test_expired_entries_resolve_as_expired(
    controller: Controller, clock: Clock, events: Recorder
) -> None:
    placement_id = controller.admit("alpha", "c1", "", 0).placement_id
    await settle(controller)
    assert controller.expire() == []
    clock.now += controller.admission.ttl + 1
    assert [e.id for e in controller.expire()] == [placement_id]
    assert events.of("resolved") == [(placement_id, "expired")]
    assert controller.pending_count == 0


async def test_a_resident_that_serves_a_park_resolves_it_as_forwarded(
    controller: Controller, events: Recorder
) -> None:
    placement_id = controller.admit("alpha-chat", "c1", "", 0).placement_id
    await settle(controller)
    controller.upsert_resident(alpha_resident(ResidentState.WARMING))
    assert events.of("resolved") == []  # not verified yet: not published (publication)
    assert events.of("resident")[-1] == ("alpha", "alpha-q4", "gpu0", "warming")
    controller.upsert_resident(alpha_resident(ResidentState.HOT))
    assert events.of("resolved") == [(placement_id, "forwarded")]
    controller.drop_resident("alpha", "alpha-q4", "gpu0")
    assert events.of("resident")[-1] == ("alpha", "alpha-q4", "gpu0", "gone")
    assert controller.admit("alpha", "c1", "", 0).decision == "park"
    await settle(controller)


async def test_dismiss_and_unknown_ids(controller: Controller, events: Recorder) -> None:
    placement_id = controller.admit("alpha", "c1", "", 0).placement_id
    await settle(controller)
    assert controller.dismiss(placement_id) is True
    assert events.of("resolved") == [(placement_id, "dismissed")]
    with pytest.raises(NotFound, match=f"no pending placement {placement_id}"):
        controller.dismiss(placement_id)


async def test_a_dismissed_or_expired_request_is_refused_not_prompted_again(
    controller: Controller, clock: Clock, events: Recorder
) -> None:
    """Issue 21 item 2: the same client's retry gets ``refused`` with the old id, no new
    park (no ``parked`` event, so no notification); after the window it parks afresh."""
    dismissed = controller.admit("alpha", "c1", "", 0).placement_id
    expired = controller.admit("alpha", "c2", "", 0).placement_id
    await settle(controller)
    clock.now += controller.admission.ttl - 1
    controller.dismiss(dismissed)
    clock.now += 2
    assert controller.admit("alpha", "c2", "", 0).reason == "refused"  # expired, not swept
    controller.expire()
    parked_before = len(events.of("parked"))
    for client, placement_id in (("c1", dismissed), ("c2", expired)):
        again = controller.admit("alpha", client, "", 0)
        assert (again.decision, again.placement_id, again.reason) == (
            "park",
            placement_id,
            "refused",
        )
    await settle(controller)
    assert len(events.of("parked")) == parked_before and controller.pending_count == 0
    assert controller.admit("alpha", "c3", "", 0).reason == "not_resident"  # others park
    clock.now += REFUSED_WINDOW_S + 1
    controller.expire()
    fresh = controller.admit("alpha", "c1", "", 0)
    assert fresh.reason == "not_resident" and fresh.placement_id != dismissed
    await settle(controller)


async def test_mark_failed_keeps_the_entry_with_reason_failed(
    controller: Controller, paths: Paths
) -> None:
    placement_id = controller.admit("alpha", "c1", "", 0).placement_id
    await settle(controller)
    controller.mark_failed(placement_id)
    assert controller.admit("alpha", "c1", "", 0).reason == "failed"
    await controller.flush()
    [stored] = Ledger(paths.ledger).read().pending
    assert (stored.id, stored.reason) == (placement_id, ParkReason.FAILED)
    controller.mark_failed("plc-ffffff")  # gone: nothing to mark


async def test_an_entry_resolved_failed_answers_failed_not_a_new_prompt(
    controller: Controller, events: Recorder
) -> None:
    """An incomplete rollback resolves the entry ``failed``: the client's retry says so."""
    placement_id = controller.admit("alpha", "c1", "", 0).placement_id
    await settle(controller)
    assert controller.resolve_pending_id(placement_id, "failed")
    retry = controller.admit("alpha", "c1", "", 0)
    assert (retry.placement_id, retry.reason) == (placement_id, "failed")
    assert controller.pending_count == 0


def test_restore_drops_expired_entries_and_live_holders(
    controller: Controller, clock: Clock
) -> None:
    def entry(placement_id: str, client: str, expires_at: float) -> PendingEntry:
        return PendingEntry(
            placement_id, "alpha", client, None, START - 10, expires_at, ParkReason.NOT_RESIDENT
        )

    held = replace(alpha_resident(), holders=(Holder("x", "hold", cookie=3),))
    doc = LedgerDoc(
        residents=[held],
        pending=[entry("plc-000001", "a", START + 60), entry("plc-000002", "b", START - 1)],
        usage={"alpha": START - 5},
        cooldowns={"alpha": START - 1},
    )
    controller.restore(doc)
    assert [e.id for e in controller.pending_entries()] == ["plc-000001"]
    assert controller.residents[0].holders == ()
    assert controller.usage == {"alpha": START - 5}
    assert controller.cooldowns == {}


async def test_holds_pin_residents_and_end_with_their_sender(controller: Controller) -> None:
    controller.upsert_resident(alpha_resident())
    cookie = await controller.hold("alpha-chat", "eval", "bench", ":1.42")
    (pinned,) = controller.residents_with_holders(None)
    assert [(h.kind, h.client, h.cookie) for h in pinned.holders] == [("hold", "bench", cookie)]
    controller.drop_holds_of(":1.41")
    assert cookie in controller.holds
    controller.drop_holds_of(":1.42")
    assert controller.holds == {}
    with pytest.raises(NotFound):
        controller.release(cookie, ":1.42")
    with pytest.raises(UnknownModel):
        await controller.hold("nope", "eval", "bench", ":1.42")


async def test_only_the_holder_releases_unless_authorized_for_others(
    controller: Controller,
) -> None:
    cookie = await controller.hold("alpha", "eval", "bench", ":1.42")
    assert controller.hold_owner(cookie) == ":1.42"
    with pytest.raises(NotAuthorized, match=r"belongs to bus connection :1\.42 \(bench\)"):
        controller.release(cookie, ":1.7")
    assert cookie in controller.holds
    controller.release(cookie, ":1.7", may_release_others=True)  # polkit said yes
    assert controller.holds == {}
    again = await controller.hold("alpha", "eval", "bench", ":1.42")
    controller.release(again, ":1.42")
    assert controller.holds == {}


async def test_a_bad_reload_keeps_the_last_good_registry(
    controller: Controller, paths: Paths
) -> None:
    paths.repo_registry.write_text("{")
    report = await views.validate(controller)
    assert report["ok"] is False
    assert report["findings"][0]["file"] == str(paths.repo_registry)
    assert "alpha" in controller.registry.models
    assert controller.admit("alpha", "c9", "", 0).reason == "not_resident"
    # The operator's edit is ignored: said where they look (banner, notification), not only logged.
    (alert,) = [a.to_json() for a in controller.alerts.active()]
    assert (alert["kind"], alert["severity"]) == ("config_error", "warning")
    assert alert["subject"] == str(paths.repo_registry)
    assert "keeps placing with the last good one" in alert["message"]
    paths.repo_registry.write_text(json.dumps(REGISTRY))
    assert (await views.validate(controller))["ok"] is True
    assert controller.reload_error is None


async def test_shutdown_flushes_pending_entries(controller: Controller, paths: Paths) -> None:
    controller.start_background()
    placement_id = controller.admit("alpha", "c1", "", 0).placement_id
    await settle(controller)
    await controller.shutdown(wait_s=1)
    stored = Ledger(paths.ledger).read()
    assert [p.id for p in stored.pending] == [placement_id]
    assert stored.pending[0].options[0].config == "alpha-q4"


# --------------------------------------------------------------------------- issue 13


async def test_a_proxy_401_raises_one_token_mismatch_alert_and_stays_an_error(
    paths: Paths, clock: Clock, events: Recorder
) -> None:
    async def refuse(_: web.Request) -> web.Response:
        return web.json_response({"error": "missing or wrong bearer token"}, status=401)

    app = web.Application()
    app.router.add_get("/internal/placement/inflight", refuse)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    proxy = ProxyHolders(ProxyClient(f"http://{host}:{port}", "wrong"))
    controller = Controller.open(paths, clock=clock, events=events, proxy=proxy)
    try:
        for _ in range(3):  # a drain stops on it; the alert is raised once
            with pytest.raises(ProxyTokenRejected, match="HTTP 401"):
                await controller.inflight(raise_token_rejected=True)
        assert await controller.inflight() is None  # a plan: unknown, counted as busy
    finally:
        await runner.cleanup()
    assert events.of("alert") == [("token_mismatch", "critical", controller.paths.proxy_url)]
    (alert,) = controller.alerts.active()
    assert "different tokens" in alert.message


async def test_get_state_carries_counters_and_target_rails(controller: Controller) -> None:
    controller.admit("alpha", "c1", "", 0)
    controller.upsert_resident(alpha_resident())
    state = await views.state_json(controller)
    assert state["counters"]["admits"] == [
        {"decision": "park", "reason": "not_resident", "count": 1}
    ]
    (target,) = state["targets"]
    assert target["target_id"] == "gpu0:http://127.0.0.1:18080"
    # Nothing listens there: the declared figure, and the probe failure said as such.
    assert (target["rails"], target["rails_source"], target["state"]) == (
        1,
        "registry",
        "probe_failed",
    )


async def test_validate_warns_when_the_live_rails_disagree(controller: Controller) -> None:
    engine = FakeEngine(parse_options(["--port", "0", "--model-id", "alpha", "--parallel", "2"]))
    await engine.finish_loading()
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        controller.upsert_resident(replace(alpha_resident(), endpoint=f"http://{host}:{port}"))
        report = await views.validate(controller)
    finally:
        await runner.cleanup()
    (warning,) = [f for f in report["findings"] if f["json_path"] == "$.models.alpha.rails"]
    assert warning["severity"] == "warning"
    assert "declares rails 1" in warning["message"] and "reports 2" in warning["message"]
    assert "the gate uses 1" in warning["message"]
