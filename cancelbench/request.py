"""The trial contract: what the driver sends an agent for one trial.

One typed, immutable :class:`TrialRequest`, built by the driver from a planned
trial and its resolved input, validated once (at config load and plan time),
shipped to the agent by Ray and handed to the engine as is. Engine settings
(model, sizes, sampling, graph slice) travel once per workload in the load
payload (``WorkloadSpec.engine_payload``), not per trial.

Ray-free and native-free: the driver, the agent and tests import it.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    # agent delivery: fire the cancel at hand-back + this many ms (the one origin of every offset)
    offset_ms: float | None = None
    wav_out: str | None = None  # tts reference runs: where to keep the synthesis for listening

    def __post_init__(self) -> None:
        if self.trial_kind not in TRIAL_KINDS:
            raise ValueError(f"trial_kind must be one of {TRIAL_KINDS}, got {self.trial_kind!r}")
        if self.delivery not in DELIVERIES + (NOT_APPLICABLE,):
            raise ValueError(f"unknown delivery {self.delivery!r}")
        if self.offset_ms is not None and not (self.offset_ms >= 0):
            raise ValueError(f"offset_ms must be >= 0, got {self.offset_ms!r}")

    @property
    def agent_timer(self) -> bool:
        """Whether the agent itself fires this trial's cancel."""
        return self.trial_kind == "cancel" and self.delivery == "agent" and self.offset_ms is not None
