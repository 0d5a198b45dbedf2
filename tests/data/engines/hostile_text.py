"""An engine whose text is hostile to a terminal: ``python hostile_text.py MODE``.

Its version, its build facts and, per mode, its stderr, load error or run error carry
``HOSTILE``: a screen clear (ESC[2J), an OSC window title ending in BEL, a carriage
return that would overwrite the line, a NUL and a colour escape. Apart from that it is a
small working engine (phase ``work``: ``steps`` sleeps of ``step_ms``, a flag checked
between them) served by cancelbench.sut.server.

Modes: serve (works; only its version and build facts are hostile), stderr_exit (the
text on stderr, exit 3 before its hello), load_error (load fails with the text),
run_error (every run fails with the text).
"""

from __future__ import annotations

import sys

from cancelbench.sut.declaration import Declaration, MechanismInfo, Phase, Setting
from cancelbench.sut.server import Result, Trial, main

HOSTILE = "\x1b[2J\x1b]0;owned\x07\rX\x00Y\x1b[31mred"
MODES = ("serve", "stderr_exit", "load_error", "run_error")

DECLARATION = Declaration(
    name="hostile", version="1.0" + HOSTILE, input="text",
    phases=(Phase("work", True),),
    mechanisms=(MechanismInfo("flag", "a flag checked between step calls"),),
    settings=(Setting("steps", "int", 3, 1, 1000, "step calls per run"),
              Setting("step_ms", "int", 5, 0, 10_000, "each step call's sleep, ms")),
    build=(("compiler", "cc" + HOSTILE), ("commit", "abc123")))


class Hostile:
    declaration = DECLARATION

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.steps, self.step_ms = 3, 5

    def load(self, models: dict, settings: dict) -> dict | None:
        if self.mode == "load_error":
            raise RuntimeError(f"cannot load {HOSTILE} (version {DECLARATION.version})")
        self.steps, self.step_ms = int(settings["steps"]), int(settings["step_ms"])
        return None

    def run(self, trial: Trial) -> Result:
        if self.mode == "run_error":
            raise RuntimeError(f"run failed {HOSTILE}")
        trial.phase("work")
        for _ in range(self.steps):
            if trial.cancelled:
                return Result("cancelled")
            with trial.step():
                trial.sleep(self.step_ms / 1000)
        cancelled, t = trial.terminal()
        return Result("cancelled" if cancelled else "completed", t_terminal_ns=t)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in MODES:
        print(f"usage: hostile_text.py {{{','.join(MODES)}}}", file=sys.stderr)
        sys.exit(2)
    if sys.argv[1] == "stderr_exit":
        print(f"hostile: exiting before hello {HOSTILE}", file=sys.stderr, flush=True)
        sys.exit(3)
    main(Hostile(sys.argv[1]))
