"""cancelbench device agents: Ray actors, engines, cancel mechanisms, platform probe."""

import os as _os

# Ray reads its auth mode at import; keep token authentication on (see orchestrator/__init__.py).
_os.environ.setdefault("RAY_AUTH_MODE", "token")
