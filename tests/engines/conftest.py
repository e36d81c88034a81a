"""Tier 4 fixtures: the real ``llama-server``, tiny models, and the llama world.

docs/architecture.md ("Test tiers", tier 4).

- ``llama_server`` (session): the path of the ``llama-server`` that ``make engine``
  built and cached (:func:`uapplace.sim.llamacpp.llama_server_path`). Skips with the
  reason when it is not built; fails instead when ``UAPPLACE_REQUIRE_ENGINES=1`` (CI).
- ``tiny_models`` (session): :class:`tests.worlds.llama.TinyModels` in a session folder,
  each GGUF written once.
- ``user_manager`` (session): this tier's contained ``systemd --user``; skips (fails under
  ``UAPPLACE_REQUIRE_SYSTEMD=1``) where it cannot run, as ``tests/systemd`` does.
- ``units``: a connected :class:`UnitManager` on that manager's bus.
- ``world_models``: the :class:`~tests.worlds.llama.LlamaModel` list of the world a test
  builds: :data:`DEFAULT_MODELS` unless an indirect parametrize gives others.
- ``world_options``: more keyword arguments of :func:`tests.worlds.llama.llama_world`
  (``timeouts``, ``cpu_total_mib``, ``cpu_reserved_mib``): none unless a test overrides it.
- ``llama``: :func:`tests.worlds.llama.llama_world` for ``world_models``, stopped at the end.

On a failure the report carries the tail of the manager's log and the world's logs
(daemon, each engine).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.worlds.contained import log_tail
from tests.worlds.contained import units as units  # the tier's fixture
from tests.worlds.llama import LlamaModel, LlamaWorld, TinyModels, llama_world
from uapplace.io.units import UnitManager
from uapplace.sim.llamacpp import llama_server_path, missing_binary
from uapplace.sim.usermanager import ContainedUserManager, can_contain

REQUIRE_ENGINES = "UAPPLACE_REQUIRE_ENGINES"
DEFAULT_MODELS = (
    LlamaModel("alpha", "tiny-a", started=True),
    LlamaModel("beta", "tiny-b"),
)
"""Alpha (tiny-a) running and adopted as a resident, beta (tiny-b) stopped."""


def _unavailable(why: str, flag: str) -> None:
    if os.environ.get(flag) == "1":
        pytest.fail(f"{flag}=1 but {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def llama_server() -> Path:
    """The real ``llama-server`` (``make engine``); skip or fail when it is not there."""
    path = llama_server_path(os.environ)
    why = missing_binary(path)
    if why is not None:
        _unavailable(why, REQUIRE_ENGINES)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def user_manager() -> Iterator[ContainedUserManager]:
    ok, why = can_contain()
    if not ok:
        _unavailable(f"no contained systemd --user here: {why}", "UAPPLACE_REQUIRE_SYSTEMD")
    manager = ContainedUserManager(name_prefix="uapplace-engines")
    manager.start()
    yield manager
    manager.stop()


@pytest.fixture
def world_models(request: pytest.FixtureRequest) -> tuple[LlamaModel, ...]:
    """The world's models; tests override them with an indirect parametrize."""
    return tuple(getattr(request, "param", DEFAULT_MODELS))


@pytest.fixture
def world_options() -> dict[str, Any]:
    """More :func:`tests.worlds.llama.llama_world` keywords; a test module overrides it."""
    return {}


@pytest.fixture
async def llama(
    llama_server: Path,
    tiny_models: TinyModels,
    user_manager: ContainedUserManager,
    units: UnitManager,
    tmp_path: Path,
    world_models: tuple[LlamaModel, ...],
    world_options: dict[str, Any],
) -> AsyncIterator[LlamaWorld]:
    """The llama world (``tests/worlds/llama.py``) for ``world_models``."""
    async with llama_world(
        tmp_path,
        user_manager.bus_address,
        user_manager.unit_dir,
        units,
        llama_server,
        tiny_models,
        world_models,
        **world_options,
    ) as world:
        yield world


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On a failure, attach the manager's log tail and the world's logs."""
    report: pytest.TestReport = yield
    if not report.failed:
        return report
    funcargs = getattr(item, "funcargs", {})
    manager = funcargs.get("user_manager")
    if isinstance(manager, ContainedUserManager):
        report.sections.append(("contained systemd --user log (tail)", log_tail(manager)))
    world = funcargs.get("llama")
    if isinstance(world, LlamaWorld):
        report.sections.append(("llama world logs", world.logs()[-8000:]))
    return report
