"""The continuous-batching engine.

`sequence`, `sampling` (parameters) and `scheduler` are pure Python, so the simulator can
drive the very same scheduler without torch. `runner`, `engine` and `llm` hold the model.
"""
