"""A barge-in sweep's config (docs/bargein.md): a workload's ``[workload.bargein]`` table and
the ``detector`` delivery, checked before anything runs; each trial's clip, drawn here."""

from __future__ import annotations

from cancelbench.bargein import BargeinError, BargeinSettings, BargeinTrial, ClipEntry, parse_settings, trial_of

from .checks import ConfigError

DETECTOR = "detector"


def clip_entries(name: str, where: str = "bargein.clips") -> list[ClipEntry]:
    """The interruption clip set ``name`` (datasets/bargein_clips.py) as clip entries."""
    from cancelbench.datasets.bargein_clips import CLIP_SETS

    if name not in CLIP_SETS:
        raise ConfigError(f"{where}: unknown clip set {name!r} (known: {', '.join(sorted(CLIP_SETS))})")
    return [ClipEntry(i, e.name, e.user, e.snr_db, e.echo_level_db) for i, e in enumerate(CLIP_SETS[name])]


def check_bargein(raw: object, spec, where: str) -> BargeinSettings:
    """A workload's barge-in table: its keys, its detector's settings, its clip set, and an
    engine that streams audio (``spec``: its EngineSpec; a player needs the audio as the engine
    makes it: a built-in TTS engine, or an external one whose hello declares audio_out)."""
    from cancelbench.device_agents.engines.registry import ENGINES

    try:
        settings = parse_settings(raw, where)
    except BargeinError as exc:
        raise ConfigError(str(exc)) from None
    if not spec.keeps_audio:
        audio = [n for n, e in ENGINES.items() if e.keeps_audio]
        what = f"the external engine {spec.declaration.name}" if spec.external else f"the {spec.name} engine"
        raise ConfigError(f"{where}: barge-in needs an engine that streams audio ({', '.join(audio)}, or an external "
                          f"engine whose hello declares the capability audio_out); {what} does not")
    try:
        from cancelbench.device_agents.detectors import of_bargein
        of_bargein(settings)  # the detector refuses what it cannot run
    except ValueError as exc:
        raise ConfigError(f"{where}: {' '.join(str(exc).split())}") from None
    clip_entries(settings.clips, f"{where}.clips")
    return settings


def check_deliveries(deliveries: tuple[str, ...], workloads) -> None:
    """Barge-in workloads and the detector delivery go together: the detector is what issues
    a barge-in's cancel, and a detector needs a microphone stream (a bargein table)."""
    bargein = [w.name for w in workloads if w.bargein is not None]
    if DETECTOR in deliveries:
        if deliveries != (DETECTOR,):
            raise ConfigError("sweep.deliveries: the detector delivery (barge-in) cannot be mixed with others; "
                              "run them in separate sweeps")
        plain = [w.name for w in workloads if w.bargein is None]
        if plain:
            raise ConfigError(f"sweep.deliveries = [\"detector\"] needs a [workload.bargein] table in every "
                              f"workload; {', '.join(plain)} has none")
    elif bargein:
        raise ConfigError(f"workload(s) {', '.join(bargein)} have a bargein table: set sweep.deliveries = "
                          "[\"detector\"] (the detector issues a barge-in's cancel)")


LEAD_SAMPLES = 16  # aim = cancel: the onset's lead is the median detection of this many latest barge-ins


def trial_bargein(settings: BargeinSettings | None, trial_id: str, delivery: str, seed: int,
                  detections_ns) -> BargeinTrial | None:
    """The barge-in part of a cancel trial's request (None for every other trial). With
    aim = cancel, the onset's lead: the median detection (onset -> fired) of the latest
    barge-ins of this workload on this device (``detections_ns``); before any, min_speech_ms
    + chunk_ms (the speech the detector needs, and the chunk it waits for)."""
    if settings is None or delivery != DETECTOR:
        return None
    lead = 0.0
    if settings.aim == "cancel":
        last = sorted(list(detections_ns)[-LEAD_SAMPLES:])
        lead = last[(len(last) - 1) // 2] / 1e6 if last else float(settings.min_speech_ms + settings.chunk_ms)
    return trial_of(settings, clip_entries(settings.clips), trial_id, seed, lead)


def note_agent_samples(samples: dict, workload: str, record) -> None:
    """After an agent-clock trial (agent or detector delivery): its timer's lateness (for a barge-in:
    placing the onset) is agent delivery's reach; a barge-in's detection feeds the onset lead."""
    placed = record.t_onset_ns if record.delivery == DETECTOR else record.t_issued_ns
    if placed is not None and record.t_cancel_scheduled_ns is not None:
        samples["agent", workload].append(max(0, placed - record.t_cancel_scheduled_ns))
    if record.t_detected_ns is not None and record.t_onset_ns is not None and record.t_detected_ns >= record.t_onset_ns:
        samples["detect", workload].append(record.t_detected_ns - record.t_onset_ns)
