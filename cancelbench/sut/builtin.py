"""cancelbench's own engines, out of process: ``python -m cancelbench.sut.builtin ENGINE``.

ENGINE is one of the built-in engines (``text``, ``tts``, ``stt``, ``probe``, ``sim``);
the process speaks the engine protocol (docs/sut-protocol.md) through
:mod:`cancelbench.sut.server`, so a sweep can run a built-in engine as an
``external`` workload and ``cancelbench sut-check`` has known-good engines to check.

* ``hello``: the engine's declaration (``ENGINES[name].declaration``; engine name
  ``cancelbench-<name>``).
* ``load``: builds the engine as the in-process agent does, from the settings (a
  ``None`` value: resolved by the declarations, ``engine_decls.resolve_settings``) plus
  the model paths (``models.model``, ``models.mmproj``; the agent has verified them).
  The agent sends its device's ``n_gpu_layers`` where the workload sets none; one still
  unset here is 0 (this process does not know its device). ``loaded.settings`` holds the
  effective values of declared settings the engine reports (``describe()``).
* ``run``: a :class:`CancelControl` on a native :class:`CancelToken` and a
  :class:`Progress` whose listener turns the engine's phase and step-call events into
  protocol events (``native.now_ns``: CLOCK_MONOTONIC, the pongs' clock). A cancel read
  for the trial is ``ctl.request(t_read)`` (a latched one before ``engine.run``); one
  read after the engine's terminal decision (``ctl.close``) is refused, so ``done``
  never carries a cancel the engine had no chance to see.
* ``audio`` (engines that declare ``audio_out``: tts): each hand-over of the engine's
  ``Progress.hand_audio``, as it happens; ``loaded.audio_sample_rate`` is its model's rate.
* ``done``: from the :class:`EngineResult`: outcome, ``t_terminal_ns``,
  ``phase_at_terminal``, ``output_sha256``, ``native_returned_t``
  (``ctl.native_returned_ns``), a ``cancel_seen`` event from ``token.seen_ns``, and
  counters ``decode_rc``, ``abort_polls``, ``n_input_tokens``, ``tokens_generated``,
  ``frames_generated`` and, for the known-answer engines (sim, probe),
  ``known_answer_error_ns``; with a receipt, ``at_receipt`` from the progress the
  engine's :class:`CancelControl` took then.

Input: ``run.input`` is the prompt text (text, tts), the WAV path (stt), ignored
(sim, probe).
"""

from __future__ import annotations

import os
import sys

from cancelbench import failpoints
from cancelbench.request import TrialRequest
from cancelbench.sut.protocol import AT_RECEIPT_FIELDS, AT_RECEIPT_NAMES, AUDIO_OUT

from .declaration import Declaration
from .server import Result, Trial, main as serve_main


def declaration_of(name: str) -> Declaration:
    """The built-in engine's declaration as its hello says it (name ``cancelbench-<name>``, the
    capabilities the library adds: ``server.LIBRARY_CAPABILITIES``)."""
    import dataclasses

    from cancelbench.device_agents.engines.registry import engine_spec

    from .server import LIBRARY_CAPABILITIES

    decl = engine_spec(name).declaration
    if not decl.name.startswith("cancelbench-"):
        decl = dataclasses.replace(decl, name=f"cancelbench-{name}")
    if decl.version in ("", "0"):
        import cancelbench
        decl = dataclasses.replace(decl, version=cancelbench.__version__)
    caps = (*decl.capabilities, *(c for c in LIBRARY_CAPABILITIES if c not in decl.capabilities))
    return dataclasses.replace(decl, capabilities=caps)


