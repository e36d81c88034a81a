"""Reading a ``/metrics`` page back the way Prometheus would: ``prometheus_client``'s own
parser, so a test names a series by its name and labels, in any order."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Series = tuple[str, frozenset[tuple[str, str]]]


def samples(text: str) -> dict[Series, float]:
    """Every sample of an exposition, keyed on its name and label set."""
    found: dict[Series, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def sample(text: str, name: str, **labels: str) -> float | None:
    """One sample's value, ``None`` when the page does not have it."""
    return samples(text).get((name, frozenset(labels.items())))


def families(text: str) -> dict[str, str]:
    """Each family's name and type as the page declares them (``# TYPE``)."""
    return {family.name: family.type for family in text_string_to_metric_families(text)}
