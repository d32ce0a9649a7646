"""Adapters that embed kvoffload in inference engines.

Each adapter is an optional extra and imports its engine only when the adapter module itself is imported:
``import kvoffload`` never imports an engine. ``kvoffload.integrations.vllm`` (extra ``vllm``) is the vLLM
KV connector; ``kvoffload.integrations.tiny_model`` builds a small local model for tests and examples.
"""
