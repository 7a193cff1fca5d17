"""How the engine runs a model block by block.

The engine needs, for block i: the module, a function from the block input to its output
(the last block returns the micro-batch loss), and which parameters of *other* blocks it uses
(tied weights), so their gradient contributions can be routed to the owning block.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor, nn

from lohan.config import ModelConfig
from lohan.models.gpt import GPT
from lohan.models.lm_head import head_loss


class BlockProgram(Protocol):
    """A model cut into blocks: [first (token ids -> hidden), ..., last (hidden -> loss)]."""

    modules: list[nn.Module]
    names: list[str]

    def run(self, i: int, x: Tensor, targets: Tensor | None) -> Tensor:
        """Block i on input x; the last block returns the mean loss over `targets`."""
        ...

    def external_params(self, i: int) -> list[tuple[int, int]]:
        """(owner block, parameter index in the owner's layout) of parameters block i borrows."""
        ...


class GPTBlocks:
    """The in-house GPT as [embed, block 0..L-1, head]; the tied head borrows embed's wte."""

    def __init__(self, model: GPT) -> None:
        self.model = model
        self.modules = model.block_modules()
        self.names = ["embed", *(f"block{i}" for i in range(len(model.blocks))), "head"]
        self._tied = model.cfg.tie_embeddings
        wte_index = [name for name, _ in model.embed.named_parameters()].index("wte.weight")
        self._wte = (0, wte_index)

    def run(self, i: int, x: Tensor, targets: Tensor | None) -> Tensor:
        last = len(self.modules) - 1
        if i == 0:
            return self.model.embed(x)
        if i < last:
            return self.modules[i](x)
        # the head's Linear and lm_loss in one (models.lm_head: padded vocabulary, chunked softmax)
        head = self.model.head
        weight = self.model.embed.wte.weight if self._tied else head.lm_head.weight
        return head_loss(head.ln_f(x), weight, targets)

    def external_params(self, i: int) -> list[tuple[int, int]]:
        return [self._wte] if self._tied and i == len(self.modules) - 1 else []

    def planning_config(self, name: str | None = None) -> ModelConfig:
        """The model's shape, for the planners (capacity, GPU memory)."""
        return self.model.cfg
