"""Model shapes: `ModelConfig` and the named presets (:data:`PRESETS`), with the bounds a shape is held to."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lohan.config.units import is_int

MAX_LAYERS = 1024
"""The most transformer blocks a model may have: 8 times the deepest preset (412b: 128) and beyond any published
LLM. The planner, the store and the engine build one record per block, so a typo such as ``--layers 1000000000``
must be refused from the count, before the first per-block object is made (it once grew to 23 GB)."""

MAX_PARAMS = 2 * 10**12
"""The most parameters a model may have (2T: 5 times the largest preset, 412b; its exact optimizer states alone
would fill 56 TB of SSDs in two slots). The planners' work grows with the bytes of each block's record, so a shape
past this (``d_model`` or ``vocab_size`` a million times too big) is refused from its arithmetic at once."""


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a GPT-style decoder (pre-LayerNorm, learned positions, GELU MLP).

    The architecture is the one built by :class:`lohan.models.gpt.GPT`; :meth:`param_count` is exact
    for it. Instances are immutable; use :meth:`with_overrides` to derive a modified copy.
    """

    name: str
    """Human-readable name, usually the preset key (e.g. ``"175b"``). Not interpreted."""

    n_layer: int
    """Number of transformer blocks."""

    n_head: int
    """Number of attention heads per block; must divide ``d_model``."""

    d_model: int
    """Hidden size (width of the residual stream)."""

    vocab_size: int = 50257
    """Number of token ids; 50257 is the GPT-2 BPE vocabulary used by the paper."""

    seq_len: int = 1024
    """Maximum sequence length, i.e. the number of learned position embeddings."""

    mlp_ratio: int = 4
    """MLP hidden size as a multiple of ``d_model`` (``fc`` maps d -> mlp_ratio * d)."""

    layer_norm_eps: float = 1e-5
    """Epsilon of every LayerNorm (the PyTorch and GPT-2 default)."""

    tie_embeddings: bool = True
    """Reuse the token embedding ``wte`` as the LM head weight (GPT-2 style, counted once).
    If False the head owns a separate ``vocab_size x d_model`` weight."""

    def __post_init__(self) -> None:
        # Collect every problem and raise once, so a bad YAML is fixed in one round trip.
        problems: list[str] = []
        if not isinstance(self.name, str) or not self.name:
            problems.append(f"name={self.name!r} must be a non-empty string")
        for field in ("n_layer", "n_head", "d_model", "vocab_size", "seq_len", "mlp_ratio"):
            value = getattr(self, field)
            if not is_int(value) or value <= 0:
                problems.append(f"{field}={value!r} must be a positive integer")
        if (
            is_int(self.d_model)
            and is_int(self.n_head)
            and self.n_head > 0
            and self.d_model > 0
            and self.d_model % self.n_head != 0
        ):
            lower = (self.d_model // self.n_head) * self.n_head
            upper = lower + self.n_head
            hint = f"e.g. d_model={upper}" if lower == 0 else f"e.g. d_model={lower} or {upper}"
            problems.append(
                f"d_model={self.d_model} is not divisible by n_head={self.n_head}; every head needs the "
                f"same width: pick d_model as a multiple of n_head ({hint}) or pick an n_head that divides it"
            )
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            # PyYAML reads `1e-5` (no dot) as a string; say so, it is the usual cause.
            problems.append(
                f"layer_norm_eps={eps!r} must be a positive number (in YAML write 1.0e-5, not 1e-5)"
            )
        if not isinstance(self.tie_embeddings, bool):
            problems.append(f"tie_embeddings={self.tie_embeddings!r} must be True or False")
        if not problems:  # the dimensions are valid integers: now their arithmetic
            problems += self._size_problems()
        if problems:
            raise ValueError(f"invalid ModelConfig {self.name!r}:\n  - " + "\n  - ".join(problems))

    def _size_problems(self) -> list[str]:
        """A shape past `MAX_LAYERS` or `MAX_PARAMS`, from the counts alone (nothing per block is built)."""
        if self.n_layer > MAX_LAYERS:
            return [f"n_layer={self.n_layer:,} transformer blocks are more than lohan builds (at most "
                    f"{MAX_LAYERS:,}; the deepest preset, 412b, has 128): use --layers N with N <= {MAX_LAYERS:,} "
                    "(a slice of the same width), or another preset"]
        count = self.param_count()
        if count <= MAX_PARAMS:
            return []
        block, embed = self.n_layer * self.block_param_count(), self.embed_param_count()
        if block >= embed:
            fits = MAX_PARAMS // self.block_param_count()
            shrink = f"a smaller d_model ({self.d_model:,}) or mlp_ratio ({self.mlp_ratio:,})"
            most = (f"the {self.n_layer:,} blocks of {self.block_param_count():,} ({block:,}): "
                    + (f"use --layers N with N <= {fits:,}, or {shrink}" if fits else
                       f"not even one block of this width fits; give it {shrink}"))
        else:
            most = (f"the embeddings, (vocab_size {self.vocab_size:,} + seq_len {self.seq_len:,}) x d_model "
                    f"{self.d_model:,} ({embed:,}): make them smaller")
        return [f"{count:,} parameters ({count / 1e12:,.4g}T) are more than lohan plans for (at most {MAX_PARAMS:,}, "
                f"{MAX_PARAMS / 1e12:g}T: 5 times the largest preset, 412b); most are in {most}, or pick another "
                "preset"]

    # ----------------------------------------------------------------------------------- sizes

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``d_model // n_head``."""
        return self.d_model // self.n_head

    @property
    def mlp_hidden(self) -> int:
        """Hidden width of the MLP, ``mlp_ratio * d_model``."""
        return self.mlp_ratio * self.d_model

    def block_param_count(self) -> int:
        """Parameters of one transformer block (weights and biases).

        Returns:
            ``ln1 + qkv + proj + ln2 + fc + fc_proj``, i.e. ``(4 + 2r)·d² + (9 + r)·d`` for MLP ratio ``r``
            (``12·d² + 13·d`` for r = 4).
        """
        d, h = self.d_model, self.mlp_hidden
        layer_norms = 2 * (2 * d)  # ln1, ln2: weight + bias each
        attention = (d * 3 * d + 3 * d) + (d * d + d)  # qkv, proj
        mlp = (d * h + h) + (h * d + d)  # fc, fc_proj
        return layer_norms + attention + mlp

    def embed_param_count(self) -> int:
        """Parameters of the embedding block: token (``wte``) and position (``wpe``) tables."""
        return self.vocab_size * self.d_model + self.seq_len * self.d_model

    def head_param_count(self) -> int:
        """Parameters owned by the head block: ``ln_f``, plus the LM head weight only if untied."""
        own_lm_head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return 2 * self.d_model + own_lm_head

    def param_count(self) -> int:
        """Exact number of parameters of the model (a tied embedding is counted once).

        Equals ``sum(p.numel() for p in GPT(cfg).parameters())``.
        """
        return self.embed_param_count() + self.n_layer * self.block_param_count() + self.head_param_count()

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Forward FLOPs per token (multiply-add = 2 FLOPs), the ``FLOP_f`` of the cost model per token.

        Args:
            seq_len: Sequence length the model is run at (attention cost grows with it).
                Defaults to :attr:`seq_len`.

        Returns:
            ``2·(matmul params) + n_layer·4·seq_len·d_model``. Backward is twice this (paper §III).
        """
        s = self.seq_len if seq_len is None else seq_len
        if not is_int(s) or s <= 0:
            raise ValueError(f"seq_len={s!r} must be a positive integer")
        d = self.d_model
        # Every weight matrix that multiplies the activations costs 2 FLOPs per element per token.
        # Counted: qkv, proj, fc, fc_proj per block and the LM head (vocab x d, tied or not).
        # Not counted: embedding lookups (gathers), biases, LayerNorm, GELU, softmax: O(d) per token.
        matmul_params = self.n_layer * (4 + 2 * self.mlp_ratio) * d * d + self.vocab_size * d
        # Attention scores Q·Kᵀ and the weighted sum A·V each cost 2·seq_len·d per token per layer
        # (PaLM appendix B / Chinchilla convention; the causal mask's halving is not credited, as in
        # the usual MFU accounting).
        attention = self.n_layer * 2 * 2 * s * d
        return 2 * matmul_params + attention

    def with_overrides(self, **overrides: Any) -> ModelConfig:
        """Return a copy with some fields replaced, validated again.

        Args:
            **overrides: Field names and their new values, e.g. ``n_layer=2, d_model=64``.

        Raises:
            TypeError: If a name is not a field of ``ModelConfig``.
            ValueError: If the resulting config is invalid.
        """
        valid = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise TypeError(f"unknown ModelConfig field(s) {unknown}; valid fields are {sorted(valid)}")
        return dataclasses.replace(self, **overrides)


# name -> dims. Fields not given take the ModelConfig defaults (vocab 50257, seq_len 1024, mlp_ratio 4).
# The comments are the exact param_count() rounded; tests/unit/config/test_config.py checks each is within 10% of
# the size in its name.
PRESETS: dict[str, dict[str, Any]] = {
    # Small sizes for CPU boxes and tests. `tiny` keeps the real GPT-2 vocabulary (so the init loss is
    # ln(50257) and the GPT-2 tokenizer works); its embeddings are ~80% of its parameters.
    "tiny": dict(n_layer=6, n_head=4, d_model=160, seq_len=256),  # ~9.9M params
    "125m": dict(n_layer=12, n_head=12, d_model=768),  # ~124M params (GPT-2 small)
    "350m": dict(n_layer=24, n_head=16, d_model=1024),  # ~355M params (GPT-2 medium)
    # GPT-3 XL's 24/16/2048 would be ~1.3B; 18 layers at the same width gives an honest "1b".
    "1b": dict(n_layer=18, n_head=16, d_model=2048),  # ~1.01B params
    # LoHan paper, Table IV.
    "6b": dict(n_layer=28, n_head=32, d_model=4096),  # ~5.85B params
    "13b": dict(n_layer=40, n_head=40, d_model=5120),  # ~12.85B params
    "30b": dict(n_layer=48, n_head=56, d_model=7168),  # ~29.97B params
    "70b": dict(n_layer=80, n_head=64, d_model=8192),  # ~64.85B params
    "135b": dict(n_layer=88, n_head=88, d_model=11264),  # ~134.57B params
    "175b": dict(n_layer=96, n_head=96, d_model=12288),  # ~174.59B params
    "276b": dict(n_layer=112, n_head=112, d_model=14336),  # ~276.98B params
    "412b": dict(n_layer=128, n_head=128, d_model=16384),  # ~413.18B params
}


def get_model_config(name: str, **overrides: Any) -> ModelConfig:
    """Build the :class:`ModelConfig` of a named preset, optionally with some fields replaced.

    Args:
        name: A key of :data:`PRESETS` (e.g. ``"tiny"``, ``"13b"``, ``"175b"``).
        **overrides: Fields to replace, e.g. ``n_layer=2, d_model=64, n_head=4`` to shrink a real
            architecture for a test. The ``name`` stays the preset's unless overridden too.

    Raises:
        ValueError: If ``name`` is not a preset (the message lists the valid names) or the result is invalid.
        TypeError: If an override is not a ``ModelConfig`` field.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets are: {', '.join(PRESETS)}")
    return ModelConfig(name=name, **PRESETS[name]).with_overrides(**overrides)
