"""Triton kernels, each with its torch reference (``*_ref``) beside it.

Import the op modules directly (``detlora.ops.lora_shrink``); importing this package does not
load Triton, so ``TRITON_INTERPRET`` can still be set before the kernels are defined.
"""
