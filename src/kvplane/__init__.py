"""kvplane: the KV-cache data plane of disaggregated LLM inference.

Importing the package is cheap and never imports optional engines (NIXL, Mooncake, Redis,
transformers, vLLM); each of those lives in its own implementation module.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
