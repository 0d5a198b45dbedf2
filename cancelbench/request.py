"""The trial contract: what the driver sends an agent for one trial.

One typed, immutable :class:`TrialRequest`, built by the driver from a planned
trial and its resolved input, validated once (at config load and plan time),
shipped to the agent by Ray and handed to the engine as is. Engine settings
(model, sizes, sampling, graph slice) travel once per workload in the load
payload (``WorkloadSpec.engine_params``, ``runner.workload_payload``), not per trial.

Ray-free and native-free: the driver, the agent and tests import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .bargein import BargeinTrial
from .schema import DELIVERIES, NOT_APPLICABLE

TRIAL_KINDS = ("reference", "cancel")


@dataclass(frozen=True)
class TrialRequest:
    mechanism: str
    input: str  # the prompt text (text/tts) or the audio path (stt; relative to the datasets package)
    trial_id: str = "local"
    trial_kind: str = "reference"
    delivery: str = NOT_APPLICABLE  # driver | agent | none (reference)
    input_id: str = ""
    lang: str | None = None  # per-input language (corpus), over the workload's
    # The cancel's anchor (schema: t_anchor_ns) and its delay after it. No anchor_phase: the
    # hand-back. anchor_phase alone: entry into that phase. With anchor_step k: the start of
    # the k-th step call of that phase, and the delay is step_fraction of the previous step
    # call's duration when there was one (offset_ms, from the reference run, otherwise).
    offset_ms: float | None = None
    anchor_phase: str | None = None
    anchor_step: int | None = None
    step_fraction: float | None = None
    # The reference run's time from hand-back to entering anchor_phase: the agent scales
    # offset_ms by this trial's own pace so far (its time to the same event over this).
    anchor_ref_ms: float | None = None
    wav_out: str | None = None  # tts reference runs: where to keep the synthesis for listening
    # Reference runs of a driver-delivered anchored sweep: the agent feeds the run's phase
    # entries to DeviceAgent.next_phase_entry, so the driver can time its round trip from
    # each (the reach of a cancel anchored there).
    feed_phases: bool = False
    # Barge-in (delivery "detector"): the microphone's clip and the detector; the planned due time
    # is the user's speech onset, and the detector issues the cancel (docs/bargein.md).
    bargein: BargeinTrial | None = None

    def __post_init__(self) -> None:
        if self.trial_kind not in TRIAL_KINDS:
            raise ValueError(f"trial_kind must be one of {TRIAL_KINDS}, got {self.trial_kind!r}")
        if self.delivery not in DELIVERIES + (NOT_APPLICABLE,):
            raise ValueError(f"unknown delivery {self.delivery!r}")
        if self.offset_ms is not None and not (self.offset_ms >= 0):
            raise ValueError(f"offset_ms must be >= 0, got {self.offset_ms!r}")
        if (self.delivery == "detector") != (self.bargein is not None) and self.trial_kind == "cancel":
            raise ValueError("a barge-in trial (bargein) and the detector delivery go together")
        if self.anchor_step is not None and (self.anchor_phase is None or self.anchor_step < 1):
            raise ValueError("anchor_step needs anchor_phase and must be >= 1")

    @property
    def anchor_kind(self) -> str:
        """handback | phase | progress: which engine event the cancel is anchored to."""
        if self.anchor_phase is None:
            return "handback"
        return "progress" if self.anchor_step is not None else "phase"

    @property
    def has_cancel(self) -> bool:
        """A planned cancel (resolved): the agent watches for its anchor."""
        return self.trial_kind == "cancel" and self.offset_ms is not None
