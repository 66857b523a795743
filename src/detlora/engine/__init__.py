"""The inference engine: sequences, paged KV blocks, continuous batching, model runner (CUDA
graphs for decode), batch-invariant sampler, fingerprints and the ``LLM`` API.

Import submodules directly (``detlora.entrypoints.llm``); importing this package loads nothing.
"""
