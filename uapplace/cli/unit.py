"""``uapplace unit add|list|show|remove``: backend units from the tracked templates.

``unit add NAME --engine llama.cpp|vllm|fake --model PATH --port N [-- engine flags]``
writes ``$XDG_CONFIG_HOME/systemd/user/uap-NAME.service`` from
``systemd/templates/<engine>.service`` (hardened as the shim's unit is; never enabled:
uapplaced starts and stops it; filled by :mod:`uapplace.files.unit_template`, which
writes the demo's engine units too) and the model ``NAME`` in the machine-local registry
(:mod:`uapplace.files.backend_entry`), unmeasured: it places nothing until
``uapplace measure NAME`` records its footprint. Then the user manager reloads and
uapplaced re-reads the registry (``Validate``), whose findings on the new model are
shown: a generated unit is checked like a hand-written one.

The unit file's first line is :data:`UNIT_MARKER`: ``list`` shows and ``remove`` removes
only such files. ``remove`` asks uapplaced first and refuses a resident (and refuses
without uapplaced, as every write does: it cannot know what is resident).

Engines (what ``ExecStart=`` runs, listening on 127.0.0.1 and serving the id ``NAME``):
``llama.cpp``: ``llama-server --model PATH --host 127.0.0.1 --port N --alias NAME``;
``vllm``: ``vllm serve PATH --host 127.0.0.1 --port N --served-model-name NAME``;
``fake``: uapplace's simulated engine (the demo and the tests), which speaks llama.cpp's
routes and is registered as ``llama.cpp``. ``--binary`` names the program (default: on
``PATH``; the fake engine runs under this Python).
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from uapplace.bus.client import PlacementClient
from uapplace.cli.forward import UNIT_HELP
from uapplace.cli.session import (
    EXIT_NOT_FOUND,
    EXIT_REFUSED,
    EXIT_USAGE,
    Unreachable,
    call,
    call_or,
    fail,
    out,
    print_json,
)
from uapplace.cli.typer_app import JsonFlag
from uapplace.files.backend_entry import remove_local_model, write_local_model
from uapplace.files.jsonfile import ConfigFileError, atomic_write, read_json
from uapplace.files.paths import Paths
from uapplace.files.registry_write import read_local
from uapplace.files.unit_template import ENGINES, EngineUnit, TemplateError, render_unit
from uapplace.io.units import UnitManager

UNIT_MARKER = "Written by `uapplace unit add`; `uapplace unit remove` removes it."
UNIT_PREFIX = "uap-"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
REGISTRY_ENGINE = {"llama.cpp": "llama.cpp", "vllm": "vllm", "fake": "llama.cpp"}
"""The registry's ``engine`` per template: the fake engine speaks llama.cpp's routes."""
DEFAULT_BINARY = {"llama.cpp": "llama-server", "vllm": "vllm"}
DEFAULT_CONFIG = "default"
RELOAD_TIMEOUT_S = 10.0

app = typer.Typer(
    help=UNIT_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

NameArg = Annotated[
    str,
    typer.Argument(
        metavar="NAME",
        help="Model key; the unit is uap-NAME.service (a-z, 0-9, _ and -).",
    ),
]


@dataclass(frozen=True)
class Backend:
    """What ``unit add`` was asked for, checked."""

    name: str
    engine: str
    model: str
    port: int
    binary: str
    flags: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    device: str | None
    config: str

    @property
    def unit(self) -> str:
        return f"{UNIT_PREFIX}{self.name}"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        listen = ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.engine == "llama.cpp":
            served = ["--model", self.model, *listen, "--alias", self.name]
            return [self.binary, *served, *self.flags]
        if self.engine == "vllm":
            served = ["serve", self.model, *listen, "--served-model-name", self.name]
            return [self.binary, *served, *self.flags]
        fake = ["-m", "uapplace.sim.engine", "--port", str(self.port), "--model-id", self.name]
        return [self.binary, *fake, *self.flags]

    def registry_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "display": self.name,
            "engine": REGISTRY_ENGINE[self.engine],
            "unit": self.unit,
            "endpoint": self.endpoint,
            "configs": {self.config: {"status": "unmeasured"}},
        }
        if self.device is not None:
            entry["affinity"] = {"device": [self.device]}
        return entry


def unit_path(paths: Paths, name: str) -> Path:
    return paths.user_unit_dir / f"{UNIT_PREFIX}{name}.service"


def render(backend: Backend) -> str:
    """The unit file: the engine's template with this backend's command and environment."""
    unit = EngineUnit(
        backend.engine, backend.name, backend.model, tuple(backend.argv()), UNIT_MARKER, backend.env
    )
    try:
        return render_unit(unit)
    except TemplateError as err:
        fail(EXIT_REFUSED, str(err))


# --------------------------------------------------------------------------- checks


def _check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise typer.BadParameter(
            f"{name!r}: a model key of a-z, 0-9, _ and - (at most 63, starting with a "
            "letter or digit): it names the unit uap-NAME.service",
            param_hint="NAME",
        )
    return name


def _binary(engine: str, given: str | None) -> str:
    if engine == "fake" and given is None:
        return sys.executable
    program = given or DEFAULT_BINARY[engine]
    found = shutil.which(program)
    if found is None:
        raise typer.BadParameter(
            f"{program!r} is not an executable here (give its path with --binary)",
            param_hint="--binary",
        )
    return str(Path(found).absolute())


def _env_pairs(items: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not ENV_KEY_RE.fullmatch(key) or any(c in value for c in '"\\\n'):
            raise typer.BadParameter(
                f"{item!r}: KEY=VALUE, KEY a shell variable name, VALUE without quotes, "
                "backslashes or newlines",
                param_hint="--env",
            )
        pairs.append((key, value))
    return tuple(pairs)


def _not_in_repo(paths: Paths, name: str) -> None:
    """Refuse a NAME the repo registry defines: the local entry would overlay its fields."""
    if not paths.repo_registry.exists():
        return
    try:
        repo = read_json(paths.repo_registry, trusted=True)
    except ConfigFileError as err:
        fail(EXIT_REFUSED, f"cannot read the repo registry to check {name!r}: {err}")
    models = repo.get("models") if isinstance(repo, dict) else None
    if isinstance(models, dict) and name in models:
        fail(
            EXIT_REFUSED,
            f"{paths.repo_registry} already defines the model {name!r}; "
            "a generated unit needs a name of its own",
        )


def _ours(path: Path) -> bool:
    try:
        first = path.read_text(encoding="utf-8").splitlines()[:1]
    except (OSError, UnicodeDecodeError):
        return False
    return first == [f"# {UNIT_MARKER}"]


async def _reload_manager() -> str:
    try:
        async with asyncio.timeout(RELOAD_TIMEOUT_S), UnitManager(in_process=True) as manager:
            await manager.reload()
    except Exception as err:
        first = (str(err) or type(err).__name__).splitlines()[0]
        return f"no systemd user manager reachable ({first}); run `systemctl --user daemon-reload`"
    return "the user manager reloaded its unit files"


def _daemon_findings(name: str) -> list[str] | None:
    """uapplaced's ``Validate`` (which re-reads the registry) on ``name``; ``None``: no daemon."""

    def offline(_: Unreachable) -> dict[str, Any] | None:
        return None

    report: dict[str, Any] | None = call_or(lambda c: c.validate(), offline)
    if report is None:
        return None
    return [
        f"{f.get('severity', '')}: {f.get('message', '')}"
        for f in report.get("findings", [])
        if name in json.dumps(f)
    ]


