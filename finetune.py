#!/usr/bin/env python
"""Fine-tune an LLM with its model states on NVMe SSDs. `python finetune.py --help`."""

import sys

from lohan.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
