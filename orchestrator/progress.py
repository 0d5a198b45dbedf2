"""What a sweep shows and counts while it runs: one progress bar per device, and the
callback that takes each finished trial's record (:class:`Recorder`)."""

from __future__ import annotations

import collections
import threading


class ProgressBars:
    """One progress bar per device: trials done, dropped so far, ETA (tqdm)."""

    def __init__(self, totals: dict[str, int], enabled: bool) -> None:
        self.bars = {}
        self.dropped = collections.Counter()
        if enabled:
            import sys

            from tqdm import tqdm
            interval = 0.5 if sys.stderr.isatty() else 30.0  # a log file gets a line every 30 s
            for i, (key, total) in enumerate(sorted(totals.items())):
                self.bars[key] = tqdm(total=total, desc=key, position=i, unit="trial", leave=True,
                                      dynamic_ncols=True, mininterval=interval)

    def update(self, key: str, outcome: str) -> None:
        if outcome == "dropped":
            self.dropped[key] += 1
        bar = self.bars.get(key)
        if bar is not None:
            bar.set_postfix(dropped=self.dropped[key], refresh=False)
            bar.update(1)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()



class Recorder:
    """``record(device key, row)``: a finished trial's record into the sink, counted and shown.
    Once the sweep is stopping (``stop`` set: a signal, a full disk) it takes no more records:
    the trial runs again on --resume (``stopping`` is raised in the device's run)."""

    def __init__(self, sink, result, progress: ProgressBars, stop: threading.Event,
                 stopping: type[Exception]) -> None:
        """``result``: the SweepResult whose ``outcomes`` and ``written`` count the records."""
        self.sink, self.result, self.progress, self.stop, self.stopping = sink, result, progress, stop, stopping
        self._lock = threading.Lock()

    def __call__(self, key: str, row: dict) -> None:
        if self.stop.is_set():  # interrupted: this trial runs again on --resume
            raise self.stopping("the sweep is stopping")
        self.sink.add(row)
        with self._lock:
            self.result.outcomes[row["outcome"]] += 1
            self.result.written += 1
        self.progress.update(key, row["outcome"])
        if self.sink.disk_full:  # the record is kept (memory, then a fallback file): take no more trials
            self.stop.set()
            raise self.stopping("no space left for the records")
