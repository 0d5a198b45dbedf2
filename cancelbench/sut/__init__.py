"""The engine protocol (docs/sut-protocol.md): an engine in any language, out of process.

* ``protocol``: version, framing, the shipped JSON schema and message validation.
* ``declaration``: what an engine declares in its ``hello`` (phases, mechanisms,
  settings); the built-in engines declare themselves with the same objects.
* ``client``: the agent's side (start, supervise, talk to an engine process).
* ``server``: the engine's side, for engines written in Python.
* ``check``: ``cancelbench sut-check``, the conformance run.

Pure Python; imports neither Ray nor llama.cpp.
"""
