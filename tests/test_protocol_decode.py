"""The typed decoder (cancelbench.sut.protocol: msgspec) against the published JSON schema
(schema.json through jsonschema, ``protocol.validate_reference``): a generated corpus of
valid and invalid messages of every type goes through both, and they must agree on every
message's accept or reject.

The corpus: for each type, a full message (every optional field) and a minimal one (the
required fields only); every field of them, nested ones included (``engine.name``,
``phases.0.steps``, ``counters.steps``, a setting's ``default``), deleted and replaced by
each of a set of probe values (bools where integers go, ``7.0``, ``2**63``, ``-2**63 - 1``,
strings one past and at their length limits, astral characters, wrong enum values,
``null``, arrays, objects with values of the wrong type); arrays and objects at and past
their item limits; unknown fields with nested values. The reference's "integer" is the
protocol's (a JSON number without a fraction, ``7`` not ``7.0``; JSON Schema's own
"integer" takes ``7.0``), see ``protocol.reference_validator``.

Where they differ on purpose: the typed decoder's parser takes RFC 8259 JSON only
(no ``NaN``/``Infinity``, numbers within a double's range, no unpaired surrogate escapes,
no byte-order mark), where ``json.loads`` took Python's superset."""

from __future__ import annotations

import copy
import json

import pytest

from cancelbench.sut import protocol
from cancelbench.sut.protocol import AGENT_TYPES, ENGINE_TYPES, ProtocolError, decode, validate

I64 = 2 ** 63
SHA = "0123456789abcdef" * 4

FULL = {
    "hello": {"type": "hello", "protocol": 1, "engine": {"name": "acme-tts.x_1", "version": "2.4.1"},
              "build": {"backend": "cpu", "compiler": "clang-17"}, "clock": "CLOCK_MONOTONIC", "input": "text",
              "phases": [{"name": "prompt", "steps": True}, {"name": "output", "steps": False}],
              "mechanisms": [{"name": "native_abort", "reaches": "inside llama_decode"}],
              "settings": [{"name": "n_threads", "type": "int", "default": 4, "min": 1, "max": 512, "doc": "threads"},
                           {"name": "voice", "type": "string", "default": None}]},
    "pong": {"type": "pong", "id": 3, "t": 81220341552},
    "loaded": {"type": "loaded", "t": 81220999000, "settings": {"n_threads": 4, "temp": 0.7, "s": True, "v": "a"},
               "audio_sample_rate": 24000},
    "phase": {"type": "phase", "trial": "sw-1.dev.text.abort.cancel.0007", "phase": "generate", "t": 5},
    "step": {"type": "step", "trial": "t.1", "phase": "generate", "edge": "start", "t": 81220333017},
    "cancel_seen": {"type": "cancel_seen", "trial": "t.1", "t": 7},
    "audio": {"type": "audio", "trial": "t.1", "t": 8, "samples": 4608},
    "done": {"type": "done", "trial": "t.1", "outcome": "cancelled", "t": 9, "phase": "generate",
             "cancel_received_t": 8, "native_returned_t": 9, "output_sha256": SHA, "error": "",
             "counters": {"steps": 3, "tokens": 0}},
    "error": {"type": "error", "of": "load", "message": "no such file"},
    "ping": {"type": "ping", "id": 3, "t": 81220333017},
    "load": {"type": "load", "models": {"model": "/data/m.gguf"},
             "settings": {"n_threads": 4, "voice": "alto", "temp": 0.7, "stream": False, "x": None}},
    "run": {"type": "run", "trial": "t.1", "mechanism": "native_abort", "input": "The quick brown fox",
            "settings": {"n_threads": 4, "x": None}, "output_path": None},
    "cancel": {"type": "cancel", "trial": "t.1"},
    "shutdown": {"type": "shutdown"},
}


def _required(kind: str) -> set[str]:
    return set(protocol.schema()["$defs"][kind]["required"])


MINIMAL = {k: {f: v for f, v in m.items() if f in _required(k)} for k, m in FULL.items()}

