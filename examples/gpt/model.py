"""A small GPT in the TorchTitan manner: explicit modules, global layer names.

Two properties matter to Tenplex and shape this file:

* **Parameter names are global and configuration-independent.** The blocks
  live in an ``nn.ModuleDict`` keyed by the global layer index, so a pipeline
  stage that keeps layers 2 and 3 still calls them ``layers.2`` and
  ``layers.3``; the embedding, final norm and output projection keep their
  names on whichever stage owns them. Modules a stage does not own are set to
  ``None`` and skipped by :meth:`GPT.forward`.
* **Initial values do not depend on the parallel configuration.** Every
  parameter is drawn from its own generator seeded by ``(seed, parameter
  name)``, on CPU, at full (global) size, so the model has the same values
  whether it is built whole, as one pipeline stage, or before tensor/data
  parallelism cuts it. Continuity tests across configuration changes rely on
  this.

Tensor parallelism works on the local view (TorchTitan style): attention
derives the number of local heads from the local width of ``wq`` output, so
the same module serves tp=1 and column-parallel ``wq/wk/wv``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tenplex.errors import InvalidConfig


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """Model dimensions. ``ffn_dim`` defaults to 4 x ``dim``."""

    vocab: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int | None = None
    seq_len: int = 16
    gated: bool = False
    """SwiGLU feed-forward (``w1``, ``w3`` gate, ``w2``) instead of GELU (``w1``, ``w2``)."""
    tied: bool = False
    """Share ``output.weight`` with ``tok_embeddings.weight`` (only possible without pipelining)."""
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "n_layers", "n_heads", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidConfig(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.ffn_dim is not None and (not isinstance(self.ffn_dim, int) or self.ffn_dim < 1):
            raise InvalidConfig(f"GPTConfig.ffn_dim must be a positive integer, got {self.ffn_dim!r}")
        if self.dim % self.n_heads:
            raise InvalidConfig(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")

    @property
    def hidden_ffn(self) -> int:
        return self.ffn_dim if self.ffn_dim is not None else 4 * self.dim

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def check_tp(self, tp: int) -> None:
        """Heads are split across tensor-parallel ranks, so tp must divide them."""
        if self.n_heads % tp:
            raise InvalidConfig(f"tp={tp} must divide n_heads={self.n_heads} (heads are split across tp ranks)")


class Attention(nn.Module):
    """Causal multi-head self-attention; heads are taken from the local width of ``wq``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1: n_heads // tp local heads under column-parallel wq/wk/wv.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gated = cfg.gated
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_ffn, bias=False)
        self.w2 = nn.Linear(cfg.hidden_ffn, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_ffn, bias=False) if cfg.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer whose modules may be absent (``None``) on a pipeline stage.

    ``forward`` takes token ids ``(batch, seq)`` when the stage has the
    embedding, else hidden states ``(batch, seq, dim)``; it returns logits
    when the stage has the output projection, else hidden states.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        layer_ids: Iterable[int] | None = None,
    ) -> None:
        """``layer_ids``: build only these global layers (a pipeline stage), default all."""
        super().__init__()
        self.cfg = cfg
        ids = list(range(cfg.n_layers)) if layer_ids is None else sorted(set(layer_ids))
        if any(not 0 <= i < cfg.n_layers for i in ids):
            raise InvalidConfig(f"layer ids {ids} are outside 0..{cfg.n_layers - 1}")
        # No device: the caller's default (a ``torch.device("meta")`` context for layouts).
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.dim)
            self.pos_embeddings: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.dim)
            self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in ids})
            self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
            self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tied:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Set every parameter from a generator seeded by ``(seed, name)``.

        Values are drawn at full size on CPU and copied in, so they are the
        same on every configuration and every device. Parameters on the meta
        device (layout derivation) are left alone: they have no values.
        """
        n_layers = self.cfg.n_layers
        for name, param in self.named_parameters():
            if param.device.type == "meta":
                continue
            gen = torch.Generator().manual_seed(_name_seed(seed, name))
            if name.endswith("norm.weight"):
                value = torch.ones(param.shape)
            elif name.endswith(".bias"):
                value = torch.zeros(param.shape)
            else:
                std = self.cfg.init_std
                if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                    std = std / math.sqrt(2 * n_layers)  # GPT-2 residual scaling
                value = torch.randn(param.shape, generator=gen) * std
            param.copy_(value.to(param.dtype))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            positions = torch.arange(h.shape[1], device=h.device)
            h = self.tok_embeddings(h) + self.pos_embeddings(positions)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def _name_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the model seed and a parameter name, stable across processes."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over all positions (the pipeline schedule's ``loss_fn``)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
