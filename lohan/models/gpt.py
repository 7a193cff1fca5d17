"""In-house GPT decoder for the named presets (GPT-2 / nanoGPT architecture, pre-LayerNorm).

The model is an explicit ordered list of **blocks**, because the engine streams parameters, gradients and
optimizer states block by block (DESIGN.md §4.2)::

    embed (wte, wpe)  ->  blocks[0] ... blocks[n_layer-1]  ->  head (ln_f; LM head tied to wte)

:meth:`GPT.block_modules` returns exactly that list. Inside a :class:`Block` every op is its own named
submodule (``ln1, qkv, attn, proj, ln2, fc, act, fc_proj``) so the profiler and the activation runtime can
hook, time and checkpoint each op separately (paper §IV-D treats each of them as a "layer").

Tied weight: the LM head has no weight of its own; it multiplies by ``embed.wte.weight``, which lives in
the embedding block and is passed to :meth:`Head.forward` explicitly. The head block therefore owns only
``ln_f``; a streamer must have ``wte`` available when running the head, and the gradient of ``wte`` is the
sum of its embedding and head contributions, complete only after the embedding block's backward.

There is no dropout: fine-tuning here must be exactly reproducible (DESIGN.md §5), and recomputation
would otherwise need to replay RNG state.

Initialization is per block: block ``i`` of :meth:`GPT.block_modules` draws from its own generator
:func:`block_generator` ``(seed, i)``, so the tiered store can initialize one block at a time, in any order,
never materializing the whole model, and still get bit-identical weights to :func:`build_model`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lohan.config import ModelConfig

__all__ = [
    "GPT",
    "Block",
    "CausalSelfAttentionCore",
    "Embed",
    "Head",
    "block_generator",
    "block_seed",
    "build_model",
    "init_block_",
    "lm_loss",
]

INIT_STD = 0.02
"""Standard deviation of every Linear/Embedding weight at init (GPT-2)."""


class Embed(nn.Module):
    """Embedding block: token embedding ``wte`` plus learned position embedding ``wpe``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: Tensor) -> Tensor:
        """Map token ids ``(batch, seq)`` to hidden states ``(batch, seq, d_model)``."""
        t = idx.size(1)
        if t > self.seq_len:
            raise ValueError(
                f"sequence length {t} exceeds the model's {self.seq_len} position embeddings; "
                f"truncate the input or build the model with seq_len >= {t}"
            )
        pos = torch.arange(t, device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class CausalSelfAttentionCore(nn.Module):
    """The parameter-free middle of attention: split heads, causal SDPA, merge heads.

    Kept as its own module (between the ``qkv`` and ``proj`` Linears) so it can be profiled, recomputed
    or swapped as one op.
    """

    def __init__(self, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head

    def forward(self, qkv: Tensor) -> Tensor:
        """Map fused ``qkv`` ``(batch, seq, 3·d_model)`` to attention output ``(batch, seq, d_model)``."""
        b, t, three_d = qkv.shape
        d = three_d // 3
        q, k, v = qkv.split(d, dim=2)
        # (b, t, d) -> (b, n_head, t, head_dim), the layout SDPA expects.
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, d)


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x += attn(ln1(x)); x += mlp(ln2(x))``.

    Each op is a named submodule, in forward order: ``ln1, qkv, attn, proj, ln2, fc, act, fc_proj``.
    ``proj`` and ``fc_proj`` write into the residual stream and get the GPT-2 scaled init.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.ln1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.qkv = nn.Linear(d, 3 * d, bias=True)
        self.attn = CausalSelfAttentionCore(cfg.n_head)
        self.proj = nn.Linear(d, d, bias=True)
        self.ln2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc = nn.Linear(d, cfg.mlp_hidden, bias=True)
        self.act = nn.GELU(approximate="none")
        self.fc_proj = nn.Linear(cfg.mlp_hidden, d, bias=True)

    def residual_projections(self) -> tuple[nn.Linear, nn.Linear]:
        """The two Linears that write into the residual stream (scaled init, GPT-2 paper §2.3)."""
        return self.proj, self.fc_proj

    def forward(self, x: Tensor) -> Tensor:
        """Map hidden states ``(batch, seq, d_model)`` to the same shape."""
        x = x + self.proj(self.attn(self.qkv(self.ln1(x))))
        x = x + self.fc_proj(self.act(self.fc(self.ln2(x))))
        return x


class Head(nn.Module):
    """Head block: final LayerNorm ``ln_f`` and the LM head projection to vocabulary logits.

    With tied embeddings (the default) the projection weight is the embedding's ``wte.weight``, passed to
    :meth:`forward`; this module then owns only ``ln_f``. Untied, it owns ``lm_head`` (no bias).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tied = cfg.tie_embeddings
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.lm_head = None if self.tied else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor, wte_weight: Tensor | None = None) -> Tensor:
        """Map hidden states ``(batch, seq, d_model)`` to logits ``(batch, seq, vocab_size)``.

        Args:
            x: Output of the last transformer block.
            wte_weight: The token embedding weight ``(vocab_size, d_model)``; required when tied, must be
                None when untied (mixing the two is a bug).
        """
        x = self.ln_f(x)
        if self.lm_head is not None:
            if wte_weight is not None:
                raise ValueError("this head is untied (tie_embeddings=False); do not pass wte_weight")
            return self.lm_head(x)
        if wte_weight is None:
            raise ValueError("this head is tied to the token embedding; pass wte_weight=embed.wte.weight")
        return F.linear(x, wte_weight)


class GPT(nn.Module):
    """GPT decoder as an ordered list of blocks: ``embed``, ``blocks[0..n_layer)``, ``head``.

    Construction leaves PyTorch's default module init in place; call :meth:`init_weights` (or use
    :func:`build_model`, which also builds on the meta device for free).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embed(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = Head(cfg)

    def block_modules(self) -> list[nn.Module]:
        """The store's unit of streaming, in forward order: ``[embed, *blocks, head]``.

        The position in this list is the block index used by :func:`block_generator`.
        """
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Run the model.

        Args:
            idx: Token ids, ``(batch, seq)`` int64, ``seq <= cfg.seq_len``.
            targets: Optional next-token ids, same shape; positions equal to -100 are ignored.

        Returns:
            ``logits`` ``(batch, seq, vocab_size)``, or ``(logits, loss)`` when ``targets`` is given, where
            ``loss`` is the mean cross-entropy over non-ignored positions (a scalar, fp32).
        """
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x, self.embed.wte.weight if self.cfg.tie_embeddings else None)
        if targets is None:
            return logits
        return logits, lm_loss(logits, targets)

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy of ``idx`` against ``targets`` (see :meth:`forward`)."""
        _, loss = self.forward(idx, targets)
        return loss

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialize every block in place, block ``i`` from ``block_generator(seed, i)``.

        Takes a seed rather than one ``torch.Generator``: a single generator drawn in sequence would make
        block ``i``'s values depend on blocks ``0..i-1``, which a store initializing blocks independently
        cannot reproduce. The result equals :func:`init_block_` applied block by block.

        Args:
            seed: Base seed; the same seed always gives bit-identical weights (any device, any dtype).
        """
        for index, block in enumerate(self.block_modules()):
            init_block_(block, self.cfg, block_generator(seed, index))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of ``logits`` ``(..., vocab)`` against ``targets`` ``(...)``, ignoring -100.

    Computed in fp32 even for bf16/fp16 logits: a low-precision log-softmax over 50k classes loses
    most of the loss's significant digits.
    """
    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
    # A window made only of prompt tokens (loss on responses): the mean over no targets is NaN, which would
    # poison every weight through the optimizer. Such a micro-batch contributes nothing: a loss of 0, and a
    # zero gradient (cross_entropy's backward writes only to the targets it counted). Selected on the device:
    # asking the host whether any target counts would stall the GPU every micro-batch.
    return torch.where((targets != -100).any(), loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # SplitMix64 finalizer (Steele et al., "Fast splittable pseudorandom number generators", 2014):
    # a cheap bijective mix, so nearby (seed, index) pairs give unrelated generator seeds.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def block_seed(seed: int, index: int) -> int:
    """The 64-bit generator seed of block ``index`` (position in ``block_modules()``) for a base ``seed``.

    Pure integer arithmetic, stable across Python/torch versions and processes (unlike ``hash``).
    """
    if index < 0:
        raise ValueError(f"block index must be >= 0, got {index}")
    return _splitmix64(_splitmix64(seed & _MASK64) ^ index)


def block_generator(seed: int, index: int) -> torch.Generator:
    """A fresh CPU generator for initializing block ``index`` of a model seeded with ``seed``."""
    return torch.Generator(device="cpu").manual_seed(block_seed(seed, index))


def _normal_(param: Tensor, std: float, generator: torch.Generator) -> None:
    # Always draw in fp32 on the CPU generator, then copy: the values then do not depend on the
    # parameter's device or dtype (a bf16 or CUDA model equals the fp32 CPU one, cast).
    if param.device.type == "cpu" and param.dtype == torch.float32:
        param.normal_(0.0, std, generator=generator)
    else:
        param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator))