PROBES = [
    None, True, False, 0, 1, -1, 7.0, 999, 1000, 768_000, 768_001, 2 ** 31 - 1, 2 ** 31, -0.0, 1.5, 1e300, I64 - 1, I64, -I64, -I64 - 1, 2 ** 64, 10 ** 30,
    "", "x", "a" * 63, "a" * 64, "a" * 65, "a" * 128, "a" * 129, "a" * 200, "a" * 201, "a" * 1000, "a" * 1001,
    "a" * 1024, "a" * 1025, "a" * 100_000, "\U0001F600" * 200, "\U0001F600" * 201, "ab\n", "a b", "a\x00",
    "start", "end", "completed", "cancelled", "error", "int", "float", "bool", "string", "text", "audio_path",
    "none", "load", "CLOCK_MONOTONIC", SHA, SHA.upper(), SHA[:63], SHA + "0", "acme-tts.1",
    [], [1], [{}], [{"name": "p", "steps": True}], [{"name": "m", "reaches": ""}],
    {}, {"k": 1}, {"k": "v"}, {"k": 7.0}, {"k": None}, {"k": True}, {"k": I64}, {"k": []},
    {"name": "n", "version": "1"}, {"name": "n"},
]


def _paths(value, prefix=()):
    """Every path into a message (dict keys, and the first item of an array)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list) and value:
        yield prefix + (0,)
        yield from _paths(value[0], prefix + (0,))


def _set(msg, path, value):
    msg = copy.deepcopy(msg)
    node = msg
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return msg


def _delete(msg, path):
    msg = copy.deepcopy(msg)
    node = msg
    for p in path[:-1]:
        node = node[p]
    del node[path[-1]]
    return msg


def _sized(kind, field, item, n):
    return _set(FULL[kind], (field,), [copy.deepcopy(item) | ({"name": f"n{i}"} if "name" in item else {})
                                       for i in range(n)])


def corpus():
    """(name, message, path or None): the generated corpus."""
    for kind in FULL:
        for base_name, base in (("full", FULL[kind]), ("minimal", MINIMAL[kind])):
            yield f"{kind}/{base_name}", base, None
            yield f"{kind}/{base_name}/extra", base | {"zz_new": {"deep": [1, {"x": None}]}, "zz2": 7.0}, None
            for path in _paths(base):
                if path == ("type",):
                    continue
                yield f"{kind}/{base_name}/del:{path}", _delete(base, path), path
                for i, probe in enumerate(PROBES):
                    yield f"{kind}/{base_name}/{path}={i}", _set(base, path, probe), path
                if isinstance(path[-1], str) and len(path) > 1:  # an unknown key beside it
                    yield f"{kind}/{base_name}/{path}+", _set(base, path[:-1] + ("zz_new",), 7.0), path
        # type confusion at the top
        for probe in (None, 1, True, [], {}, kind.upper(), kind + " "):
            yield f"{kind}/type={probe!r}", FULL[kind] | {"type": probe}, ("type",)
    # arrays and objects at and past their limits
    hello = FULL["hello"]
    for field, item, limit in (("phases", hello["phases"][0], 32), ("mechanisms", hello["mechanisms"][0], 16),
                               ("settings", hello["settings"][0], 128)):
        for n in (0, 1, limit, limit + 1):
            yield f"hello/{field}x{n}", _sized("hello", field, item, n), (field,)
    for n in (0, 64, 65):
        yield f"hello/buildx{n}", _set(hello, ("build",), {f"k{i}": "v" for i in range(n)}), ("build",)
    for value in (1, 7.0, True, None, "3", I64, -I64 - 1, [3], {"n": 3}):
        yield f"done/counters={value!r}", _set(FULL["done"], ("counters",), {"steps": 3, "odd": value}), ("counters",)
    for s in ({"name": "x", "type": "float", "default": 0.5, "min": True},
              {"name": "x", "type": "float", "default": 0.5, "min": 10 ** 30, "max": 1e300},
              {"name": "x", "type": "bool", "default": [True]}, {"name": "x", "type": "int"},
              {"name": "x", "type": "integer", "default": 1}, {"name": "x y", "type": "int", "default": 1}):
        yield f"hello/setting={s!r}", _set(hello, ("settings",), [s]), ("settings",)


CORPUS = list(corpus())


def direction(kind):
    return ENGINE_TYPES if kind in ENGINE_TYPES else AGENT_TYPES


def outcome(f, *args):
    try:
        return True, f(*args)
    except ProtocolError as exc:
        return False, str(exc)


def test_the_corpus_covers_every_type_both_ways():
    seen: dict[str, set[bool]] = {}
    for name, msg, _ in CORPUS:
        kind = name.split("/")[0]
        seen.setdefault(kind, set()).add(outcome(protocol.validate_reference, msg, direction(kind))[0])
    assert set(seen) == set(ENGINE_TYPES) | set(AGENT_TYPES)
    assert all(v == {True, False} for v in seen.values()), seen
    assert len(CORPUS) > 5000


@pytest.mark.parametrize("kind", list(FULL))
def test_fast_decoder_and_json_schema_agree_on_every_message(kind):
    allowed = direction(kind)
    checked = disagree = 0
    problems = []
    for name, msg, path in CORPUS:
        if not name.startswith(kind + "/"):
            continue
        line = json.dumps(msg, ensure_ascii=False).encode() + b"\n"
        want, why = outcome(protocol.validate_reference, json.loads(line), allowed)
        got, said = outcome(decode, line, allowed)
        also, _ = outcome(validate, copy.deepcopy(msg), allowed)  # the dict path (an engine's own messages)
        checked += 1
        if want != got or want != also:
            disagree += 1
            problems.append(f"{name}: schema {'accepts' if want else 'rejects: ' + why[:120]}, decode "
                            f"{'accepts' if got else 'rejects: ' + said[:120]}, validate {also}")
            continue
        if got:
            assert said == json.loads(line), name  # the message itself, unknown fields kept
        else:
            assert "\n" not in said and len(said) < 600, (name, said)
            if path is not None and path != ("type",):
                assert str(path[0]) in said, (name, said)  # the error names the field
    assert checked >= 10
    assert not problems, "\n".join(problems[:40])


@pytest.mark.parametrize("text, accepted", [
    ("7", True), ("-0", True), ("9223372036854775807", True), ("-9223372036854775808", True),
    ("7.0", False), ("7e0", False), ("7E2", False), ("1.5", False), ("9223372036854775808", False),
    ("-9223372036854775809", False), ("18446744073709551616", False), ("true", False), ('"7"', False),
    ("null", False),
])
def test_integers_are_written_without_a_fraction_and_fit_int64(text, accepted):
    for kind, field in (("pong", "t"), ("pong", "id"), ("done", "t"), ("hello", "protocol")):
        line = json.dumps(FULL[kind]).replace(f'"{field}": {json.dumps(FULL[kind][field])}',
                                              f'"{field}": {text}', 1).encode()
        assert line != json.dumps(FULL[kind]).encode()
        want, _ = outcome(protocol.decode_reference, line, ENGINE_TYPES)
        got, said = outcome(decode, line, ENGINE_TYPES)
        assert want == got == accepted, (kind, field, text, said)
    counters = json.dumps(FULL["done"]).replace('"steps": 3', f'"steps": {text}').encode()
    assert outcome(decode, counters, ENGINE_TYPES)[0] == outcome(protocol.decode_reference, counters,
                                                                 ENGINE_TYPES)[0] == accepted


def test_unknown_types_are_skipped_only_when_asked_and_non_objects_are_errors():
    for line in (b'{"type": "frobnicate", "x": 1}\n', b'{"type": "ping", "id": 1, "t": 1}\n'):
        assert decode(line, ENGINE_TYPES, skip_unknown=True) is None
        assert protocol.decode_reference(line, ENGINE_TYPES, skip_unknown=True) is None
        with pytest.raises(ProtocolError, match="unexpected message type"):
            decode(line, ENGINE_TYPES)
    for line, says in ((b"[1, 2]\n", "JSON object"), (b'"step"\n', "JSON object"), (b"{}\n", "string 'type'"),
                       (b'{"type": 7}\n', "string 'type'"), (b'{"type": null}\n', "string 'type'")):
        for skip in (False, True):
            with pytest.raises(ProtocolError, match=says):
                decode(line, ENGINE_TYPES, skip_unknown=skip)
            with pytest.raises(ProtocolError, match=says):
                protocol.decode_reference(line, ENGINE_TYPES, skip_unknown=skip)


def test_lines_that_are_not_json_are_one_line_errors():
    deep = b'{"type": "cancel_seen", "trial": "t", "t": 1, "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n"
    cases = [b"this is not JSON {\n", b"\xff\xfe\n", b"\n", b'{"type": "step"} junk\n', b"[" * 100_000 + b"\n",
             deep, b'{"type": "pong", "id": 1, "t": NaN}\n', b'{"type": "pong", "id": 1, "t": 1, "x": Infinity}\n',
             b'{"type": "loaded", "t": 1, "settings": {"x": 1e400}}\n',
             b'{"type": "error", "message": "\\ud800"}\n', b'\xef\xbb\xbf{"type": "shutdown"}\n']
    for line in cases:
        with pytest.raises(ProtocolError, match="not JSON") as exc:
            decode(line, ENGINE_TYPES + AGENT_TYPES, skip_unknown=True)
        assert "\n" not in str(exc.value)
        assert protocol.type_of(line) is None


def test_duplicate_keys_take_the_last_like_json_loads():
    line = b'{"type": "step", "trial": "t", "phase": "p", "edge": "start", "t": "x", "t": 5}\n'
    assert decode(line, ENGINE_TYPES) == json.loads(line)
    line = b'{"type": "step", "trial": "t", "phase": "p", "edge": "start", "t": 5, "t": 5.5}\n'
    with pytest.raises(ProtocolError, match="t: expected `int`"):
        decode(line, ENGINE_TYPES)


def test_errors_name_the_field_in_one_line():
    cases = [(_delete(FULL["step"], ("trial",)), "`trial`"), (_set(FULL["step"], ("edge",), "middle"), "edge: "),
             (_set(FULL["hello"], ("phases", 0, "name"), "a b"), "phases.0.name: "),
             (_set(FULL["done"], ("counters", "steps"), 1.5), "counters"),
             (_set(FULL["error"], ("message",), "x\n" * 1000 + "\u2028"), None)]
    for msg, says in cases:
        kind = msg["type"]
        ok, said = outcome(validate, msg, direction(kind))
        if says is None:
            assert ok
            continue
        assert not ok and said.startswith(f"malformed {kind}: ") and says in said and "\n" not in said, said


def test_python_built_messages_are_valid_when_their_json_is():
    class Float(float):  # numpy's float64 is a float subclass
        pass

    msg = {"type": "loaded", "t": 1, "settings": {"temp": Float(0.7)}}
    assert validate(msg, ("loaded",)) is msg
    assert protocol.validate_reference(msg, ("loaded",)) is msg
    bad = {"type": "loaded", "t": 1, "settings": {"temp": object()}}
    with pytest.raises(ProtocolError, match="settings"):
        validate(bad, ("loaded",))


def test_the_schema_file_is_the_contract_the_structs_follow():
    """Every definition of a message type has a Struct, field for field, the same ones required."""
    import msgspec

    defs = protocol.schema()["$defs"]
    assert set(protocol.STRUCTS) == set(ENGINE_TYPES) | set(AGENT_TYPES)
    for kind, struct in protocol.STRUCTS.items():
        fields = msgspec.structs.fields(struct)
        assert {f.name for f in fields} == set(defs[kind]["properties"]) - {"type"}, kind
        assert {f.name for f in fields if f.required} == set(defs[kind]["required"]) - {"type"}, kind


def test_random_mutations_agree():
    """Random JSON values at random paths of every type's message (hypothesis)."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    leaf = (st.none() | st.booleans() | st.integers(min_value=-2 ** 65, max_value=2 ** 65)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=80)
            | st.sampled_from(["start", "end", "int", "text", "done", SHA, "a" * 201]))
    values = st.recursive(leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids,
                                                                                          max_size=3), max_leaves=8)
    kinds = st.sampled_from(sorted(FULL))

    @settings(max_examples=400, deadline=None, database=None)
    @given(kinds, st.data(), values, st.booleans())
    def check(kind, data, value, minimal):
        base = (MINIMAL if minimal else FULL)[kind]
        paths = [p for p in _paths(base) if p != ("type",)]
        if not paths:
            return
        path = data.draw(st.sampled_from(paths))
        msg = _set(base, path, value)
        line = json.dumps(msg).encode()
        want, why = outcome(protocol.validate_reference, json.loads(line), direction(kind))
        got, said = outcome(decode, line, direction(kind))
        assert want == got, (msg, why, said)

    del hypothesis
    check()
