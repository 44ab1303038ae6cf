"""Version 1 of the worker protocol (generated stubs)."""
