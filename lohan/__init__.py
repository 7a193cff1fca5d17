"""LoHan: fine-tune LLMs far larger than GPU and main memory, with model states on NVMe SSDs."""
