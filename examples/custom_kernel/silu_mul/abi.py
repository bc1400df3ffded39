"""What the SiLU-and-mul kernel and the code that launches it agree on, written once (standard library only:
the serve side imports it, never the kernel module)."""

KIND = "silu_mul"  # the kind the build config gives the kernel (flint_plus.yaml's plugins section)
VEC = 8  # bf16 per thread: one 16-byte load of gate, one of up, one 16-byte store
THREADS = 128
COLS_PER_CTA = VEC * THREADS  # the columns of one row a CTA computes


def grid(m: int, intermediate: int) -> tuple[int, int, int]:
    """The launch grid for m rows: one CTA per COLS_PER_CTA columns (the last may be partial) and row."""
    return (-(-intermediate // COLS_PER_CTA), m, 1)
