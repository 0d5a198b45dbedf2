"""An engine that sends the hello line it is given, verbatim, then reads stdin to its end:
``python raw_hello.py 'LINE'``.

For hellos no real engine should send but JSON can carry (a setting declared with
``"min": NaN``, ``"max": Infinity``, min above max, a default outside its bounds): the
agent's pre-flight and ``sut-check`` must refuse them at the hello. Nothing after the
hello is answered; a check that refuses the hello never gets that far.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: raw_hello.py 'HELLO-LINE'", file=sys.stderr)
        sys.exit(2)
    os.write(1, sys.argv[1].encode() + b"\n")
    while os.read(0, 1 << 16):  # until the agent closes our stdin (or kills us)
        pass
