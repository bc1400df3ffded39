"""What the kernels, the build and the loader must agree on, written once (stdlib only): the fixed sizes,
the launch geometry, the specialization axes and the spec of each kernel kind.

Imported by the kernels (`flint_aot.kernels`), the config expansion (`flint_aot.config`) and the serve-time
ops (`loader.ops`). A kernel's parameter list is not here: it is the kernel function's signature, recorded
in the manifest by name (docs/bundle.md); the loader fills arguments by those names.
"""

from __future__ import annotations

HIDDEN = 2048  # K, the model's hidden size (the GEMV's reduction length): Flint's, a spec's default
HEAD_DIM = 128
HALF_DIM = HEAD_DIM // 2
MAX_M = 64  # decode tokens per call: the fused op and the GEMV
# The unfused norm and per-head ops serve prefill chunks too: up to the config's max_tokens (norm and
# qk_norm_rope_cache sections; default MAX_TOKENS, at least MAX_M, at most what their grids can hold)
MAX_TOKENS = 16384
# compile-time token tiles of the GEMV kernels (qkv, gemv): the loader runs the smallest that holds M; tiles
# above 8 are the token stream (docs/kernels.md §2.5)
M_TILES = (8, 16, 32, 64)
ROWS_PER_CTA = 16  # GEMV output rows per CTA (128 threads)
CLUSTER = HEAD_DIM // ROWS_PER_CTA  # CTAs per head in the fused kernel (one cluster)
NVFP4_BLOCK = 16  # k values per e4m3 block scale


# ------------------------------------------------------------------------- the hidden-size axis
# Every kernel that reads a row of the hidden size takes it from its spec ("hidden"). What each kind accepts:
# * norm: multiples of 512 from 512 to 8192 (a CTA of hidden / 8 threads, one 16-byte chunk each; the xn
#   layouts of the qkv kernels split K into quarters of whole 128-k MMA steps);
# * qkv and gemv: multiples of 512 from 1024 to 2048. Their weights stay in registers for the whole call, one
#   warp's K quarter of 16 rows: hidden / 128 blocks of 8 registers a lane (BF16); at 2048 that is the
#   register file's share of 3 CTAs per SM. Larger hidden sizes need a weight stream of several waves, which
#   this version does not have: they are refused by name;
# * the prologue design (the input norm in the qkv kernel) splits a row over the cluster in the norm kernel's
#   virtual warps: hidden 2048 only.
NORM_HIDDEN = range(512, 8192 + 1, 512)
GEMV_HIDDEN = range(1024, 2048 + 1, 512)
PROLOGUE_HIDDEN = (HIDDEN,)


def hidden_refusal(kind: str, k, norm: str = "separate") -> str | None:
    """Why a kernel of this kind cannot be built for hidden size k (None: it can)."""
    if isinstance(k, bool) or not isinstance(k, int):
        return "an integer"
    allowed = NORM_HIDDEN if kind == "norm" else GEMV_HIDDEN
    if k not in allowed:
        why = "" if kind == "norm" or k < allowed.start or k % 512 else (  # (the norm streams no weights)
            "; larger layers need a weight stream of several waves, which this version does not build")
        return f"a multiple of 512 in {allowed.start}..{allowed.stop - 1} for {kind}{why}"
    if kind == "qkv" and norm == "prologue" and k not in PROLOGUE_HIDDEN:
        return f"{' or '.join(map(str, PROLOGUE_HIDDEN))} for the prologue design (use norm: separate)"
    return None


def spec_hidden(spec: dict | None) -> int:
    """The hidden size a spec is built for (specs without one: HIDDEN)."""
    return (spec or {}).get("hidden", HIDDEN)


def scale_cols(k: int = HIDDEN) -> int:
    """NVFP4: e4m3 block scales per weight row (columns of the swizzled scale tensor)."""
    return k // NVFP4_BLOCK


def nvfp4_row_bytes(k: int = HIDDEN) -> int:
    """NVFP4: bytes of e2m1 codes per weight row."""
    return k // 2


def max_gemv_rows(k: int = HIDDEN) -> int:
    """The GEMV kernels index weight rows with 32-bit element offsets: row * k (BF16) stays below 2**31."""
    return (1 << 31) // k - ROWS_PER_CTA


