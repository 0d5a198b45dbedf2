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


def check_bargein(raw: object, engine: str, where: str) -> BargeinSettings:
    """A workload's barge-in table: its keys, its detector's settings, its clip set, and an
    engine that streams audio (a player needs it as the engine makes it)."""
    from cancelbench.device_agents.engines.registry import ENGINES

    try:
        settings = parse_settings(raw, where)
    except BargeinError as exc:
        raise ConfigError(str(exc)) from None
    spec = ENGINES.get(engine)
    if spec is None or not spec.keeps_audio:
        audio = [n for n, e in ENGINES.items() if e.keeps_audio]
        raise ConfigError(f"{where}: barge-in needs an engine that streams audio ({', '.join(audio)}); "
                          f"the {engine} engine does not" + (" (the engine protocol has no audio event yet)"
                                                             if spec is None else ""))
    try:
        from cancelbench.device_agents.detectors import DetectorSettings
        DetectorSettings(kind=settings.detector, frame_ms=settings.frame_ms, min_speech_ms=settings.min_speech_ms,
                         threshold=settings.threshold, webrtc_mode=settings.webrtc_mode,
                         warmup_ms=settings.warmup_ms)
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


def trial_bargein(settings: BargeinSettings | None, trial_id: str, delivery: str, seed: int) -> BargeinTrial | None:
    """The barge-in part of a cancel trial's request (None for every other trial)."""
    if settings is None or delivery != DETECTOR:
        return None
    return trial_of(settings, clip_entries(settings.clips), trial_id, seed)
