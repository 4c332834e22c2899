"""Test and demo models built locally from a config (no hub); not part of the runtime."""
