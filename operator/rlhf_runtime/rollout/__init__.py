"""vLLM engine actors (sync, async, stepped) behind one interface (``api.RolloutEngine``)."""
