"""Support code for the tests, the examples and the benchmarks, run from a checkout; not part of the wheel.

``testing.tiny_model`` builds a tiny local Llama (random weights, a locally trained tokenizer), so a real
engine runs without a model hub. Tests import it directly (pytest puts the repository root on ``sys.path``);
the example and benchmark scripts put the repository root on ``sys.path`` themselves.
"""
