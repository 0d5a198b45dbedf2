"""A DELIBERATELY DEFECTIVE engine: ``python -m cancelbench.sut.defective``.

It is wrong on purpose. It reproduces the field bug the engine protocol exists to
catch: a cancel dropped because it arrived before the backend was active. Use it to
show that cancelbench (a sweep, ``sut-check``) flags such an engine; never as an
example to copy.

It is the sim engine (waits, no model; ``cancelbench.sut.builtin sim``) out of
process, with one more setting, ``activate_ms`` (default 30): each run first
"activates the backend" for that long, already inside the first phase (``prefill``
is entered, so the run has visibly started). Any cancel that arrived before the
activation finished, latched before the run or read during the activation, is
ignored: it is stamped as read, so ``done`` carries ``cancel_received_t``, but the
engine never acts on it and the run completes, which the harness classifies as
*dropped*. A cancel read after the activation works as in the sim engine. It never
reads the shared cancel word (it declares it, as every engine on cancelbench.sut.server
does, so sut-check's cancel_word check fails it too).
"""

from __future__ import annotations

import dataclasses
import time

from .builtin import BuiltinEngine, declaration_of
from .declaration import Declaration, Setting
from .server import Trial, main

ACTIVATE_MS = 30


def declaration() -> Declaration:
    sim = declaration_of("sim")
    return dataclasses.replace(
        sim, name="cancelbench-defective-sim",
        settings=sim.settings + (Setting("activate_ms", "int", ACTIVATE_MS, 0, 600_000,
                                         "backend activation at the start of each run, ms; cancels read "
                                         "before it ends are dropped (the defect)"),),
        build=sim.build + (("defect", "drops a cancel that arrives before the backend is active"),))


class DefectiveEngine(BuiltinEngine):
    def __init__(self) -> None:
        super().__init__("sim", declaration())
        self.activate_ms = ACTIVATE_MS
        self._active = False

    def load(self, models: dict, settings: dict) -> dict | None:
        settings = dict(settings)
        activate = settings.pop("activate_ms", None)
        if activate is not None:
            self.declaration.setting("activate_ms").check(activate, "load.settings.activate_ms")
        self.activate_ms = ACTIVATE_MS if activate is None else int(activate)
        return super().load(models, settings)

    def arm(self, trial: Trial, ctl) -> None:
        self._active = False
        trial.word = None  # the shared cancel word is never read: only the (lost) line reaches it
        ctl.token.watch(None, None)

        def on_cancel(t_read: int):
            if self._active:
                return ctl.request(t_read)
            return None  # THE DEFECT: the backend is not active yet, the cancel is lost (still stamped)

        trial.on_cancel = on_cancel  # a latched cancel arrives here at once, and is lost
        trial.phase(self.declaration.phase_names[0])
        time.sleep(self.activate_ms / 1000)  # activating the backend
        self._active = True


if __name__ == "__main__":
    main(DefectiveEngine())
