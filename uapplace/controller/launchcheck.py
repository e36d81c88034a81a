"""``validate``'s findings from what the units run now (issue 21 item 3;
docs/placement-rules.md §4.1.1, "A measurement goes stale").

- every measured config the stale-measurement gate made unknown
  (:mod:`uapplace.core.staleness`: another ``ExecStart`` or engine build than measured),
  an error at the recorded field of the machine-local file;
- the capacity policy's ``execStartMustContain`` checked against the unit's **live**
  ``ExecStart`` (systemd's ``ExecStart`` property), an error at the policy entry. The
  check of the registry's recorded ``flags`` (:mod:`uapplace.files.capacity`) stays for
  ``validate`` without a daemon; the live one is what the engine really runs.

Nothing here is read without enforcement (no user manager): then the live facts are empty.
"""

from __future__ import annotations

from uapplace.controller.configstate import LiveConfig
from uapplace.core.staleness import exec_start_args
from uapplace.core.unitnames import unit_file_name
from uapplace.files.capacity import Finding
from uapplace.files.registry_schema import json_path


def launch_findings(config: LiveConfig) -> list[Finding]:
    """The stale measurements and the live ``execStartMustContain`` misses, as errors."""
    state = config.state
    load = state.registry_load
    findings = [
        Finding(
            "error",
            str(load.file_for("local")),
            json_path(("models", s.model, "configs", s.config, s.field)),
            s.message,
        )
        for s in config.stale
    ]
    policy = state.policy
    if policy is None:
        return findings
    for model in load.registry.models.values():
        service = policy.services.get(model.service) if model.service else None
        unit = model.unit
        live = config.live.get(unit_file_name(unit)) if unit else None
        if service is None or live is None or live.exec_start is None:
            continue
        tokens = list(exec_start_args(live.exec_start))
        for index, entry in enumerate(service.exec_start_must_contain):
            if _contains_run(tokens, entry.split()):
                continue
            where = policy.path if policy.path is not None else "capacity-policy.json"
            findings.append(
                Finding(
                    "error",
                    str(where),
                    f"{service.json_path}.execStartMustContain[{index}]",
                    f"{live.unit}'s live ExecStart lacks {entry!r} (systemd runs "
                    f"`{live.exec_start}`): {model.key} does not run as the policy requires",
                )
            )
    return findings


def _contains_run(tokens: list[str], needle: list[str]) -> bool:
    """Token runs, not substrings: ``-c 2293760`` must not satisfy ``-c 229376``."""
    width = len(needle)
    return any(tokens[i : i + width] == needle for i in range(len(tokens) - width + 1))
