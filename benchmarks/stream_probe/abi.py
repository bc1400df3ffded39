"""What the stream probe kernel and benchmarks/bench_stream.py share (standard library only)."""

KIND = "stream_probe"
ROWS = 16  # weight rows per CTA (one per 128 threads, as the GEMV kernels)
TOKENS = 8  # x rows (the 8-token kernel's tile)
PAD = 32  # x row pad in shared memory (elements): the GEMV kernels' BF16 bank layout


def grid(n: int) -> tuple[int, int, int]:
    return (n // ROWS, 1, 1)


def smem_bytes(k: int) -> int:
    """x of TOKENS rows, padded, in dynamic shared memory."""
    return TOKENS * (k + PAD) * 2
