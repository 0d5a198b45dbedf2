"""The outcome rule (docs/sut-protocol.md, "The outcome rule"): a record's outcome from what the agent
saw on its own clock. The engine under test is not trusted to judge itself: its word can confirm a
defect, never acquit one. Pure functions over a record row (a dict of columns, cancelbench.schema);
``schema.finalize`` and ``sut-check`` apply the same rule.
"""

from __future__ import annotations

# What a record's outcome can be (not_run trials are listed in the manifest, never written as rows).
OUTCOMES = ("cancelled", "completed", "dropped", "error", "lost")
# Outcomes that are defects of the system under test or of the harness (report verdict FAIL).
DEFECT_OUTCOMES = ("dropped", "lost")

# Derived columns that only a stop has: a completed row carries none of them (the cancel raced the completion).
STOP_COLUMNS = ("observe_ms", "return_ms", "settle_ms", "latency_ms", "end_to_end_ms", "cost_ratio", "protocol_hop_ms")
REFERENCE_CANCEL_ERROR = ("the engine reported a cancel on a reference run, which is sent none ({what}): its "
                          "cancel state is not this trial's")


def drop_margin_ns(row: dict) -> int | None:
    """How long after the cancel could have reached the engine its terminal state came, on the agent's own
    stamps (docs/sut-protocol.md, "The outcome rule"); None when the agent took no cancel."""
    received = row.get("t_received_ns")
    if received is None:
        return None
    forwarded = row.get("t_cancel_forwarded_ns")
    seen_end = row.get("t_engine_done_read_ns")
    if forwarded is None or seen_end is None:  # in process: receipt and terminal decision are one lock apart
        forwarded, seen_end = received, row.get("t_terminal_ns")
    if seen_end is None:
        return None
    return seen_end - forwarded - (row.get("cancel_reach_ns") or 0) - (row.get("cancel_stall_ns") or 0)


def classify_outcome(row: dict) -> tuple[str, str | None]:
    """The one outcome rule, used for every record: (outcome, error message when it changed to error).

    From the agent's own facts: a run that completed although the agent took its cancel while the trial
    was pending or running, and whose terminal state came at or after the time the cancel could have
    reached the engine (``drop_margin_ns`` >= 0), dropped it: a defect, whatever path the cancel took
    (latched before the start, or delivered while running), whether or not the engine says it read it.
    The engine's own word can only confirm: a completed run whose engine says it read the cancel before
    its terminal state dropped it too. A reference run (sent no cancel) that reports one is an error of
    the engine. Everything else is what the engine (or the agent) reported.
    """
    outcome = row.get("outcome")
    if outcome not in OUTCOMES:
        raise ValueError(f"unknown outcome {outcome!r}")
    engine_read = row.get("t_engine_received_ns")
    if row.get("trial_kind") == "reference" and outcome in ("cancelled", "completed", "dropped"):
        if outcome == "cancelled" or engine_read is not None:
            what = "it ended cancelled" if outcome == "cancelled" else "done.cancel_received_t"
            return "error", REFERENCE_CANCEL_ERROR.format(what=what)
    if outcome != "completed" or row.get("t_received_ns") is None:
        return outcome, None
    terminal = row.get("t_terminal_ns")
    if engine_read is not None and terminal is not None and engine_read <= terminal:
        return "dropped", None  # the engine confirms it: it read the cancel, then completed anyway
    margin = drop_margin_ns(row)
    return ("dropped" if margin is not None and margin >= 0 else "completed"), None
