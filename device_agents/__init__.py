"""cancelbench device agents: Ray actors, engines, cancel mechanisms, platform probe."""