SCALE_COLS = scale_cols()
NVFP4_ROW_BYTES = nvfp4_row_bytes()
MAX_GEMV_ROWS = max_gemv_rows()
E4M3_MAX = 448.0

ARCH_CC = {"sm_90a": (9, 0), "sm_100a": (10, 0)}
KINDS = ("norm", "qkv", "gemv", "qk_norm_rope_cache")
WEIGHT_FORMATS = ("bf16", "nvfp4")
KV_CACHE_DTYPES = ("bf16", "fp8_e4m3")
NORM_MODES = ("separate", "prologue")  # qkv: input norm in its own kernel, or in the qkv kernel's prologue

# Grid rules name these symbols; the loader supplies their values at launch (ROW_BLOCKS_4: ROW_BLOCKS
# rounded up to a multiple of 4; HEAD_BLOCKS and TOKEN_BLOCKS: HEADS over QKNRC_HEADS and M over QKNRC_TOKENS,
# rounded up).
CALLER_GRID = ("GRID_X", "GRID_Y", "GRID_Z")  # a plugin kernel's rule: the caller gives the grid
GRID_SYMBOLS = ("M", "ROW_BLOCKS", "HEADS", "ROW_BLOCKS_4", "HEAD_BLOCKS", "TOKEN_BLOCKS", *CALLER_GRID)
GRID = {
    "norm": ("M", 1, 1),  # one CTA per token
    "qkv": ("ROW_BLOCKS", 1, 1),  # one CTA per 16 weight rows, clusters of CLUSTER
    "gemv": ("ROW_BLOCKS", 1, 1),
    "qk_norm_rope_cache": ("HEAD_BLOCKS", "TOKEN_BLOCKS", 1),  # QKNRC_HEADS heads of QKNRC_TOKENS tokens
}
QKNRC_HEADS, QKNRC_TOKENS = 4, 8  # qk_norm_rope_cache's CTA: 4 heads (one after another) of 8 tokens


