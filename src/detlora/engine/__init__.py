"""The inference engine: sequences, paged KV blocks, continuous batching, model runner (CUDA
graphs), batch-invariant sampler and fingerprints; ``LLM`` wraps it in ``detlora.entrypoints``.

Import submodules directly (``detlora.entrypoints.llm``); importing this package loads nothing.
"""
