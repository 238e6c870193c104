"""Shared model runner: the engine that prefill, decode and colocated ranks run.

Data-flow order: sampling_params -> sequence -> kv_cache -> scheduler ->
model_runner (models/, layers/) -> sampler -> llm_engine.
"""