def tokens_limit(k: int = HIDDEN) -> int:
    """The largest max_tokens: qk_norm_rope_cache's TOKEN_BLOCKS within grid.y's 65535, and the norm kernel's
    32-bit element offsets (row * k) below 2**31."""
    return min(QKNRC_TOKENS * 65535, ((1 << 31) - 1) // k)


TOKENS_LIMIT = tokens_limit()
# the standalone GEMV's token stream (tiles > 8): clusters of 4 CTAs, one per K quarter of 64 rows
STREAM_CLUSTER_GEMV = 4
GRID_STREAM_GEMV = ("ROW_BLOCKS_4", 1, 1)

# C types of kernel parameters: name -> (size, alignment); the loader packs them with natural alignment.
PARAM_TYPES = {"ptr": (8, 8), "i32": (4, 4), "i64": (8, 8), "f32": (4, 4)}
F32_MAX = 3.4028234663852886e38


# ------------------------------------------------------------------------- xn, the input norm's output
# The norm kernel writes token t's element k of xn at (t // 8) * group + (t % 8) * row + (k // 512) * quarter
# + k % 512, three element strides it takes as parameters (xn_group, xn_row, xn_quarter), in the layout of
# the shared memory its reader copies it into, so that the reader's copies are few (their count costs, not
# their bytes):
# * ROW_MAJOR, plain [M, 2048] rows: the norm ops' output;
# * the 8-token qkv kernels (two-kernel design): rows of tile8_row elements (2048 and a pad), one multicast
#   copy for all M tokens (one per token: NVFP4 0.07-0.26 us per layer slower at M = 4-8);
# * the token stream (two-kernel design, tiles > 8): its ring layout, each group of 8 tokens and K quarter
#   as 8 rows of stream_row elements (512 and a pad), contiguous, one bulk copy per ring stage (one per
#   token: 0.24-1.8 us per layer slower at M = 12-64). Both pads: the bank layouts of docs/kernels.md §2.
TOKEN_GROUP = 8  # tokens per group: one mma.sync N
K_QUARTER = HIDDEN // 4  # k per K quarter (the token stream's unit of K) at HIDDEN; k // 4 at k


def row_major(k: int = HIDDEN) -> tuple[int, int, int]:
    """Plain [M, k] rows as (group, row, quarter) strides."""
    return (TOKEN_GROUP * k, k, k // 4)


ROW_MAJOR = row_major()


def x_row_pad(weight_format: str) -> int:
    """Elements that pad each row of x in the GEMV kernels' shared memory (and in the xn they copy from), so
    that the 16-byte fragments the lanes of a quad read at once from rows g and g + 1 fall in different banks:
    BF16 a row stride of 64 mod 128 bytes; NVFP4, whose lanes t and t + 2 read words in swapped order, 16 mod
    128 (flint_aot/kernels/mma.py, fp4.py)."""
    return 8 if weight_format == "nvfp4" else 32


def stream_row(weight_format: str, k: int = HIDDEN) -> int:
    """Row stride (elements) of a group's K quarter in the token stream's ring, in shared memory and in xn.
    (The pads keep their bank offsets at every k that is a multiple of 512: k / 4 * 2 bytes is 0 mod 128.)"""
    return k // 4 + x_row_pad(weight_format)


def tile8_row(weight_format: str, k: int = HIDDEN) -> int:
    """Row stride (elements) of x in the 8-token qkv kernel's shared memory, and in the xn it reads."""
    return k + x_row_pad(weight_format)


def ring_strides(weight_format: str, k: int = HIDDEN) -> tuple[int, int, int]:
    """(group, row, quarter) element strides of the token stream's ring layout: a group's 4 K quarters one
    after another, each 8 rows of stream_row elements."""
    s = stream_row(weight_format, k)
    return (4 * TOKEN_GROUP * s, s, TOKEN_GROUP * s)


# * the 32- and 64-token kernels (two-kernel design), whose MMAs read x as wgmma operands: each group's K
#   quarter as K-major tiles with the 128-byte swizzle, 8 atoms of 8 rows (tokens) x 128 bytes; logical
#   16-byte chunk 4 i + j of token n's row holds, at word t, MMA pair j of the 8 k that lane t reads at MMA
#   step i, stored at (chunk // 8) KB + n * 128 + ((chunk % 8) ^ n) * 16 bytes: 8 KB a group and quarter, no
#   pad, one bulk copy (`row`: the 128-byte row, in elements). NVFP4 (xn_pairs 2): k0 = kernels.fp4.fp4_x_k,
#   pair j = (k0 + j, k0 + j + 4); BF16 (xn_pairs 3): step i is k block i, k0 = kernels.mma.bf16_x_k, pair
#   j = (k0 + 2 j, k0 + 2 j + 1).


def wg_strides(k: int = HIDDEN) -> tuple[int, int, int]:
    """(group, row, quarter) strides of the wgmma tiles: a group's K quarter is TOKEN_GROUP * k / 4 elements
    (8 KB at 2048)."""
    quarter = TOKEN_GROUP * (k // 4)
    return (4 * quarter, 64, quarter)


WG_QUARTER = TOKEN_GROUP * K_QUARTER
WG_STRIDES = wg_strides()


def wgmma_stream(qkv: dict | None) -> bool:
    """The qkv kernel of spec `qkv` is a 32- or 64-token kernel of the two-kernel design, which reads xn in
    the WG_STRIDES layout (docs/kernels.md §2.6; on sm_100a, which has no wgmma, by mma.sync)."""
    if not qkv or qkv.get("norm", "separate") != "separate":
        return False
    return qkv.get("max_m", 8) in (32, 64)


def xn_strides(qkv: dict | None = None) -> tuple[int, int, int]:
    """(group, row, quarter) element strides of the xn the qkv kernel of spec `qkv` reads (None: the norm
    ops' output, plain rows; the prologue design reads none)."""
    k = spec_hidden(qkv)
    if qkv is None or qkv.get("norm", "separate") != "separate":
        return row_major(k)
    if wgmma_stream(qkv):
        return wg_strides(k)
    if qkv.get("max_m", 8) <= TOKEN_GROUP:
        r = tile8_row(qkv["weight_format"], k)
        return (TOKEN_GROUP * r, r, k // 4)
    return ring_strides(qkv["weight_format"], k)


def xn_pairs(qkv: dict | None = None) -> int:
    """1 where the qkv kernel of spec `qkv` reads xn with each 8-element chunk k0 .. k0 + 7 stored in the
    order of its NVFP4 MMA pairs (k0, k0 + 4, k0 + 1, k0 + 5, .., k0 + 3, k0 + 7): the two-kernel design with
    NVFP4 weights, whose norm kernel then writes it so, once, instead of every warp of every CTA permuting
    every fragment it reads (4 byte permutes a 16-byte load); 2 where those pairs go to the wgmma tiles of
    WG_STRIDES (wgmma_stream), 3 where BF16's plain pairs do; else 0 (plain order)."""
    if qkv is None or qkv.get("norm", "separate") != "separate":
        return 0
    if wgmma_stream(qkv):
        return 2 if qkv["weight_format"] == "nvfp4" else 3
    return int(qkv["weight_format"] == "nvfp4")


def xn_numel(m: int, strides: tuple[int, int, int]) -> int:
    """Elements of an xn of m tokens in that layout: whole rows one after another, pads included (what one
    copy of m rows reads); the ring layout's whole groups (what a group's bulk copies may read)."""
    group, row, _ = strides
    if group == TOKEN_GROUP * row:
        return m * row
    return -(-m // TOKEN_GROUP) * group


# ------------------------------------------------------------------------- specs, one constructor per kind
def norm_spec(residual: bool, hidden: int = HIDDEN) -> dict:
    return {"residual": bool(residual), "hidden": int(hidden)}


def qkv_spec(weight_format: str, rope: bool, nq: int, nkv: int, kv_cache_dtype: str = "bf16",
             norm: str = "separate", max_m: int = 8, hidden: int = HIDDEN,
             qk_norm: bool = True) -> dict:  # fmt: skip
    return {"weight_format": weight_format, "rope": bool(rope), "heads": [int(nq), int(nkv)],
            "kv_cache_dtype": kv_cache_dtype, "norm": norm, "max_m": int(max_m), "hidden": int(hidden),
            "qk_norm": bool(qk_norm)}  # fmt: skip


def gemv_spec(weight_format: str, max_m: int = 8, hidden: int = HIDDEN) -> dict:
    return {"weight_format": weight_format, "max_m": int(max_m), "hidden": int(hidden)}


def m_tiles(m: int) -> list[int]:
    """The token tiles that serve M tokens, the fastest first."""
    return [t for t in M_TILES if t >= m]


def qk_norm_rope_cache_spec(rope: bool, kv_cache_dtype: str = "bf16", qk_norm: bool = True) -> dict:
    return {"rope": bool(rope), "kv_cache_dtype": kv_cache_dtype, "qk_norm": bool(qk_norm)}


def spec_name(kind: str, spec: dict) -> str:
    """The specialization's name: unique per arch; the cubin's base name and its entry symbol's prefix.
    Flint's own axes' values (hidden 2048, q/k norm on) add nothing to it, so that its names stay those of
    every bundle before those axes."""
    kv = "" if spec.get("kv_cache_dtype", "bf16") == "bf16" else "_kvfp8"
    tile = "" if spec.get("max_m", 8) == 8 else f"_m{spec['max_m']}"
    hid = "" if spec_hidden(spec) == HIDDEN else f"_k{spec['hidden']}"
    qkn = "" if spec.get("qk_norm", True) else "_qkn0"
    if kind == "norm":
        return f"norm_res{int(spec['residual'])}{hid}"
    if kind == "qkv":
        q, k = spec["heads"]
        pro = "_prologue" if spec.get("norm") == "prologue" else ""
        return f"qkv_{spec['weight_format']}_rope{int(spec['rope'])}{qkn}_h{q}x{k}{hid}{kv}{pro}{tile}"
    if kind == "gemv":
        return f"gemv_{spec['weight_format']}{hid}{tile}"
    if kind == "qk_norm_rope_cache":
        return f"qk_norm_rope_cache_rope{int(spec['rope'])}{qkn}{kv}"
    raise ValueError(f"unknown kernel kind {kind!r}; known: {', '.join(KINDS)}")
