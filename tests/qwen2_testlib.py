"""The tiny random Qwen2 mixing sliding-window and full-attention layers that the models,
pipeline and serving tests share: its layer pattern (window :data:`WINDOW`, layers alternating
sliding and full from a sliding one) and its transformers checkpoint (:class:`MixedQwen2`,
whose greedy tokens are the reference).

The one home of that model's shape; the kvplane config of the same pattern on the models tests'
small dims is ``models_testlib.mixed_qwen2``. Builds models and checkpoints only: the tests own
what they assert. Imported as ``qwen2_testlib`` (``tests/conftest.py`` puts this directory on
``sys.path``; the session fixture ``mixed_qwen2`` there is a 3-layer :class:`MixedQwen2`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

WINDOW = 8
"""The sliding layers' window, in tokens."""
SLIDING, FULL = "sliding_attention", "full_attention"


def mixed_layer_types(num_layers: int) -> tuple[str, ...]:
    """``num_layers`` layer types alternating sliding, full, sliding, ... (transformers'
    ``layer_types`` names)."""
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))


class MixedQwen2:
    """A tiny random transformers Qwen2 (vocab 128, hidden 64, 4 heads, 2 KV heads of 16,
    float32) of ``num_layers`` :func:`mixed_layer_types` layers, window :data:`WINDOW`,
    initialised from ``torch.manual_seed(seed)`` and saved at ``root``; :meth:`greedy` is
    transformers' own greedy continuation. Skips the test without transformers/safetensors."""

    def __init__(self, root: Path, *, num_layers: int = 3, seed: int = 33) -> None:
        transformers = pytest.importorskip("transformers")
        pytest.importorskip("safetensors")
        self.types = mixed_layer_types(num_layers)
        torch.manual_seed(seed)
        cfg = transformers.Qwen2Config(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            use_sliding_window=True, sliding_window=WINDOW, layer_types=list(self.types),
        )  # fmt: skip
        self.hf: Any = transformers.Qwen2ForCausalLM(cfg).eval()
        self.path = root
        self.hf.save_pretrained(root)

    def greedy(self, tokens: list[int], new: int) -> list[int]:
        """The ``new`` tokens after ``tokens`` of transformers' greedy search (no EOS stop)."""
        ids = torch.tensor([tokens])
        with torch.no_grad():
            out = self.hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        return [int(t) for t in out[0, len(tokens) :]]
