"""``import deep_ep`` served by moelink (the ``moelink-deep-ep`` alias package).

Frameworks that call DeepEP (vLLM, SGLang, Megatron-Core) import ``deep_ep`` and
use ``Buffer``, ``Config``, ``EventOverlap``, ``topk_idx_t`` and
``deep_ep.utils.{EventOverlap, EventHandle}``; this package maps those names onto
moelink, so they run unchanged. It refuses to load where a real DeepEP is
installed (its compiled ``deep_ep_cpp`` module is present): it must never shadow
it. Install: ``pip install ./python/deep_ep_alias`` from a moelink checkout.
"""

import importlib.util as _util

if _util.find_spec("deep_ep_cpp") is not None:
    raise ImportError(
        "a real DeepEP is installed here (deep_ep_cpp is importable), and moelink's "
        "deep_ep alias refuses to shadow it: `pip uninstall moelink-deep-ep` to use "
        "DeepEP, or remove DeepEP to use moelink under `import deep_ep`"
    )

from moelink import Buffer, Config, EventHandle, EventOverlap, topk_idx_t  # noqa: E402

from . import utils  # noqa: E402

#: Which library serves ``import deep_ep`` (a real DeepEP has no such name).
BACKEND = "moelink"

__all__ = ["BACKEND", "Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t", "utils"]
