"""Adapters that embed kvoffload in inference engines.

Each adapter is an optional extra and imports its engine only when the adapter module itself is imported:
``import kvoffload`` never imports an engine. ``kvoffload.integrations.vllm`` (extra ``vllm``) is the vLLM
KV connector. (The tiny local model the tests, examples and benchmarks run it on is ``testing.tiny_model`` in
the repository, not part of the package.)
"""
