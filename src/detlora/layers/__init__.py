"""nn.Modules built on the ops: linear (+LoRA slots), norm, rotary, attention, MLP, decoder
layer. Every module calls its ops through an ``OpBackend`` (``layers/backend.py``)."""
