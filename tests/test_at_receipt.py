"""done.at_receipt (protocol 1.2): an engine's progress when it took the cancel, bounded by the
decode before it can reach a record (the sweep's rows: tests/test_external_sweep.py)."""

from __future__ import annotations

import pytest

from cancelbench.sut import protocol
from cancelbench.sut.trial import Result

RUN = {"trial": "t1", "mechanism": "between_calls", "input": "x"}
DONE = {"type": "done", "trial": "t1", "outcome": "cancelled", "t": 10, "phase": "prefill", "cancel_received_t": 5}


@pytest.mark.parametrize("check", [protocol.validate, protocol.validate_reference])
@pytest.mark.parametrize("at_receipt, ok", [
    ({"tokens_generated": 3, "input_tokens_done": 64, "frames_generated": 0}, True),
    ({"tokens_generated": 3}, True),
    ({"tokens_generated": 3, "later_field": "x"}, True),  # unknown fields ignored (a later revision)
    ({"native_call": "llama_decode", "heavy_graph": "code2wav"}, True),  # 1.5, 1.4
    ({"native_call": "llama decode\u001b[31m"}, False),  # an identifier only: nothing a terminal would run
    ({"native_call": "x" * 65}, False),
    ({"native_call": 3}, False),
    ({"tokens_generated": -1}, False),
    ({"input_tokens_done": 2**63}, False),
    ({"frames_generated": 1.5}, False),
    ({"tokens_generated": True}, False),
    ([3], False),
])
def test_at_receipt_is_checked_by_both_decoders(check, at_receipt, ok):
    """The Struct (the agent's decoder) and schema.json (the reference) agree on every case."""
    msg = {**DONE, "at_receipt": at_receipt}
    if ok:
        assert check(msg, protocol.TRIAL_EVENTS)["at_receipt"] == at_receipt
    else:
        with pytest.raises(protocol.ProtocolError, match="at_receipt"):
            check(msg, protocol.TRIAL_EVENTS)


def test_the_engine_library_sends_it_with_a_receipt_only():
    """Trial._done: the known fields that have a value, and only with cancel_received_t."""
    from helpers import RecordingServer

    res = Result("cancelled", at_receipt={"tokens_generated": 2, "input_tokens_done": None, "other": 9,
                                          "native_call": "llama_decode", "heavy_graph": None})
    assert "at_receipt" not in RecordingServer().run()._done(res)  # no receipt: nothing to say it of
    trial = RecordingServer().run()
    assert trial.took_cancel(7, "line")
    done = trial._done(res)
    assert done["at_receipt"] == {"tokens_generated": 2, "native_call": "llama_decode"} and done["cancel_received_t"] == 7
