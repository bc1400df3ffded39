"""Where the named trace points of a timeline build land (kernels/trace.py stores them; tools/timeline.py
reads them on the GPU machine, which has no DSL: this module imports nothing)."""

# The fused qkv kernel: 32 words a CTA, in its `v_scale` buffer (a BF16-cache build never reads it)
QKV_WORDS = 32
START, WEIGHTS_IN, WAIT_RETURNED, X_IN, GEMV_DONE, EXCHANGED, STORED, SMID = range(8)
GROUP_DONE = 8  # + i: group i's MMAs done (the token stream)
GROUP_X_IN = 16  # + i: group i's x stage landed (the token stream, two-kernel design)
# The norm kernel: 8 words a row, in the `trace` parameter the timeline build adds
NORM_WORDS = 8
NORM_START, NORM_WAITED, NORM_REDUCED, NORM_STORED, NORM_SMID = 0, 1, 2, 3, 7
