"""The polkit policy file: well formed, valid, and in step with ``authz.Action``."""

from __future__ import annotations

import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from uapplace.daemon.authz import Action

POLICY = Path(__file__).resolve().parents[2] / "polkit" / "org.uap.placement.policy"
POLKIT_DTD = Path("/usr/share/polkit-1/policyconfig-1.dtd")
AUTH_VALUES = {"no", "auth_self", "auth_admin", "auth_self_keep", "auth_admin_keep", "yes"}
CONTEXTS = ("allow_any", "allow_inactive", "allow_active")
STANDING_CONSENT = {Action.AUTO_ENABLE, Action.ALLOW_DISPLACE, Action.ALLOW_UNLOAD}
ACTS_ON_OTHERS = {Action.RELEASE_OTHERS}
"""Acting on another application's state (its hold) needs a person too."""


def actions() -> dict[str, ET.Element]:
    root = ET.parse(POLICY).getroot()
    assert root.tag == "policyconfig"
    found = root.findall("action")
    ids = [action.get("id", "") for action in found]
    assert len(ids) == len(set(ids)), f"{POLICY}: duplicate action ids"
    return dict(zip(ids, found, strict=True))


def defaults(action: ET.Element) -> dict[str, str]:
    block = action.find("defaults")
    assert block is not None
    return {child.tag: (child.text or "").strip() for child in block}


def xmllint() -> str:
    path = shutil.which("xmllint")
    if path is None:
        pytest.skip("xmllint not installed (libxml2-utils, see scripts/setup-system.sh)")
    return path


def test_policy_is_well_formed() -> None:
    result = subprocess.run([xmllint(), "--noout", str(POLICY)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_policy_is_valid_against_the_polkit_dtd() -> None:
    tool = xmllint()
    if not POLKIT_DTD.exists():
        pytest.skip(f"{POLKIT_DTD} not installed (package polkitd)")
    result = subprocess.run(
        [tool, "--noout", "--dtdvalid", str(POLKIT_DTD), str(POLICY)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_one_action_per_verb_with_the_ids_authz_asks_for() -> None:
    assert set(actions()) == {action.value for action in Action}


def test_every_action_says_what_it_is_and_has_valid_defaults() -> None:
    for action_id, action in actions().items():
        for tag in ("description", "message"):
            text = action.findtext(tag, "").strip()
            assert text, f"{POLICY}: action {action_id} has no <{tag}>"
        values = defaults(action)
        assert set(values) == set(CONTEXTS), f"{POLICY}: action {action_id} defaults {values}"
        assert set(values.values()) <= AUTH_VALUES, f"{POLICY}: action {action_id} {values}"


def test_standing_consent_needs_a_person_and_routine_verbs_do_not() -> None:
    for action_id, action in actions().items():
        values = set(defaults(action).values())
        if Action(action_id) in STANDING_CONSENT | ACTS_ON_OTHERS:
            assert values == {"auth_self_keep"}, action_id
        else:
            assert values == {"yes"}, action_id