class BuiltinEngine:
    """A built-in engine behind the protocol server (see the module docstring)."""

    def __init__(self, name: str, declaration: Declaration | None = None, *, in_agent: bool = False) -> None:
        from cancelbench.device_agents.engines.registry import engine_spec

        self.name = name
        self.in_agent = in_agent  # on a thread of the agent's process (sut/channel.py): it must never end it
        self.spec = engine_spec(name)
        self.declaration = declaration or declaration_of(name)
        self.engine = None
        self.token = None

    # -- load --------------------------------------------------------------
    def workload(self, models: dict, settings: dict) -> dict:
        """The dict the in-process engine is built from: settings (None: the engine's
        default) plus the model paths."""
        wl = {k: v for k, v in settings.items() if v is not None}  # None: resolved by the engine
        wl.update({k: v for k, v in models.items() if k in ("model", "mmproj")})
        wl["engine"] = self.name
        return wl

    def load(self, models: dict, settings: dict) -> dict | None:
        from cancelbench import native

        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.spec.needs_model and not models.get("model"):
            raise ValueError(f"the {self.name} engine needs a model (load.models.model)")
        # checked as the agent checks them (a value out of bounds is a load error, not a default)
        settings = self.declaration.resolve({k: v for k, v in settings.items() if v is not None}, "load.settings")
        self.engine = self.spec.make(self.workload(models, settings))
        if self.token is None:
            self.token = native.CancelToken()
        described = self.engine.describe()  # under record columns: a TTS seed is its sampling_seed
        names = {s.record_column: s.name for s in self.declaration.settings}
        return {names[k]: v for k, v in described.items()
                if k in names and isinstance(v, (bool, int, float, str))} or None

    @property
    def audio_sample_rate(self) -> int | None:
        """The rate of the audio it hands over (an engine that declares audio_out: TTS, from its model)."""
        rate = getattr(self.engine, "sample_rate", None)
        return int(rate) if rate is not None and self.declaration.can(AUDIO_OUT) else None

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # -- run ---------------------------------------------------------------
    def _listener(self, trial: Trial, token):
        phases = set(self.declaration.phase_names)
        step_phases = set(self.declaration.step_phases)
        in_step = [False]

        def listener(event: str, phase: str, t_ns: int) -> None:
            if event == "phase":
                if phase in phases:  # not PhaseClock's closing "done"
                    trial.phase(phase, t_ns)
                    in_step[0] = False  # a phase change ends a step in flight
            elif event == "step":
                # a step call in a phase declared without steps (tts output) is no step event
                if trial.current_phase == phase and phase in step_phases and not in_step[0]:
                    trial.step_start(t_ns)
                    in_step[0] = True
            elif event == "step_end" and in_step[0]:
                in_step[0] = False
                if token.seen_ns:  # the reader saw the cancel inside this call: before its end, in time order
                    _seen(trial, token)
                trial.step_end(t_ns)
        return listener

    def arm(self, trial: Trial, ctl) -> None:
        """Route the trial's cancels to the engine: a latched one at once; its terminal decision
        (CancelControl.close) is the trial thread's terminal reading."""
        ctl.cpu = _ThreadReadings(trial, ctl)
        trial.on_cancel = ctl.request

    def run(self, trial: Trial) -> Result:
        from cancelbench.device_agents.engines.base import CancelControl, Progress, step_stretch

        if self.engine is None:
            raise RuntimeError("run before a successful load")
        token = self.token
        token.reset()
        token.watch(trial.word, trial.cancel_seq)  # the shared cancel word: every reader sees it at its next poll
        listener = self._listener(trial, token)
        crash = failpoints.engine_signal(trial.id)
        if crash is not None:  # a test's crash mid-trial (cancelbench.failpoints): at the first step call
            if self.in_agent:
                raise RuntimeError("a crash failpoint would end the agent: this engine runs in the agent's process")
            listener = _crashing(listener, crash)
        progress = Progress(step_calls=self.spec.step_calls, listener=listener)
        if self.declaration.can(AUDIO_OUT):  # each window's audio, as the engine hands it to a player
            progress.audio_listener = _audio_out(trial)
        ctl = CancelControl(token, progress)
        ctl.step_delay = step_stretch(trial.id)  # a test's injected variance (cancelbench.failpoints); None in real runs
        self.arm(trial, ctl)
        request = TrialRequest(mechanism=trial.mechanism, input=trial.input, trial_id=trial.id,
                               wav_out=trial.output_path, lang=_run_lang(trial, self.declaration))
        res = self.engine.run(request, ctl)
        if ctl.received_ns is not None:  # a receipt the token took from the word, before the line was read
            trial.took_cancel(ctl.received_ns, "word" if ctl.token.set_by_word else "line")
        if token.seen_ns:
            _seen(trial, token)
        counters = {"decode_rc": res.decode_rc, "abort_polls": token.polls, "n_input_tokens": res.n_input_tokens,
                    "tokens_generated": progress.tokens_generated, "frames_generated": progress.frames_generated}
        if isinstance(res.output, dict) and res.output.get("known_answer_error_ms") is not None:
            counters["known_answer_error_ns"] = round(res.output["known_answer_error_ms"] * 1e6)
        phase = res.phase_at_terminal if res.phase_at_terminal in self.declaration.phase_names else None
        at_receipt = {k: ctl.at_receipt.get(f"{k}_at_receipt") for k in (*AT_RECEIPT_FIELDS, *AT_RECEIPT_NAMES)}
        return Result(res.outcome, t_terminal_ns=res.t_terminal_ns, phase=phase, output_sha256=res.output_sha256,
                      counters=counters, native_returned_ns=ctl.native_returned_ns, at_receipt=at_receipt)


