"""A mechanism means the same thing in every engine: what ``LlamaEngine.prepare``
arms on the context set a trial runs on, read back from the native token.

With the token already set, one ``llama_decode`` on the prepared llama context
shows what is armed: the abort reader stops it with rc 2 and stamps ``seen``
without synchronizing node ranges; the eval reader (graph_eval) stops it at its
first range (``syncs`` > 0, rc 0: the stop is silent); nothing native looks at
the token under between_calls and chunked.
"""

from __future__ import annotations

import llama_cpp
import pytest

from cancelbench import native
from cancelbench.datasets import speech_fixtures as SF
from cancelbench.device_agents.engines import llama_runtime as rt
from cancelbench.device_agents.engines.base import CancelControl, Progress
from cancelbench.device_agents.engines.registry import MECHANISMS
from cancelbench.device_agents.engines.stt import SttEngine
from cancelbench.device_agents.engines.text import TextEngine
from cancelbench.device_agents.engines.tts import TtsEngine
from cancelbench.request import TrialRequest


@pytest.fixture(scope="module", params=["text", "tts", "stt"])
def engine(request, small_text_model):
    if request.param == "text":
        eng = TextEngine({"model": small_text_model, "n_threads": 1, "prompt_tokens": 32, "max_tokens": 2,
                          "n_batch": 32})
    else:
        paths = SF.ensure_speech_fixtures()["tts" if request.param == "tts" else "asr"]
        cls = TtsEngine if request.param == "tts" else SttEngine
        eng = cls({"model": str(paths["model"]), "mmproj": str(paths["mmproj"]), "n_threads": 1, "n_batch": 32})
    yield eng
    eng.close()


def _decode_with_the_token_set(eng, mechanism: str) -> tuple[int, CancelControl]:
    ctl = CancelControl(native.CancelToken(), Progress())
    _, cset = eng.prepare(TrialRequest(input="x", mechanism=mechanism), ctl)
    llama_cpp.llama_memory_clear(cset.mem, True)
    ctl.token.set()
    batch = rt.Batch(8)
    try:
        rc = llama_cpp.llama_decode(cset.ctx, batch.fill([1, 2, 3, 4, 5, 6, 7, 8], 0, True))
        llama_cpp.llama_synchronize(cset.ctx)
    finally:
        batch.free()
    return rc, ctl


@pytest.mark.parametrize("mechanism", list(MECHANISMS))
def test_prepare_arms_what_the_mechanism_says_on_every_engine(engine, mechanism):
    mech = MECHANISMS[mechanism]
    rc, ctl = _decode_with_the_token_set(engine, mechanism)
    token = ctl.token
    if mech.eval_hook:  # graph_eval: the llama context's scheduler polls the eval reader ...
        assert token.syncs > 0 and token.seen_ns >= token.set_ns > 0
        assert rc == 0  # ... and stops silently (no abort callback armed)
    elif mech.abort_callback:  # the CPU backend polls the abort reader after each node
        assert rc == 2 and token.seen_ns >= token.set_ns > 0 and token.syncs == 0
    else:
        assert rc == 0 and token.seen_ns == 0 and token.polls == 0
