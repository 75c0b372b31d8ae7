"""kapc: compile retrieval priors into runtime KV access plans.

Layers import one way: prior/ir -> parse -> passes -> pipeline -> lower -> runtime; the compiler
side never imports torch or vLLM."""

__version__ = "0.1.0"