@torch.no_grad()
def init_block_(block: nn.Module, cfg: ModelConfig, generator: torch.Generator) -> None:
    """Initialize one block (an element of ``GPT.block_modules()``) in place.

    Linear and Embedding weights ~ N(0, 0.02), biases 0, LayerNorm weight 1 / bias 0; the residual output
    projections of a :class:`Block` (``proj``, ``fc_proj``) ~ N(0, 0.02/sqrt(2·n_layer)) (GPT-2 scaled
    init). Random draws happen in module registration order from ``generator``.

    To initialize a block of a meta-built model without materializing the rest::

        block = model.block_modules()[i]
        block.to_empty(device="cpu")
        init_block_(block, model.cfg, block_generator(seed, i))

    Args:
        block: The block; its parameters must be materialized (not on the meta device).
        cfg: The model config (its ``n_layer`` sets the residual scaling).
        generator: A CPU generator, normally ``block_generator(seed, block_index)``.

    Raises:
        ValueError: If a parameter is on the meta device, or belongs to a module this function does not
            know how to initialize (it would otherwise keep the garbage left by ``to_empty``).
    """
    params = dict(block.named_parameters())
    on_meta = [name for name, p in params.items() if p.is_meta]
    if on_meta:
        raise ValueError(
            f"cannot initialize parameters on the meta device ({', '.join(on_meta[:3])}...); "
            f"materialize the block first with block.to_empty(device=...)"
        )
    residual = set()
    if isinstance(block, Block):
        residual = {id(m) for m in block.residual_projections()}
    residual_std = INIT_STD / math.sqrt(2 * cfg.n_layer)

    done: set[int] = set()
    for module in block.modules():
        if isinstance(module, nn.Linear):
            _normal_(module.weight, residual_std if id(module) in residual else INIT_STD, generator)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            _normal_(module.weight, INIT_STD, generator)
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        else:
            continue
        done.update(id(p) for p in module.parameters(recurse=False))
    missed = [name for name, p in params.items() if id(p) not in done]
    if missed:
        raise ValueError(f"init_block_ does not know how to initialize {missed} of {type(block).__name__}")


def build_model(
    cfg: ModelConfig,
    device: str | torch.device = "meta",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> GPT:
    """Build a :class:`GPT`, either as a free skeleton on the meta device or materialized and initialized.

    The model is always constructed on the meta device first, so even the 412B preset costs no memory
    and PyTorch's default init (wasted work, overwritten anyway) never runs on real tensors.

    Args:
        cfg: Model dimensions.
        device: ``"meta"`` for a skeleton (shapes only, nothing allocated, not initialized), or a real
            device to allocate on and initialize with :meth:`GPT.init_weights`.
        seed: Base seed of the per-block init (ignored on meta).
        dtype: Parameter dtype. Init values are drawn in fp32 and cast, so they equal the fp32 model's.

    Returns:
        The model, in train mode.
    """
    with torch.device("meta"):
        model = GPT(cfg)
    model.to(dtype=dtype)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    model.init_weights(seed)
    return model