def _run_lang(trial: Trial, declaration: Declaration) -> str | None:
    """The run's ``lang`` (a corpus item's own language, protocol 1.5) for an engine declaring one."""
    lang = trial.settings.get("lang")
    return lang if isinstance(lang, str) and declaration.setting("lang") is not None else None


def _crashing(listener, sig: int):
    """The listener, then this process's own ``sig`` at the first step call."""
    def crash(event: str, phase: str, t_ns: int) -> None:
        listener(event, phase, t_ns)
        if event == "step":
            os.kill(os.getpid(), sig)
    return crash


def _audio_out(trial: Trial):
    """Progress.audio_listener (samples handed over in all, when) as the trial's audio events."""
    handed = [0]

    def listener(total_samples: int, t_ns: int) -> None:
        if total_samples > handed[0]:
            trial.audio(total_samples - handed[0], t_ns)
            handed[0] = total_samples
    return listener


def _seen(trial: Trial, token) -> None:
    """The token's first sight as ``cancel_seen``: where the eval reader saw it and the trial
    thread's CPU clock then (it runs on the thread that computes the graph: ggml calls back on
    its caller, the trial thread)."""
    trial.cancel_seen(token.seen_ns, token.seen_where, token.seen_cpu_ns or None)


class _ThreadReadings:
    """CancelControl's cpu hook in the engine process: the trial thread's readings at the receipt
    (under the control's lock, so before the terminal's) and at the engine's terminal decision."""

    def __init__(self, trial: Trial, ctl) -> None:
        self.trial, self.ctl = trial, ctl

    def owe_receipt(self) -> None:
        token, thread = self.ctl.token, self.trial.thread
        if token.set_by_word and self.ctl.received_ns == token.set_ns:
            # a receipt the native reader latched from the word: the reading is its stamp, taken then,
            # when that reader ran on the trial thread (its CPU clock and run delay are its own
            # thread's); else none
            latch = token.word_latch
            if latch is not None and latch[1] == thread.tid:
                thread.take("receipt", (token.set_ns, latch[0], latch[2]))  # set_ns: the latch's own stamp
        else:
            thread.take("receipt")

    def at_receipt(self) -> None:
        # the receipt may be the native reader's latch of the word, which the trial learns of only when
        # run returns: its events are held from here, so the stop writes nothing (Trial.hold_events)
        self.trial.hold_events()

    def at_terminal(self) -> None:
        self.trial.thread.take("terminal")


def main(argv: list[str] | None = None) -> None:
    from cancelbench.device_agents.engines.registry import ENGINES

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in ENGINES:
        print(f"usage: python -m cancelbench.sut.builtin {{{','.join(ENGINES)}}}", file=sys.stderr)
        sys.exit(2)
    serve_main(BuiltinEngine(argv[0]))


if __name__ == "__main__":
    main()
