"""Native Sparse Attention (NSA): exact reference, vectorized PyTorch, fast paths, decode cache.

Public names load lazily (PEP 562) so that `python -m nsa_env` can still report on an environment
whose torch fails to import.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "NSAConfig": "config",
    "NSAInputError": "validation",
    "nsa_attention": "functional",
    "nsa_reference": "reference",
    "NSACache": "cache",
    "PagedNSACache": "paged_cache",
    "nsa_decode": "decode",
    "nsa_prefill": "decode",
    "NSAAttention": "attention",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nsa' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
