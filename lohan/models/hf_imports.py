"""What a lohan run keeps transformers from importing.

transformers imports torchao whenever it is installed, the moment a model class is built: its quantizer for
torchao-quantized checkpoints (``transformers/quantizers/quantizer_torchao.py``) is imported with every model,
behind ``is_torchao_available()``. lohan trains unquantized weights and installs torchao only as the reference of a
test (``tests/unit/runtime/test_format_adamw.py``, the ``dev`` extra), yet that import printed, at every Hugging Face run, lines
nobody running lohan can act on: two ``torch/utils/_pytree.py`` deprecation warnings about torchao's own enums
(``KernelPreference``, ``ScaleCalculationMode``), torchao's ``Failed to load ..._C_mxfp8`` and ``_C_cutlass_90a``
(kernels built for another Python and GPU) and ``Detected no triton``; and it took about two seconds.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger(__name__)


def keep_torchao_out() -> bool:
    """Have transformers treat torchao as absent in this process: for lohan's own runs (the CLI), never on import
    of lohan as a library, where the process may want transformers' torchao quantization.

    Only the availability check the quantizers are imported behind is replaced, before they are imported; every
    other warning stays. Returns False where it is too late (transformers built a model already) or where this
    transformers has no such check.
    """
    if "transformers.quantizers" in sys.modules:
        return False
    try:
        import transformers.utils as tf_utils
        import transformers.utils.import_utils as tf_import_utils
    except ImportError:
        return False
    if not hasattr(tf_utils, "is_torchao_available"):
        return False

    def torchao_unavailable(*args: object, **kwargs: object) -> bool:
        return False

    tf_utils.is_torchao_available = tf_import_utils.is_torchao_available = torchao_unavailable
    log.debug("transformers will not import torchao in this run (lohan trains unquantized weights)")
    return True
