"""The order of a plan's options: reuse, wake, load alongside (affinity first), then
displacement by MiB freed; and where a displacement's stop and pause forms sit next
to each other (docs/placement-rules.md §4.4).

Pure: the planner (:mod:`uapplace.core.planner`) sorts every plan's options here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from uapplace.core.model import Model, Option, OptionKind, Victim


def rank_options(options: Iterable[Option]) -> tuple[Option, ...]:
    """The §4.4 order: reuse > wake with nothing to displace > load_alongside with
    affinity > load_alongside > displace (and wake needing room) freeing the fewest
    MiB > … > the most. Ties: fewer victims, then device and config key, so the
    order is deterministic.

    The stop and pause forms of one displacement (issue 12) share every key but the
    last: MiB are counted as what *stopping* the victims would free
    (:func:`displaced_mib`), so the two forms sit next to each other, ordered by
    ``Option.form_rank``: the expected time until the victims serve again where
    the envelopes measure it, else pause before stop.
    """

    def key(option: Option) -> tuple[int, int, float, int, str, str, str, str, float]:
        kind = option.kind.value
        if option.kind is OptionKind.REUSE:
            return (0, 0, 0.0, 0, option.device, option.model, option.config, kind, 0.0)
        if option.kind is OptionKind.WAKE and not option.victims:
            return (1, 0, 0.0, 0, option.device, option.model, option.config, kind, 0.0)
        if option.kind is OptionKind.LOAD_ALONGSIDE:
            rank = 0 if option.affinity_match else 1
            return (2, rank, 0.0, 0, option.device, option.model, option.config, kind, 0.0)
        return (
            3,
            0,
            displaced_mib(option),
            len(option.victims),
            option.device,
            option.model,
            option.config,
            kind,
            option.form_rank,
        )

    return tuple(sorted(options, key=key))


def displaced_mib(option: Option) -> float:
    """What stopping every victim of ``option`` would free: the ranking's MiB, the same
    for an option's stop and pause forms."""
    return sum(v.frees_mib + v.residual_mib for v in option.victims)


def affinity_match(model: Model, device_key: str, task: str | None = None) -> bool:
    """Whether loading ``model`` on ``device_key`` matches the model's stated affinity.

    With a ``task``: the model lists it in ``task_affinity`` and the device is
    one of its ``affinity_devices`` (or the model names none). Without one (the
    admit path carries no task): the device is one of the model's
    ``affinity_devices``, so a model that states no device affinity matches
    nothing. Since every option of one plan is for one model, the flag mostly
    tells the operator whether the placement follows the registry's stated
    preference; the ranking still puts matching options first.
    """
    on_device = device_key in model.affinity_devices
    if task is None:
        return on_device
    return task in model.task_affinity and (on_device or not model.affinity_devices)


def form_ranks(stopped: Sequence[Victim], paused: Sequence[Victim]) -> tuple[float, float]:
    """(stop form, pause form) ranks: the expected seconds until every victim serves
    again (Σ ``serve_again_s``) when both forms are fully measured; otherwise the
    documented default, pause (0) before stop (1), since a wake skips the load."""
    stop_total = [v.serve_again_s for v in stopped]
    pause_total = [v.serve_again_s for v in paused]
    if None in stop_total or None in pause_total:
        return 1.0, 0.0
    return sum(s for s in stop_total if s is not None), sum(s for s in pause_total if s is not None)
