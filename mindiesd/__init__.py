"""mindiesd: faster diffusion transformers through ``torch.compile``.

- :mod:`mindiesd.compilation`: ``MindieSDBackend`` and ``CompilationConfig``.
- :mod:`mindiesd.ops`: the fused operators (``torch.ops.mindiesd.*``), callable from model code.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
