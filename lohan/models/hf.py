"""Hugging Face decoder-only causal LMs as engine block programs, found from the model's structure.

A local model directory (``config.json`` + ``*.safetensors``, possibly sharded with
``model.safetensors.index.json``) becomes ``[embed, decoder layer 0..L-1, head]``. No family is
recognized by name: any ``*ForCausalLM`` with the standard layout works (tested: `SUPPORTED`).

- The HF model is built from its config with every *parameter* on the meta device and every
  *buffer* real (rotary ``inv_freq`` is computed on the CPU as usual), in fp32, in eval mode (dropout
  off: the engine's recomputation must reproduce the forward exactly), with the attention that
  ``from_pretrained`` would pick (SDPA, or eager where the family has no SDPA path, e.g. Gemma 2).
- The standard layout: a base model (the "decoder") that holds the token embedding and the list of
  decoder layers as direct children, the other parameter-holding children of the decoder called
  either before the layers (learned positions, ``project_in``: the embed block) or after them (final
  norm, ``project_out``: the head block), and an ``lm_head`` next to the decoder. Which child runs
  where is observed, not assumed (`_Probe`).
- The engine calls each decoder layer in isolation, so what the HF decoder computes once in its
  forward and hands every layer (rotary cos/sin, per-layer-type position embeddings, the causal or
  sliding-window mask of each layer's attention type, position ids) is *captured* from the HF
  decoder's own forward, run with stub layers on stand-in weights, once per batch shape, dtype and
  device (`_Probe.layer_inputs`). Masks and positions are input-independent for unpadded causal
  batches, so the captured arguments are exactly the ones HF passes. Sliding windows are therefore
  exact at any sequence length (HF's own mask functions build them).
- The embed block runs the HF decoder's forward up to its first layer (so embedding scaling,
  learned positions and any other pre-layer step are HF's own code); the head block applies the
  post-layer children in the order observed, the ``lm_head`` and the final logit soft-capping of the
  config. At load, a probe run of the whole ``*ForCausalLM`` on stand-in weights checks that these
  pieces give exactly what HF's forward gives (embed output, nothing between layers, head input,
  logits); a model whose forward does more is refused with the stage that differs.
- A tied ``lm_head`` is owned by the embed block only: the head borrows it (``external_params``)
  and reads the embedding's *current* parameter at call time.

Encoder-only (BERT-style), encoder-decoder, multimodal and mixture-of-experts models are refused
up front with the reason. Weights are imported block by block (``init_block(i)`` opens the
safetensors files and reads only block i's keys) and exported block by block from the store into
streamed safetensors shards (`lohan.models.hf_checkpoint`), so neither direction ever holds more than
one block.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lohan.config import ModelConfig
from lohan.models.hf_checkpoint import (
    WEIGHTS_INDEX,
    WEIGHTS_NAME,
    check_weights,
    export_hf,
    has_tokenizer,
    has_weights,
    load_tokenizer,
    make_init_block,
    read_config,
)
from lohan.models.hf_shape import check_dimensions, check_shape
from lohan.models.lm_head import head_loss

__all__ = ["SUPPORTED", "WEIGHTS_INDEX", "WEIGHTS_NAME", "HFBlocks", "check_weights", "export_hf", "has_tokenizer",
           "has_weights", "is_hf_dir", "load_hf_skeleton", "load_tokenizer", "make_init_block", "model_meta"]

log = logging.getLogger(__name__)

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "gpt2", "opt", "gpt_neox")
"""model_type values tested bit-exact against transformers (tests/integration/test_hf_families.py). Other decoders with
the standard layout load too: the probe run at load refuses one whose forward the blocks do not reproduce."""

_META_DROP = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
"""config.json keys left out of the store's model description: they do not change the model (a
re-export in another dtype or by another transformers version resumes the same store)."""

_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")
_MULTIMODAL_KEYS = ("text_config", "vision_config", "audio_config", "speech_config")


# ------------------------------------------------------------------------------------------ directory
def is_hf_dir(path: str | os.PathLike) -> bool:
    """True for a directory with a config.json that names a model_type (whether lohan can train that
    model is decided when it is loaded, with the reason when it cannot)."""
    try:
        return os.path.isdir(path) and isinstance(read_config(path).get("model_type"), str)
    except (OSError, ValueError):
        return False


def _supported_text() -> str:
    return (f"lohan fine-tunes decoder-only causal LMs with the standard layout (tested: {', '.join(SUPPORTED)}; "
            "Llama 3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 text, Phi-3, OLMo 2, GPT-2, OPT, GPT-NeoX/Pythia)")


def _refuse_kind(path: str | os.PathLike, data: dict) -> None:
    """Refuse, from config.json alone, the kinds of model the block program cannot express."""
    family = data.get("model_type")
    if not isinstance(family, str):
        raise ValueError(f"{path}/config.json has no model_type; it is not a transformers model config")
    why = None
    sub = [k for k in _MULTIMODAL_KEYS if isinstance(data.get(k), dict)]
    if sub:
        hint = (" (for Gemma 3, save its text model: Gemma3ForCausalLM with a Gemma3TextConfig, model_type "
                "gemma3_text)" if family == "gemma3" else "")
        why = f"it is multimodal (its config has {', '.join(sub)}){hint}"
    elif data.get("is_encoder_decoder"):
        why = "it is an encoder-decoder model; lohan trains decoder-only LMs"
    elif "type_vocab_size" in data:  # token-type embeddings: the BERT family's bidirectional encoders
        why = "it is an encoder (BERT-style, bidirectional attention), not a causal decoder"
    elif family == "bloom" or data.get("alibi") is True:
        # Bloom's decoder builds ALiBi biases from the batch's attention mask and hands each layer its own
        # (hidden, alibi, mask) arguments; it has no position limit either (no max_position_embeddings)
        why = ("its positions are ALiBi attention biases that the decoder builds from each batch's attention mask "
               "and passes its layers in its own calling convention (Bloom; Falcon and MPT with alibi), which "
               "lohan's block program does not reproduce; and it has no position limit to check --seq-len against")
    else:
        experts = {k: data[k] for k in _MOE_KEYS if isinstance(data.get(k), int) and data[k] > 1}
        if experts:
            # routing is data-dependent and its auxiliary loss lives outside the layers; the blocks do not carry it
            why = (f"it is a mixture-of-experts model ({', '.join(f'{k}={v}' for k, v in experts.items())}); "
                   "expert routing is not supported")
    if why is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            why = "transformers has no causal-LM class for it (not a text generator)"
    if why is not None:
        raise ValueError(f"{path}: model_type {family!r} is not supported: {why}. {_supported_text()}")


def _family(path: str | os.PathLike) -> tuple[str, dict]:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory (expected a Hugging Face model directory)")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has no config.json; it is not a Hugging Face model directory")
    data = read_config(path)
    _refuse_kind(path, data)
    return data["model_type"], data


@contextlib.contextmanager
def _meta_parameters() -> Iterator[None]:
    """Parameters registered inside go to the meta device; buffers stay where they are created (CPU)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":  # an already-meta one (a tie) is kept as is
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _has_params(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())


