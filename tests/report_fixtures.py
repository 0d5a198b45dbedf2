"""Known-answer datasets for the report/diff tests, written through the real
RecordSink so the layout is exactly what sweeps produce."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from cancelbench import schema
from cancelbench.sink import MANIFEST, RecordSink, write_json_atomic

T0 = 1_000_000_000_000  # agent monotonic ns at hand-back of the first trial
MS = 1_000_000

DEVICE_DEFAULTS = {
    "hostA": dict(backend="cpu", device="cpu:0", device_name="AMD EPYC", platform="linux", arch="x86_64"),
    "hostB": dict(backend="vulkan", device="vulkan:0", device_name="Radeon 780M", platform="linux", arch="x86_64"),
    "mac1": dict(backend="metal", device="metal:0", device_name="Apple M2", platform="darwin", arch="arm64"),
    "mac2": dict(backend="metal", device="metal:0", device_name="Apple M2", platform="darwin", arch="arm64"),
}


def cancel_row(
    trial_id: str,
    latency_ms: float | None = 10.0,
    *,
    host: str = "hostA",
    workload: str = "tts",
    phase: str | None = "decode",
    mechanism: str = "abort_callback",
    delivery: str = "driver",
    outcome: str = "cancelled",
    deliver_ms: float = 1.0,
    observe_ms: float | None = None,
    settle_ms: float = 0.0,
    offset_ms: float = 100.0,
    reference_ms: float = 1000.0,
    trial_kind: str = "cancel",
    sweep_id: str = "sweep-1",
    **overrides,
) -> dict:
    """One record whose timestamps produce exactly the given hop times."""
    row = schema.empty_row()
    dev = dict(DEVICE_DEFAULTS.get(host, DEVICE_DEFAULTS["hostA"]))
    row.update(dev, host=host, hostname=host, sweep_id=sweep_id, trial_id=trial_id, trial_kind=trial_kind,
               workload=workload, engine="tts", mechanism=mechanism, delivery=delivery, outcome=outcome,
               phase_at_receipt=phase, reference_ms=reference_ms, seed=1)
    handback = T0
    issued = handback + round(offset_ms * MS)
    row.update(t_handback_ns=handback, t_start_ns=handback + MS, t_cancel_scheduled_ns=issued, t_issued_ns=issued)
    if outcome in ("cancelled",) and latency_ms is not None:
        received = issued + round(deliver_ms * MS)
        terminal = received + round(latency_ms * MS)
        observed = received + round(observe_ms * MS) if observe_ms is not None else None
        returned = terminal - round(settle_ms * MS)
        row.update(t_received_ns=received, t_native_observed_ns=observed, t_native_returned_ns=returned,
                   t_terminal_ns=terminal)
    elif outcome == "completed":
        row.update(t_terminal_ns=issued - MS)
    elif outcome == "dropped":
        row.update(t_terminal_ns=handback + round(reference_ms * MS))
    elif outcome == "lost":
        row.update(t_issued_ns=None, error="agent lost: actor died")
    schema.derive(row)
    row.update(overrides)
    return row


def write_dataset(out_dir: Path, rows: list[dict], schema_version: int = schema.SCHEMA_VERSION,
                  sweep_id: str | None = None) -> Path:
    """A dataset as a sweep writes it; its manifest's sweep id (what makes it one dataset to
    the reports, however it is named) is unique per directory unless given."""
    out_dir = Path(out_dir)
    sink = RecordSink(out_dir, flush_every=10**9)
    for r in rows:
        sink.add(r)
    sink.close()
    sweep_id = sweep_id or "test-" + hashlib.sha256(str(out_dir.resolve()).encode()).hexdigest()[:12]
    write_json_atomic(out_dir / MANIFEST, {"schema_version": schema_version, "sweep_id": sweep_id})
    return out_dir


def cell_rows(prefix: str, latencies, **kw) -> list[dict]:
    return [cancel_row(f"{prefix}-{i:04d}", float(v), **kw) for i, v in enumerate(latencies)]


def known_answer_rows() -> list[dict]:
    """The report known-answer dataset.

    hostA/cpu tts decode abort_callback driver : latencies 1..300 ms  -> p50 150, p90 270, p99 297, max 300
    hostA/cpu tts prefill abort_callback driver: 1..10 ms             -> p50 5, p90/p99 insufficient
    hostB/vulkan tts decode abort_callback driver: 29 x 2 ms + 1 dropped -> p50 2 p90 2, p99 insufficient
    hostB/vulkan tts prefill abort_callback driver: 4 samples         -> all insufficient (p50 needs 5)
    hostA/cpu stt encode between_calls agent   : 299 x 20 ms and 1 x 900 ms -> p99 20 (not over), max 900
    hostA/cpu stt decode between_calls agent   : 296 x 5 ms, 4 x 80 ms -> p99 80 over the 50 ms bound
    one lost reference trial on hostA
    """
    rows = cell_rows("a-dec", range(1, 301))
    rows += cell_rows("a-pre", range(1, 11), phase="prefill")
    rows += cell_rows("b-dec", [2.0] * 29, host="hostB")
    rows.append(cancel_row("b-dec-dropped", None, host="hostB", outcome="dropped"))
    rows += cell_rows("b-pre", [3.0, 4.0, 5.0, 6.0], host="hostB", phase="prefill")
    rows += cell_rows("a-enc", [20.0] * 299 + [900.0], workload="stt", phase="encode", mechanism="between_calls",
                      delivery="agent")
    rows += cell_rows("a-sttdec", [5.0] * 296 + [80.0] * 4, workload="stt", phase="decode",
                      mechanism="between_calls", delivery="agent")
    rows.append(cancel_row("ref-lost", None, trial_kind="reference", outcome="lost"))
    rows.append(cancel_row("ref-ok", None, trial_kind="reference", outcome="completed"))
    return rows


def reference_row(trial_id: str, timeline: list[tuple[str, float, float]], *, host: str = "hostA",
                  workload: str = "text", mechanism: str = "abort_callback", engine: str = "text") -> dict:
    """A completed reference run with its phase timeline (ms from t_start) and durations."""
    end = timeline[-1][2]
    return cancel_row(trial_id, None, host=host, workload=workload, mechanism=mechanism, trial_kind="reference",
                      outcome="completed", engine=engine, duration_ms=end + 1.0,
                      phase_timeline_json=json.dumps([list(t) for t in timeline]),
                      phase_durations_json=json.dumps({p: b - a for p, a, b in timeline}))


def _phase_of(offset: float, timeline: list[tuple[str, float, float]]) -> str:
    return next((p for p, a, b in timeline if a <= offset - 1.0 < b), timeline[-1][0])


def demo_like_rows(n: int = 40) -> list[dict]:
    """The default demo's shape: one CPU device, the text workload, three
    mechanisms x two deliveries, prefill then generate, 3 references each.
    Latency grows with the offset inside prefill for between_calls (it waits
    out the decode in flight), stays small for abort_callback."""
    timeline = [("prefill", 0.0, 250.0), ("generate", 250.0, 480.0)]
    scale = {"between_calls": 1.0, "chunked": 0.15, "abort_callback": 0.004}
    rows = []
    for m, k in scale.items():
        rows += [reference_row(f"ref-{m}-{i}", timeline, host="vm", mechanism=m) for i in range(3)]
        for d in ("driver", "agent"):
            for i in range(n):
                off = 5.0 + 430.0 * i / n
                phase = _phase_of(off, timeline)
                wait = (250.0 - off if phase == "prefill" else 14.0 - (off % 14.0)) * k + 0.3
                rows.append(cancel_row(f"{m}-{d}-{i:03d}", wait, host="vm", workload="text", phase=phase,
                                       mechanism=m, delivery=d, offset_ms=off, reference_ms=481.0, engine="text",
                                       settle_ms=0.1, native_call_at_receipt="llama_decode"))
    return rows


SPEECH = {  # workload: (engine, timeline, mechanisms)
    "tts-fixture": ("tts", [("prompt", 0.0, 9.0), ("generate", 9.0, 130.0), ("code2wav", 130.0, 205.0)],
                    ("between_calls", "abort_callback", "graph_eval")),
    "stt-fixture": ("stt", [("preprocess", 0.0, 20.0), ("encode", 20.0, 87.0), ("decode_embd", 87.0, 112.0),
                            ("generate", 112.0, 160.0)], ("between_calls", "abort_callback", "graph_eval")),
}


def speech_rows(n: int = 24, hosts: tuple[str, ...] = ("hostA", "hostB")) -> list[dict]:
    """Two devices, the TTS and STT workloads: graph_eval stops inside the
    heavy graphs (code2wav, encode), the other mechanisms wait them out."""
    rows = []
    for h in hosts:
        for w, (engine, timeline, mechanisms) in SPEECH.items():
            for m in mechanisms:
                rows += [reference_row(f"{h}-{w}-ref-{m}-{i}", timeline, host=h, workload=w, mechanism=m,
                                       engine=engine) for i in range(3)]
                for i in range(n):
                    off = 1.0 + timeline[-1][2] * i / n
                    phase = _phase_of(off, timeline)
                    a, b = next((a, b) for p, a, b in timeline if p == phase)
                    heavy = phase in ("code2wav", "encode") and m != "graph_eval"
                    residue = (b - (off - 1.0)) if heavy else 0.5
                    rows.append(cancel_row(f"{h}-{w}-{m}-{i:03d}", residue + 0.2, host=h, workload=w, phase=phase,
                                           mechanism=m, delivery="agent", offset_ms=off, engine=engine,
                                           reference_ms=timeline[-1][2] + 1.0, settle_ms=0.2,
                                           native_call_at_receipt="graph"))
    return rows


# ----------------------------------------------------------------- browser --
class HeadlessChromium:
    """A headless Chromium driven over the DevTools protocol on a pipe
    (``--remote-debugging-pipe``: fd 3 in, fd 4 out, NUL-separated JSON), so
    the tests need no websocket library and open no port.  Page scripts stay
    blocked by the report's CSP; ``evaluate`` runs in DevTools' context."""

    def __init__(self, browser: str, profile: Path, width: int = 1400, height: int = 900) -> None:
        import os
        import subprocess

        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def wire() -> None:  # in the child: the protocol's fixed descriptors, kept across exec
            src = (os.dup(to_child_r), os.dup(from_child_w))  # copies first: either pipe end may sit on 3 or 4
            for fd, target in zip(src, (3, 4)):
                os.dup2(fd, target, inheritable=True)

        self.proc = subprocess.Popen(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
             "--no-default-browser-check", "--hide-scrollbars", f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=False, preexec_fn=wire)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf, self._next_id, self.events = b"", 0, []
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for method in ("Page.enable", "Runtime.enable", "Log.enable"):
            self.send(method, session=True)
        self.send("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def _read_message(self) -> dict:
        import json
        import os

        while b"\0" not in self._buf:
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, session: bool = False, **params) -> dict:
        import json
        import os

        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str) -> dict:
        for i, ev in enumerate(self.events):
            if ev.get("method") == method:
                return self.events.pop(i)
        while True:
            ev = self._read_message()
            if ev.get("method") == method:
                return ev
            self.events.append(ev)

    def open(self, url: str) -> None:
        self.send("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        import base64

        data = self.send("Page.captureScreenshot", session=True, format="png")["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)

    def console_problems(self) -> list[str]:
        """Console errors, uncaught exceptions and CSP/network log entries seen so far."""
        out = []
        for ev in self.events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.exceptionThrown" or (m == "Runtime.consoleAPICalled" and p.get("type") == "error"):
                out.append(str(p)[:300])
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") in ("error", "warning"):
                out.append(p["entry"].get("text", "")[:300])
        return out

    def close(self) -> None:
        import os

        try:
            self.send("Browser.close")
        except (RuntimeError, OSError):
            pass
        try:
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001 - never leave the browser running
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
