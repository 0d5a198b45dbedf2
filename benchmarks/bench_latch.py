"""The word's latch with and without the run delay read (libcancelbench ABI 1.3, cb_token_word_wait_ns).

A receipt the native reader latches from the shared cancel word carries that thread's stamps for
the residue split: its CPU clock and, since ABI 1.3 on Linux, its run delay, one ``pread`` of the
schedstat the thread opened when it watched the word. The latch runs on the stop's path, once a
trial, so its cost adds to the engine's latency. Two latches, interleaved over ``--rounds`` rounds
of ``--samples`` each, each timed around one ``cb_token_is_set`` that latches a word already at the
trial's number (the ctypes call's own cost is in both, so the difference is the read):

* ``reads_wait``: on a thread that has watched a word before (its schedstat is open: the latch
  reads it);
* ``no_wait``: on a thread that never watched one (no schedstat open: the latch reads no run delay).

In both the token's watch is set up by another thread and handed over (two semaphores), so the
two differ only in the read.

Writes ``benchmarks/results/latch.json`` with the machine facts beside the numbers.

Target: the run delay read adds under 5 us at p50 to a latch (2.5 % of the 0.2 ms the protocol
benchmark allows the whole word path).

    python benchmarks/bench_latch.py [--samples 20000] [--rounds 3] [--out PATH] [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

from cancelbench import native  # noqa: E402
from cancelbench.sut import cancel_word  # noqa: E402

TARGET_US = 5.0
OUT = Path(__file__).resolve().parent / "results" / "latch.json"


def _latch(token: native.CancelToken, word, seq: int) -> int:
    """One latch, timed (ns): the word is at seq, the token watches it and is not yet set."""
    t0 = native.now_ns()
    latched = token.is_set()
    t1 = native.now_ns()
    if not latched:
        raise RuntimeError("the token did not latch the word")
    return t1 - t0


def latches(word, samples: int, seq0: int, latcher_watched: bool) -> tuple[list[int], int]:
    """Latches on one thread, each watch set up by another (the same hand-over in both variants, so
    only the run delay read differs); returns the times and how many latches read a run delay."""
    token, out, with_wait = native.CancelToken(), [], 0
    ready, taken = threading.Semaphore(0), threading.Semaphore(0)

    def watcher() -> None:
        for i in range(samples):
            token.reset()
            token.watch(word.address, seq0 + i)
            word.store(seq0 + i)
            ready.release()
            taken.acquire()

    def latcher() -> None:
        nonlocal with_wait
        if latcher_watched:  # a watch of its own opens this thread's schedstat, so its latches read it
            native.CancelToken().watch(word.address, 1 << 62)
        for i in range(samples):
            ready.acquire()
            out.append(_latch(token, word, seq0 + i))
            with_wait += token.word_latch[2] is not None
            taken.release()
    threads = [threading.Thread(target=watcher), threading.Thread(target=latcher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, with_wait


def _stats(ns: list[int]) -> dict:
    s = sorted(ns)
    return {"n": len(s), "p50_us": s[len(s) // 2] / 1e3, "p90_us": s[int(len(s) * 0.9)] / 1e3,
            "p99_us": s[int(len(s) * 0.99)] / 1e3, "mean_us": statistics.fmean(s) / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20_000, help="latches per variant and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    if args.samples < 100 or args.rounds < 1:
        sys.exit("bench_latch: --samples must be at least 100 and --rounds at least 1")
    word = cancel_word.create()
    if word is None:
        sys.exit("bench_latch: no shared cancel word on this platform")
    machine, load0, started = harness.machine_facts(), harness._loadavg(), time.time()
    times: dict[str, list[int]] = {"reads_wait": [], "no_wait": []}
    read: dict[str, int] = {"reads_wait": 0, "no_wait": 0}
    seq = 1
    try:
        for _ in range(args.rounds):
            for name, watched in (("reads_wait", True), ("no_wait", False)):
                ns, with_wait = latches(word, args.samples, seq, watched)
                seq += args.samples
                times[name] += ns
                read[name] += with_wait
    finally:
        word.close()
    variants = {name: {**_stats(ns), "latches_with_run_delay": read[name]} for name, ns in times.items()}
    added = variants["reads_wait"]["p50_us"] - variants["no_wait"]["p50_us"]
    doc = {"benchmark": "latch", "note": args.note, "machine": machine, "load_avg_start": load0,
           "load_avg_end": harness._loadavg(), "started_unix": round(started), "wall_s": round(time.time() - started, 1),
           "samples": args.samples, "rounds": args.rounds, "variants": variants,
           "added_p50_us": round(added, 3), "target_us": TARGET_US, "met": added < TARGET_US}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for name, v in variants.items():
        print(f"{name:>10}: p50 {v['p50_us']:.2f} us  p90 {v['p90_us']:.2f}  p99 {v['p99_us']:.2f}  "
              f"(run delay read in {v['latches_with_run_delay']} of {v['n']})")
    print(f"the run delay read adds {added:.2f} us at p50 (target < {TARGET_US} us): "
          f"{'met' if doc['met'] else 'NOT met'}; {args.out}")


if __name__ == "__main__":
    main()