class _Part(nn.Module):
    """HF sub-modules grouped into one engine block (embed or head), registered under their HF names.

    It computes nothing itself: `HFBlocks.run` calls the sub-modules the way the HF model does.
    """

    def __init__(self, parts: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        for name, module in parts:
            self.add_module(name, module)


# ------------------------------------------------------------------------------------------ probing
class _Stop(Exception):
    """Ends a decoder forward at a stub layer, carrying the hidden states that reached it."""

    def __init__(self, hidden: Tensor) -> None:
        super().__init__("stop")
        self.hidden = hidden


class _StubLayer(nn.Module):
    """Stands in for a decoder layer: records what the decoder passes it, then passes its input on, returns
    fresh random states (`randomize`, to see that nothing happens between layers), or stops the forward."""

    def __init__(self, index: int, events: list | None, stop: bool = False) -> None:
        super().__init__()
        self.index = index
        self.events = events
        self.stop = stop
        self.randomize: torch.Generator | None = None

    def forward(self, hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        out = hidden
        if self.randomize is not None:
            out = torch.randn(hidden.shape, generator=self.randomize).to(hidden)
        if self.events is not None:
            self.events.append(("layer", self.index, hidden, args, kwargs, out))
        if self.stop:
            raise _Stop(hidden)
        return out


class _StubHead(nn.Module):
    """Stands in for the lm_head in the probe: records its input and returns random logits."""

    def __init__(self, vocab: int, events: list) -> None:
        super().__init__()
        self.vocab = vocab
        self.events = events

    def forward(self, h: Tensor) -> Tensor:
        out = torch.randn((*h.shape[:-1], self.vocab), generator=torch.Generator().manual_seed(5)).to(h)
        self.events.append(("lm_head", h, out))
        return out


def _no_dispatch_modes() -> contextlib.AbstractContextManager:
    """Leave any active TorchDispatchMode (the activation runtime's recorder, the profiler's FLOP counter):
    the probe's few ops belong to no block."""
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:  # an older torch without it: the probe's ops are then merely counted
        return contextlib.nullcontext()
    return _disable_current_modes()


class _Probe:
    """A copy of the *ForCausalLM whose decoder layers and lm_head are stubs and whose parameters are
    stand-ins (cheap: large ones are one value broadcast, `expand`), so its forward runs without the weights.

    It finds, from HF's own forward, which decoder children run before and after the layers
    (`check`), and captures the arguments the decoder passes each layer (`layer_inputs`).
    """

    def __init__(self, model: nn.Module, decoder_name: str, layers_attr: str, head_attr: str) -> None:
        self.events: list[tuple] = []
        layers = model.get_submodule(decoder_name).get_submodule(layers_attr)
        self.stubs = [_StubLayer(i, self.events) for i in range(len(layers))]
        lm_head = getattr(model, head_attr)
        self.head = _StubHead(int(lm_head.weight.shape[0]), self.events)
        memo: dict[int, Any] = {id(layer): stub for layer, stub in zip(layers, self.stubs)}
        memo[id(lm_head)] = self.head
        self.model = copy.deepcopy(model, memo)
        self.decoder = self.model.get_submodule(decoder_name)
        self._filled: tuple | None = None

    def fill(self, dtype: torch.dtype, device: torch.device, random: bool = False) -> None:
        """Stand-in parameters of `dtype` on `device` (random where small, for `check`), buffers moved along."""
        key = (dtype, device, random)
        if self._filled == key:
            return
        g = torch.Generator().manual_seed(3)
        for module in self.model.modules():
            for k, p in module._parameters.items():
                if p is None:
                    continue
                if random and p.numel() <= 2**20:
                    t = (0.5 + 0.2 * torch.randn(p.shape, generator=g)).to(dtype=dtype, device=device)
                else:  # one value for all: no memory, whatever the size
                    t = torch.full((), 0.5, dtype=dtype, device=device).expand(p.shape)
                module._parameters[k] = nn.Parameter(t, requires_grad=False)
            for k, b in module._buffers.items():
                if b is not None and b.device != device:
                    module._buffers[k] = b.to(device)
        self._filled = key

    def check(self, program: HFBlocks, batch: int = 2, seq: int = 6) -> tuple[list[str], list[str]]:
        """Run the whole *ForCausalLM forward on stand-in weights and check that the program's embed and head
        reproduce it exactly. Returns the decoder children with parameters called before the layers (the embed
        block's, besides the token embedding), and all children called after them, in order (the head's)."""
        seq = max(1, min(seq, program.max_seq_len))
        self.fill(torch.float32, torch.device("cpu"), random=True)
        order: list[str] = []
        hooks = [child.register_forward_pre_hook(lambda m, a, name=name: order.append(name))
                 for name, child in self.decoder.named_children() if name != program._layers_attr]
        marks: list[int] = []
        hooks.append(self.stubs[0].register_forward_pre_hook(lambda m, a: marks.append(len(order))))
        g = torch.Generator().manual_seed(4)
        for stub in self.stubs:
            stub.randomize = g
        ids = (torch.arange(batch * seq) * 7 % program.vocab_size).reshape(batch, seq)
        self.events.clear()
        try:
            with torch.no_grad():
                logits = self.model(input_ids=ids, use_cache=False).logits
        finally:
            for h in hooks:
                h.remove()
            for stub in self.stubs:
                stub.randomize = None
        layers = [e for e in self.events if e[0] == "layer"]
        heads = [e for e in self.events if e[0] == "lm_head"]
        if [e[1] for e in layers] != list(range(len(self.stubs))) or len(heads) != 1 or not marks:
            raise NotImplementedError(f"{program.family}: the model's forward does not call each decoder layer once "
                                      "in order and then the lm_head; not a standard decoder layout")
        cut = marks[0]
        pre, post = order[:cut], order[cut:]
        params = {name for name, child in self.decoder.named_children() if _has_params(child)}
        both = set(pre) & set(post) & params
        if both:
            raise NotImplementedError(f"{program.family}: {sorted(both)} run both before and after the decoder layers")

        def differs(stage: str) -> NotImplementedError:
            return NotImplementedError(
                f"{program.family}: the HF forward does more than lohan's blocks reproduce ({stage}); "
                f"{_supported_text()}")

        with torch.no_grad():
            for s in self.stubs:
                s.stop = s.index == 0
            try:
                embedded = _run_to_first_layer(self.decoder, ids, program.family)
            finally:
                for s in self.stubs:
                    s.stop = False
            if not torch.equal(embedded, layers[0][2]):
                raise differs("the *ForCausalLM transforms the embeddings before its base model's layers")
            for prev, nxt in zip(layers, layers[1:]):
                if nxt[2] is not prev[5] and not torch.equal(nxt[2], prev[5]):
                    raise differs(f"the decoder transforms the hidden states between layers {prev[1]} and {nxt[1]}")
            post = list(dict.fromkeys(post))
            h = layers[-1][5]
            for name in post:  # parameter-free children too (a dropout: identity in eval)
                h = getattr(self.decoder, name)(h)
            if not torch.equal(h, heads[0][1]):
                raise differs("the final norm / projections before the lm_head")
            if not torch.equal(program._cap(heads[0][2]), logits):
                raise differs("the logits after the lm_head (scaling beyond final_logit_softcapping)")
        return [name for name in dict.fromkeys(pre) if name in params], post

    def layer_inputs(self, batch: int, seq: int, dtype: torch.dtype, device: torch.device,
                     family: str) -> list[tuple[tuple, dict]]:
        """(positional args after the hidden states, keyword args) that the decoder passes each layer for an
        unpadded causal batch [batch, seq] of hidden states in `dtype` on `device`."""
        self.fill(dtype, device)
        self.events.clear()
        ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
        self.stubs[-1].stop = True  # the last layer ends the forward: what follows the layers is not needed
        try:
            with torch.no_grad():
                self.decoder(input_ids=ids, use_cache=False)
        except _Stop:
            pass
        finally:
            self.stubs[-1].stop = False
        calls = [e for e in self.events if e[0] == "layer"]
        self.events.clear()
        if [e[1] for e in calls] != list(range(len(self.stubs))):
            raise RuntimeError(f"{family}: the decoder called its layers as {[e[1] for e in calls]}")
        return [(e[3], e[4]) for e in calls]


def _beside(inputs: list[tuple[tuple, dict]], x: Tensor) -> list[tuple[tuple, dict]]:
    """The probe's captured layer inputs on x's device. The probe makes them with ``device=x.device``, which puts
    them there on a GPU; a device that only the tensors' own dispatch knows (lohan's simulated device) gets host
    tensors from it, which are copied across here (``x.new_empty(...).copy_(t)``: an op of x's device)."""
    def move(t: Any) -> Any:
        if not isinstance(t, Tensor) or t.device == x.device:
            return t
        return x.new_empty(t.shape, dtype=t.dtype).copy_(t)
    return [(tuple(tree_map(move, list(args))), tree_map(move, kwargs)) for args, kwargs in inputs]


def _run_to_first_layer(decoder: nn.Module, ids: Tensor, family: str) -> Tensor:
    """The hidden states the decoder's own forward hands its first layer (whose stub stops the forward)."""
    try:
        decoder(input_ids=ids, use_cache=False)
    except _Stop as stop:
        return stop.hidden
    raise NotImplementedError(f"{family}: the decoder's forward never reached its first layer")


# ------------------------------------------------------------------------------------------ program
class HFBlocks:
    """A Hugging Face causal LM as [embed, decoder layer 0..L-1, head] (implements BlockProgram).

    Block 0 maps token ids [B, T] to hidden states; the last block returns the mean fp32
    cross-entropy over targets [B, T] (already shifted; -100 ignored), like `lohan.models.gpt.lm_loss`
    (`lohan.models.lm_head.head_loss`: the vocabulary padded for the GEMMs, the softmax in token chunks).
    """

    def __init__(self, model: nn.Module, family: str, config_dict: dict) -> None:
        model.eval()  # dropout off (and OPT's layerdrop): recomputation must reproduce the forward
        self.model = model
        self.family = family
        self.config = cfg = model.config
        self.config_dict = config_dict
        self.n_layer = int(cfg.num_hidden_layers)
        self.vocab_size = int(cfg.vocab_size)
        self.hidden_size = int(cfg.hidden_size)
        self.max_seq_len = int(cfg.max_position_embeddings)
        softcap = getattr(cfg, "final_logit_softcapping", None)
        self.softcap = float(softcap) if softcap else None
        self._check_supported()

        decoder_name, decoder, self._layers_attr = self._find_decoder()
        tokens = model.get_input_embeddings()
        lm_head = model.get_output_embeddings()
        head_attr = next((k for k, v in model.named_children() if v is lm_head), None)
        if head_attr is None:
            raise NotImplementedError(f"{family}: the output embedding is not a direct child of the model; not a "
                                      f"standard *ForCausalLM layout. {_supported_text()}")
        if getattr(lm_head, "bias", None) is not None:
            raise NotImplementedError(f"{family}: an lm_head with a bias is not supported")
        self.tied = lm_head.weight is tokens.weight
        self._tokens_attr = next(k for k, v in decoder.named_children() if v is tokens)

        try:
            self._probe = _Probe(model, decoder_name, self._layers_attr, head_attr)
            pre, post = self._probe.check(self)
        except NotImplementedError:
            raise
        except Exception as e:  # a forward that does not run on stubs is not the standard layout either
            raise NotImplementedError(f"{family}: lohan could not trace the model's forward with stub layers "
                                      f"({type(e).__name__}: {e}); not a standard decoder layout. "
                                      f"{_supported_text()}") from e
        children = dict(decoder.named_children())
        unused = [k for k, v in children.items() if _has_params(v) and k not in (*pre, *post, self._layers_attr,
                                                                                 self._tokens_attr)]
        if unused:
            raise NotImplementedError(f"{family}: decoder children {unused} hold parameters but the forward does not "
                                      "call them; not supported")
        self._post = post
        self.embed = _Part([(self._tokens_attr, tokens)] + [(k, children[k]) for k in pre if k != self._tokens_attr])
        self.head = _Part([(k, children[k]) for k in self._post] + ([] if self.tied else [(head_attr, lm_head)]))
        self._head_attr = head_attr
        if not _has_params(self.head):
            raise NotImplementedError(
                f"{family}: this configuration has no final norm and a tied lm_head, so the head block would own "
                "no parameters (e.g. OPT with do_layer_norm_before=false and no project_out); not supported")
        layers = list(children[self._layers_attr])
        # the embed block runs the decoder's own forward up to layer 0: a shallow copy of the decoder whose
        # layer list is one stub that stops it, sharing every other child (the streamer swaps their weights)
        shell = object.__new__(type(decoder))
        shell.__dict__ = dict(decoder.__dict__)
        shell._modules = dict(decoder._modules)
        shell._modules[self._layers_attr] = nn.ModuleList([_StubLayer(0, None, stop=True)] * len(layers))
        self._shell = shell

        self.modules: list[nn.Module] = [self.embed, *layers, self.head]
        self.names = ["embed", *(f"layer{i}" for i in range(len(layers))), "head"]
        tok_index = [n for n, _ in self.embed.named_parameters()].index(f"{self._tokens_attr}.weight")
        self._tied_ref = (0, tok_index)

        self._param_names = self._state_dict_names(model)
        self._cache: dict[tuple, list[tuple[tuple, dict]]] = {}
        self._probe_lock = threading.Lock()  # the probe's stand-in weights are swapped per dtype and device


    def _state_dict_names(self, model: nn.Module) -> list[list[str]]:
        """HF state-dict names of every block's parameters (module identity is stable; the streamer only swaps the
        entries of `module._parameters`); every parameter of the model must be in a block."""
        module_names: dict[int, str] = {}
        for name, module in model.named_modules():
            module_names.setdefault(id(module), name)
        out: list[list[str]] = []
        covered: set[int] = set()
        for block in self.modules:
            names = []
            for pname, p in block.named_parameters():
                owner, _, leaf_name = pname.rpartition(".")
                names.append(f"{module_names[id(block.get_submodule(owner))]}.{leaf_name}")
                covered.add(id(p))
            out.append(names)
        missing = [n for n, p in model.named_parameters() if id(p) not in covered]
        if missing:
            raise NotImplementedError(f"{self.family}: parameters outside the embed/layers/head blocks: {missing[:5]}")
        return out
    def _find_decoder(self) -> tuple[str, nn.Module, str]:
        """(name, module, layer-list attribute) of the module holding the token embedding and the layer list."""
        tokens = self.model.get_input_embeddings()
        found = []
        for name, module in self.model.named_modules():
            children = dict(module.named_children())
            if module is not self.model and any(c is tokens for c in children.values()):
                found += [(name, module, k) for k, c in children.items()
                          if isinstance(c, nn.ModuleList) and len(c) == self.n_layer]
        if len(found) != 1:
            what = "no" if not found else f"{len(found)} candidate"
            raise NotImplementedError(
                f"{self.family}: {what} list of {self.n_layer} decoder layers next to the token embedding; not a "
                f"standard decoder-only layout. {_supported_text()}")
        return found[0]

    def _check_supported(self) -> None:
        cfg = self.config
        if getattr(cfg, "add_cross_attention", False):
            raise NotImplementedError(f"{self.family} with add_cross_attention is not supported (decoder-only LMs)")
        impl = getattr(cfg, "_attn_implementation", "sdpa")
        if impl not in ("sdpa", "eager"):
            raise NotImplementedError(f"attention implementation {impl!r}: build with sdpa (or eager)")

    # ------------------------------------------------------------------ BlockProgram
    def param_names(self, i: int) -> list[str]:
        """HF state-dict names of block i's parameters, in `modules[i].parameters()` order."""
        return list(self._param_names[i])

    def planning_config(self, name: str = "hf") -> ModelConfig:
        """A GPT-shaped ModelConfig with this model's dimensions and (about) its parameter count, for the
        planners (capacity, GPU memory), which model GPT blocks."""
        d = int(getattr(self.config, "hidden_size", 0) or self.config.n_embd)
        per_block = sum(p.numel() for p in self.modules[1].parameters())
        ratio = max(1, round((per_block - 4 * d * d) / (2 * d * d)))  # GPT block: 4d^2 attention + 2*ratio*d^2 MLP
        return ModelConfig(name=name, n_layer=self.n_layer, n_head=int(self.config.num_attention_heads), d_model=d,
                           vocab_size=self.vocab_size, seq_len=self.max_seq_len, mlp_ratio=ratio,
                           tie_embeddings=bool(getattr(self.config, "tie_word_embeddings", False)))

    def param_order(self) -> list[tuple[int, int]]:
        """(block, index in the block) of every parameter in the model's own `parameters()` order, which
        is not always block order (OPT registers its final norm before the layers). Gradient clipping
        takes the global norm in this order, as `clip_grad_norm_(model.parameters())` does."""
        where = {name: (i, k) for i, names in enumerate(self._param_names) for k, name in enumerate(names)}
        return [where[name] for name, _ in self.model.named_parameters() if name in where]

    def external_params(self, i: int) -> list[tuple[int, int]]:
        return [self._tied_ref] if self.tied and i == len(self.modules) - 1 else []

    def run(self, i: int, x: Tensor, targets: Tensor | None) -> Tensor:
        last = len(self.modules) - 1
        if i == 0:
            return self._embed(x)
        if i < last:
            args, kwargs = self._layer_inputs(x)[i - 1]
            out = self.modules[i](x, *args, **kwargs)
            return out[0] if isinstance(out, tuple) else out
        # the lm_head's Linear, soft-capping and lm_loss in one (models.lm_head: padded vocabulary, chunked)
        return head_loss(self._features(x), self._head_weight(), targets, post=self._cap if self.softcap else None)

    def logits(self, x: Tensor) -> Tensor:
        """The head block without the loss: final hidden states -> logits (as HF's forward gives them)."""
        return self._cap(F.linear(self._features(x), self._head_weight()))

    def _features(self, x: Tensor) -> Tensor:
        """The head's modules before the lm_head (the final norm, OPT's project_out) on final hidden states."""
        for name in self._post:
            x = getattr(self.head, name)(x)
        return x

    def _head_weight(self) -> Tensor:
        """The lm_head's weight: the embedding's current parameter when tied (the streamer swaps it in and out)."""
        if self.tied:
            return getattr(self.embed, self._tokens_attr).weight
        return getattr(self.head, self._head_attr).weight

    def _cap(self, logits: Tensor) -> Tensor:
        """Final logit soft-capping (Gemma 2/3), with the very ops of HF's *ForCausalLM forward."""
        if self.softcap is None:
            return logits
        logits = logits / self.softcap
        logits = torch.tanh(logits)
        return logits * self.softcap

    def forward(self, ids: Tensor) -> Tensor:
        """All blocks in a row (materialized weights): logits for token ids [B, T]."""
        x = self.run(0, ids, None)
        for i in range(1, len(self.modules) - 1):
            x = self.run(i, x, None)
        return self.logits(x)

    # ------------------------------------------------------------------ pieces
    def _embed(self, ids: Tensor) -> Tensor:
        if ids.shape[1] > self.max_seq_len:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds the model's {self.max_seq_len} positions; "
                             "use a shorter seq_len")
        return _run_to_first_layer(self._shell, ids, self.family)

    def _layer_inputs(self, x: Tensor) -> list[tuple[tuple, dict]]:
        """What the HF decoder passes each layer for hidden states like x (captured once per shape)."""
        key = (x.shape[0], x.shape[1], x.dtype, x.device)
        hit = self._cache.get(key)
        if hit is None:
            with self._probe_lock, _no_dispatch_modes():
                hit = self._probe.layer_inputs(*key, family=self.family)
            hit = _beside(hit, x)
            if len(self._cache) >= 4:  # eager masks are [B, 1, T, T]: keep few
                self._cache.clear()
            self._cache[key] = hit
        return hit

    def flops_per_token(self, seq: int) -> float:
        """Forward FLOPs per token: 2 x matmul weights (lm_head included) + attention's 4 x L x T x width."""
        if not hasattr(self, "_matmul_params"):
            from transformers.pytorch_utils import Conv1D

            heads = int(self.config.num_attention_heads)
            self._attn_width = heads * int(getattr(self.config, "head_dim", None) or self.hidden_size // heads)
            self._matmul_params = sum(m.weight.numel() for m in self.model.modules()
                                      if isinstance(m, nn.Linear | Conv1D))
        return 2.0 * self._matmul_params + 4.0 * self.n_layer * seq * self._attn_width


def _attention_for(config: Any) -> str:
    """The attention `from_pretrained` picks by default: SDPA where the family has it, else eager (Gemma 2,
    whose attention soft-capping SDPA cannot do). Training and the exported model then compute alike."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return "sdpa"
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def load_hf_skeleton(path: str | os.PathLike, n_layer: int | None = None) -> HFBlocks:
    """The model of a local HF directory with parameters on the meta device (buffers real, fp32).

    `n_layer` keeps only the first N decoder layers (a slice of the real width, `--layers N`); the
    layer-type pattern (sliding / full attention) is cut to match.
    """
    family, data = _family(path)
    from transformers import AutoConfig, AutoModelForCausalLM

    check_dimensions(path, data)  # before transformers reads them (a config class divides by some)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    _refuse_kind(path, {**config.to_dict(), **data})  # again with the family's defaults (BERT's token types)
    check_dimensions(path, data, config)
    if n_layer is not None:
        data = _sliced_config(path, data, config, n_layer)
    check_shape(path, config, _attention_for(config))  # from its arithmetic: the build below allocates for real
    with _meta_parameters():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation=_attention_for(config))
    program = HFBlocks(model, family, data)
    if family not in SUPPORTED:
        log.warning("%s: model_type %r is not among the tested families (%s); its layout and forward passed the "
                    "structural checks", path, family, ", ".join(SUPPORTED))
    return program


def _sliced_config(path: str | os.PathLike, data: dict, config: Any, n_layer: int) -> dict:
    """Cut `config` (in place) and its config.json dict (a copy, returned) to the first n_layer layers."""
    have = int(config.num_hidden_layers)
    if not isinstance(n_layer, int) or isinstance(n_layer, bool) or not 1 <= n_layer <= have:
        raise ValueError(f"--layers {n_layer}: {path} has {have} decoder layers; choose 1 to {have}")
    data = dict(data)
    config.num_hidden_layers = n_layer  # through attribute_map where the family names it otherwise (n_layer)
    key = next((k for k in ("num_hidden_layers", "n_layer", "num_layers") if k in data), "num_hidden_layers")
    data[key] = n_layer
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:n_layer]
        data["layer_types"] = list(config.layer_types)
    return data


def model_meta(program: HFBlocks) -> dict:
    """The store's description of the model: stable across runs, no paths."""
    config = {k: v for k, v in program.config_dict.items() if k not in _META_DROP}
    return {"kind": "hf", "family": program.family, "config": config}
