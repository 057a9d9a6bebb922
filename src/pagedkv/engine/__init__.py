"""The continuous-batching engine.

`sequence`, `sampling_params` and `scheduler` are pure Python, so the simulator can
drive the very same scheduler without torch. `runner`, `engine` and `llm` hold the model.
"""