# --------------------------------------------------------------------------- commands


@app.command()
def add(
    name: NameArg,
    engine: Annotated[
        str, typer.Option("--engine", metavar="llama.cpp|vllm|fake", help="The template.")
    ],
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Its port (loopback).")],
    model: Annotated[
        str,
        typer.Option("--model", help="The weights (a GGUF file, a model directory or id)."),
    ] = "",
    device: Annotated[
        str | None, typer.Option("--device", help="A registry device key it should run on.")
    ] = None,
    config: Annotated[
        str, typer.Option("--config", help="The config key it is measured as.")
    ] = DEFAULT_CONFIG,
    binary: Annotated[
        str | None, typer.Option("--binary", help="The engine program (default: on PATH).")
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option("--env", metavar="KEY=VALUE", help="Environment= of the unit (repeat)."),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace a unit and entry `unit add` wrote before.")
    ] = False,
    flags: Annotated[
        list[str] | None,
        typer.Argument(metavar="[-- ENGINE FLAGS]...", help="Passed to the engine as they are."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Write uap-NAME.service from the engine's template and register NAME, unmeasured."""
    _check_name(name)
    if engine not in ENGINES:
        raise typer.BadParameter(f"{engine!r}: one of {', '.join(ENGINES)}", param_hint="--engine")
    if engine != "fake" and not model:
        raise typer.BadParameter(f"the {engine} template needs the weights", param_hint="--model")
    paths = Paths.from_env()
    backend = Backend(
        name,
        engine,
        model or name,
        port,
        _binary(engine, binary),
        tuple(flags or ()),
        _env_pairs(list(env or [])),
        device,
        config,
    )
    _not_in_repo(paths, name)
    path = unit_path(paths, name)
    if path.exists() and not (force and _ours(path)):
        why = "was written by `unit add` (--force replaces it)" if _ours(path) else "is not ours"
        fail(EXIT_REFUSED, f"{path} exists and {why}; nothing written")
    text = render(backend)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text, mode=0o644, sync=False)
    except OSError as err:
        fail(EXIT_REFUSED, f"cannot write {path}: {err}")
    try:
        write_local_model(paths.local_registry, name, backend.registry_entry(), replace=force)
    except ConfigFileError as err:
        path.unlink(missing_ok=True)  # no unit without its entry
        fail(EXIT_REFUSED, f"{err}; {path} not written")
    reloaded = asyncio.run(_reload_manager())
    findings = _daemon_findings(name)
    result = {
        "unit": str(path),
        "registry": str(paths.local_registry),
        "model": name,
        "config": config,
        "status": "unmeasured",
        "exec_start": shlex.join(backend.argv()),
        "reload": reloaded,
        "findings": findings,
    }
    if as_json:
        print_json(result)
        return
    out.print(f"wrote {path}", markup=False)
    out.print(f"registered {name}/{config} (unmeasured) in {paths.local_registry}", markup=False)
    out.print(reloaded, markup=False)
    if findings is None:
        out.print("uapplaced is not running: it reads the registry when it starts")
    for line in findings or []:
        out.print(f"validate: {line}", markup=False)
    out.print(
        f"Next: start it once and run `uapplace measure {name} {config}`: it places nothing "
        "until measured (docs/placement-rules.md §4.1.1).",
        markup=False,
    )


def _generated(paths: Paths) -> list[Path]:
    directory = paths.user_unit_dir
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob(f"{UNIT_PREFIX}*.service") if _ours(p))


def _row(path: Path, local: dict[str, Any], residents: dict[str, str] | None) -> dict[str, Any]:
    name = path.stem.removeprefix(UNIT_PREFIX)
    entry = (local.get("models") or {}).get(name) or {}
    configs = entry.get("configs") or {}
    statuses = {key: value.get("status", "measured") for key, value in configs.items()}
    return {
        "name": name,
        "unit": path.name,
        "engine": entry.get("engine"),
        "endpoint": entry.get("endpoint"),
        "configs": statuses,
        "resident": None if residents is None else residents.get(name, "no"),
    }


def _residents() -> dict[str, str] | None:
    """Model → state of the residents, as uapplaced says; ``None`` without uapplaced."""

    def offline(_: Unreachable) -> dict[str, Any] | None:
        return None

    state: dict[str, Any] | None = call_or(lambda c: c.get_state(), offline)
    if state is None:
        return None
    return {str(r["model"]): str(r.get("state", "")) for r in state.get("residents", [])}


def _local(paths: Paths) -> dict[str, Any]:
    try:
        return read_local(paths.local_registry)
    except ConfigFileError as err:
        fail(EXIT_REFUSED, str(err))


@app.command("list")
def list_units(as_json: JsonFlag = False) -> None:
    """The units `unit add` wrote, their registry entry and whether they are resident."""
    paths = Paths.from_env()
    local = _local(paths)
    residents = _residents()
    rows = [_row(path, local, residents) for path in _generated(paths)]
    if as_json:
        print_json({"units": rows})
        return
    if not rows:
        out.print(f"no units written by `uapplace unit add` in {paths.user_unit_dir}")
    for row in rows:
        configs = ", ".join(f"{k} {v}" for k, v in row["configs"].items()) or "not registered"
        resident = "uapplaced not running" if row["resident"] is None else row["resident"]
        out.print(
            f"{row['unit']}  {row['engine'] or '?'}  {row['endpoint'] or '?'}  {configs}  "
            f"resident: {resident}",
            markup=False,
        )


@app.command()
def show(name: NameArg, as_json: JsonFlag = False) -> None:
    """The unit file `unit add` wrote for NAME and its registry entry."""
    _check_name(name)
    paths = Paths.from_env()
    path = unit_path(paths, name)
    if not _ours(path):
        fail(EXIT_NOT_FOUND, f"no unit written by `uapplace unit add` for {name!r} ({path})")
    entry = (_local(paths).get("models") or {}).get(name)
    text = path.read_text(encoding="utf-8")
    if as_json:
        print_json({"unit": str(path), "text": text, "registry_entry": entry})
        return
    out.print(f"# {path}", markup=False)
    out.print(text, markup=False, end="")
    out.print(f"# registry entry in {paths.local_registry}:", markup=False)
    out.print(json.dumps(entry, indent=2), markup=False)


@app.command()
def remove(name: NameArg, as_json: JsonFlag = False) -> None:
    """Remove NAME's generated unit and registry entry; refuses while NAME is resident."""
    _check_name(name)
    paths = Paths.from_env()
    path = unit_path(paths, name)
    if not _ours(path):
        fail(EXIT_NOT_FOUND, f"no unit written by `uapplace unit add` for {name!r} ({path})")

    async def residents(client: PlacementClient) -> dict[str, str]:
        state: dict[str, Any] = await client.get_state()
        return {
            str(r["model"]): str(r.get("state", ""))
            for r in state.get("residents", [])
            if r.get("model") == name or str(r.get("unit") or "").startswith(f"{UNIT_PREFIX}{name}")
        }

    resident = call(residents)
    if resident:
        state = ", ".join(resident.values())
        fail(
            EXIT_REFUSED,
            f"{name} is resident ({state}); unload it first (`uapplace unload {name}`); "
            "nothing removed",
        )
    try:
        removed_entry = remove_local_model(paths.local_registry, name, f"{UNIT_PREFIX}{name}")
        path.unlink()
    except ConfigFileError as err:
        fail(EXIT_REFUSED, str(err))
    except OSError as err:
        fail(EXIT_USAGE, f"cannot remove {path}: {err}")
    reloaded = asyncio.run(_reload_manager())
    findings = _daemon_findings(name)
    result = {
        "unit": str(path),
        "registry_entry_removed": removed_entry,
        "reload": reloaded,
        "findings": findings,
    }
    if as_json:
        print_json(result)
        return
    out.print(f"removed {path}", markup=False)
    if removed_entry:
        out.print(f"removed {name} from {paths.local_registry}", markup=False)
    out.print(reloaded, markup=False)
