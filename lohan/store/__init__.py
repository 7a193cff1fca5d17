"""The NVMe tier: what lives on the SSDs and how it stays crash-consistent (DESIGN.md §4.1).

- `states`: the model-states store (P32, m, v and P16 records in two slots, staged commits).
- `integrity`: checksums of records and atomically written JSON.
- `gradstash`: gradients kept for a deferred or redone update, in RAM and past it on the SSDs.
- `dirlock`: one run per directory.

Built on `io_engine` (volumes, aligned buffers, async I/O); knows model shapes only as a layout.
"""
