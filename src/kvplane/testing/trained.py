"""A tiny transformers Llama trained for seconds on real text: peaked logits for measuring
lossy KV formats, where the random-weight tiny models' near-flat logits flip on any change.

The corpus is Python's own reference text (``pydoc_data.topics``, fixed per interpreter
version) as ASCII bytes, one token each: the first 90% trains, the rest is held out for
prompts. Training is seeded, on one CPU thread, under a forked RNG (the caller's state is
untouched). Imported by tests and benches only; needs ``transformers``. docs/offload.md
("Codecs").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvplane.validators import require_int

VOCAB = 128
"""ASCII: a byte past 127 becomes ``?``."""
HELD_OUT = 0.1
"""The share of the corpus (its end) kept out of training, for prompts."""
SEQ_LEN = 128
"""Tokens per training sequence: prompts plus continuations stay within it."""


@dataclass(frozen=True, slots=True)
class TrainedLlama:
    """A saved checkpoint (``config.json`` + ``model.safetensors`` in ``path``), the held-out
    token ids its prompts come from, and the mean training loss (nats/token) of its last
    ``steps // 10`` steps."""

    path: Path
    held_out: tuple[int, ...]
    final_loss: float

    def prompts(self, lengths: Sequence[int], seed: int) -> list[list[int]]:
        """Slices of the held-out text of ``lengths``, at seeded starts."""
        g = torch.Generator().manual_seed(seed)
        out = []
        for n in lengths:
            require_int("prompt length", n, min=1, max=len(self.held_out))
            start = int(torch.randint(0, len(self.held_out) - n + 1, (1,), generator=g))
            out.append(list(self.held_out[start : start + n]))
        return out


def corpus_tokens() -> torch.Tensor:
    """The corpus as int64 token ids: every pydoc topic in name order, blank-line separated."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics)).encode()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    return torch.where(data < VOCAB, data, torch.tensor(ord("?")))


def tiny_llama_config(**overrides: Any) -> Any:
    """The transformers ``LlamaConfig`` of the HF-parity tiny Llama (tests/models): 2 layers,
    hidden 64, 4 query and 2 KV heads, vocabulary :data:`VOCAB`."""
    import transformers

    base: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    base.update(overrides)
    return transformers.LlamaConfig(**base)


@contextmanager
def _one_thread(seed: int) -> Iterator[None]:
    """Seeded global RNG and one torch thread inside; both restored after."""
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def train_tiny_llama(
    path: Path, *, steps: int = 240, batch: int = 16, lr: float = 6e-3, seed: int = 0
) -> tuple[TrainedLlama, Any]:
    """Train the tiny Llama for ``steps`` AdamW steps of ``batch`` sequences of
    :data:`SEQ_LEN` tokens (learning rate ``lr``, 20 warm-up steps then linear decay), save it
    to ``path`` with ``save_pretrained`` and return it with the HF model (eval mode). The same
    arguments give the same weights on the same machine and library versions."""
    import transformers

    require_int("steps", steps, min=1)
    require_int("batch", batch, min=1)
    data = corpus_tokens()
    split = int(len(data) * (1 - HELD_OUT))
    train = data[:split]
    losses: list[float] = []
    with _one_thread(seed):
        hf = transformers.LlamaForCausalLM(tiny_llama_config())
        opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.0)
        g = torch.Generator().manual_seed(seed)
        offsets = torch.arange(SEQ_LEN)
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / 20) * (1 - step / steps)
            starts = torch.randint(0, split - SEQ_LEN + 1, (batch, 1), generator=g)
            x = train[starts + offsets]
            loss = hf(input_ids=x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    hf.eval()  # type: ignore[no-untyped-call]
    hf.save_pretrained(path)
    tail = losses[-max(1, steps // 10) :]
    held = tuple(int(t) for t in data[split:].tolist())
    return TrainedLlama(Path(path), held, sum(tail) / len(tail)), hf
