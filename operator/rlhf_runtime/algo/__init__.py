"""Advantages, objectives (policy and value losses), rewards and prompt data: pure functions of a step's numbers."""
