"""`python -m lohan.capacity`: the capacity CLI (`lohan.app.capacity`), kept at the name the README and scripts use."""

from __future__ import annotations

import sys

from lohan.app.capacity import lora_report, main, model_config, report

__all__ = ["lora_report", "main", "model_config", "report"]

if __name__ == "__main__":
    sys.exit(main())
