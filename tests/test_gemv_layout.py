"""The GEMV's x fragments in shared memory are read without bank conflicts (docs/kernels.md §2.2, step 7): for
every MMA step, each phase of a 16-byte shared load (8 consecutive lanes: g = 0, 1 and t = 0..3 of lanes
4 g + t) must touch 8 different 16-byte bank groups, for both weight formats and both x layouts (the 8-token
kernels' whole rows, smem_row; the token stream's quarter rows, stream_row). The offsets are the kernel's own
functions (mma.bf16_x_k / fp4.fp4_x_k); an NVFP4 order without the t & 2 swap fails here. And the layouts
of xn, the norm kernel's output (loader.abi.xn_strides): plain rows, the 16-token stream's ring layout, in
which each group's K quarter is one contiguous block (one bulk copy), or the wgmma tiles, from the norm
kernel's own index arithmetic (norm.wg_step, wg_partner, wg_offset)."""

import pytest

from loader import abi
from tests.conftest import needs_dsl


def _phase_groups(offset, row_elems, step):
    """For each of the 4 phases (lanes of g0 and g0 + 1, g0 = 0, 2, 4, 6): the 16-byte bank groups (0..7 of a
    128-byte line) its 8 lanes read at this step."""
    out = {}
    for g0 in range(0, 8, 2):
        groups = []
        for g in (g0, g0 + 1):
            for t in range(4):
                byte = (g * row_elems + offset(t, step)) * 2
                assert byte % 16 == 0, (g, t, step)
                groups.append(byte // 16 % 8)
        out[g0] = groups
    return out


@pytest.mark.parametrize("fp4", [False, True], ids=["bf16", "nvfp4"])
@pytest.mark.parametrize("layout", ["tile8", "stream"])
@pytest.mark.parametrize("k", [1024, 1536, 2048])
@needs_dsl
def test_x_fragment_reads_are_conflict_free(fp4, layout, k):
    """At every hidden size the qkv and gemv kernels build (the pads keep their bank offsets: k / 4 * 2
    bytes is a multiple of 128), over all of a quarter's MMA steps (16 at 2048, 8 at 1024)."""
    from flint_aot.kernels import fp4 as f4
    from flint_aot.kernels import mma

    fmt = "nvfp4" if fp4 else "bf16"
    row = mma.smem_row(fp4, k) if layout == "tile8" else abi.stream_row(fmt, k)
    assert row == (abi.tile8_row(fmt, k) if layout == "tile8" else k // 4 + abi.x_row_pad(fmt))
    offset = f4.fp4_x_k if fp4 else mma.bf16_x_k
    steps = mma.steps(k)
    assert steps == k // 128 and (not fp4 or steps == 4 * f4.fp4_chunks(k))
    for step in range(steps):
        for g0, groups in _phase_groups(offset, row, step).items():
            assert len(set(groups)) == 8, (layout, k, "step", step, "lanes of g", g0, g0 + 1, groups)


def test_the_rule_catches_the_unswapped_nvfp4_order():
    """The same rule on the order before the swap (word u at step u for every lane): 2-way conflicts."""
    def unswapped(t, i):
        return t * 32 + 128 * (i // 4) + 8 * (i % 4)

    groups = _phase_groups(unswapped, abi.stream_row("nvfp4"), 0)[0]
    assert len(set(groups)) == 4, groups


@needs_dsl
@pytest.mark.parametrize("k", [1024, 1536, 2048])
def test_each_lane_reads_every_word_once(k):
    """The swap is a permutation of a lane's steps: over its steps (16 at hidden 2048, k / 128 at k), lane t
    reads each of its words once, and the words are those of its chunks 4 c + t (32 k each)."""
    from flint_aot.kernels.fp4 import fp4_chunks, fp4_x_k
    from flint_aot.kernels.mma import steps

    words = steps(k)
    assert words == 4 * fp4_chunks(k) == k // 128
    for t in range(4):
        ks = sorted(fp4_x_k(t, i) for i in range(words))
        want = sorted(128 * c + 32 * t + 8 * u for c in range(fp4_chunks(k)) for u in range(4))
        assert ks == want, t


def _xn_offset(strides, t, k):
    """Element offset of token t's element k in an xn of these strides: the norm kernel's formula."""
    group, row, quarter = strides
    q, w = divmod(k, abi.K_QUARTER)
    return (t // 8) * group + (t % 8) * row + q * quarter + w


@pytest.mark.parametrize("spec", [None, abi.qkv_spec("bf16", True, 32, 4, norm="prologue", max_m=8),
                                  abi.qkv_spec("nvfp4", True, 32, 4, norm="prologue", max_m=64)],
                         ids=["ops", "prologue8", "prologue64"])  # fmt: skip
def test_the_ops_xn_is_plain_rows(spec):
    """The norm ops get xn as plain [M, 2048] rows (and so does a prologue-design spec, which no norm kernel
    feeds)."""
    s = abi.xn_strides(spec)
    assert s == abi.ROW_MAJOR and abi.xn_numel(13, s) == 13 * 2048
    assert all(_xn_offset(s, t, k) == t * 2048 + k for t in (0, 7, 8, 63) for k in (0, 511, 512, 2047))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_the_8_token_kernels_xn_is_their_padded_rows(fmt):
    """The two-kernel design's 8-token kernels read xn as rows of tile8_row elements (2048 and the pad of
    their shared memory, mma.smem_row), one after another: m rows are one block of m x tile8_row
    elements from the start, which one multicast copy brings into every CTA of the cluster; rows 16-byte
    aligned."""
    r = abi.tile8_row(fmt)
    s = abi.xn_strides(abi.qkv_spec(fmt, True, 16, 2, max_m=8))
    assert s == (8 * r, r, 512) and r * 2 % 16 == 0 and r > 2048
    for m in range(1, 9):
        assert abi.xn_numel(m, s) == m * r
        assert all(_xn_offset(s, t, k) == t * r + k for t in range(m) for k in (0, 511, 512, 2047))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", range(9, 17))
def test_the_16_token_streams_xn_is_its_ring_layout(fmt, m):
    """The two-kernel design's 16-token stream (the only tile that reads it: those of 32 and 64 read wgmma
    tiles, test_the_32_and_64_token_xn_is_wgmma_tiles) reads xn in its ring layout: every (token, k) at its
    own offset inside xn_numel; for each group of 8 tokens (n of them, the last group possibly fewer) and K
    quarter q, its n rows are the n x stream_row elements from (4 g + q) x 8 x stream_row on, row j's 512
    values first and then the pad: exactly the block StreamGemv.fill brings into a ring stage with one bulk
    copy, and 16-byte aligned (a bulk copy's source)."""
    assert [t for t in abi.M_TILES if t > 8 and not abi.wgmma_stream(abi.qkv_spec(fmt, True, 16, 2,
                                                                                   max_m=t))] == [16]
    s = abi.xn_strides(abi.qkv_spec(fmt, True, 16, 2, max_m=16))
    row = abi.stream_row(fmt)
    assert s == (32 * row, row, 8 * row) and row * 2 % 16 == 0
    n_el = abi.xn_numel(m, s)
    seen = set()
    for t in range(m):
        for k in range(0, 2048, 8):  # (a norm thread's 8 elements: one 16-byte store)
            o = _xn_offset(s, t, k)
            assert o % 8 == 0 and 0 <= o and o + 8 <= n_el and o not in seen
            seen.add(o)
            g, j, q = t // 8, t % 8, k // 512
            block = (4 * g + q) * 8 * row
            assert block + j * row <= o < block + j * row + 512
            n = min(m - 8 * g, 8)
            assert block + n * row <= n_el  # the group's copy stays inside xn
    assert len(seen) == m * 256


def _wg_stores(strides, t, fmt="nvfp4"):
    """The norm kernel's wgmma-tile stores of token t (NormKernel.store_wg): {element offset: the 8 k it
    holds}, run on integers through the kernel's own index arithmetic (norm.wg_step, wg_partner, wg_offset;
    NVFP4's pair order device.MMA_PAIRS) for its 256 threads and their 3 shuffle rounds."""
    from flint_aot.kernels.device import MMA_PAIRS
    from flint_aot.kernels.norm import wg_offset, wg_partner, wg_step

    group, row, quarter = strides
    bf16 = fmt == "bf16"
    out = {}
    for q in range(4):
        for half in range(2):  # a warp: 32 threads of one quarter
            lanes = range(32)
            cq = {ln: 32 * half + ln for ln in lanes}
            k0 = {ln: 512 * q + 8 * cq[ln] for ln in lanes}
            tq = {ln: wg_step(cq[ln], bf16)[0] for ln in lanes}
            step = {ln: wg_step(cq[ln], bf16)[1] for ln in lanes}
            order = range(8) if bf16 else MMA_PAIRS  # the thread's 8 k as 4 words of 2
            words = {ln: [(k0[ln] + order[2 * j], k0[ln] + order[2 * j + 1]) for j in range(4)]
                     for ln in lanes}  # fmt: skip
            held = {ln: list(words[ln]) for ln in lanes}
            for r in range(1, 4):  # round r: the partner sends its word t ^ r
                for ln in lanes:
                    held[ln][tq[ln] ^ r] = words[ln ^ wg_partner(r, bf16)][tq[ln]]
            for ln in lanes:
                c, n = 4 * step[ln] + tq[ln], t % 8
                o = wg_offset((t // 8) * group + q * quarter, c, n, row)
                out[o] = [k for pair in held[ln] for k in pair]
    return out


@needs_dsl
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m,tile", [(17, 32), (24, 32), (25, 32), (32, 32), (33, 64), (57, 64), (64, 64)])
def test_the_32_and_64_token_xn_is_wgmma_tiles(m, tile, fmt):
    """The two-kernel design's 32- and 64-token kernels read xn as wgmma tiles (loader.abi.WG_STRIDES,
    docs/kernels.md §2.6), 128-byte swizzled: the norm's stores of every token are 16-byte aligned, distinct,
    inside xn_numel, inside the token's own 128-byte lines, and each 16-byte chunk is what the MMAs read
    there: word t of token n's chunk 4 i + j is MMA pair j of the 8 k that lane t reads at step i
    (fp4.fp4_x_k: (k0 + j, k0 + j + 4); mma.bf16_x_k, step i = k block i: (k0 + 2 j, + 1)), at
    ((4 i + j) // 8) KB + 128 n + 16 (((4 i + j) % 8) ^ n) of its group and quarter's 8 KB (ldmatrix reads
    matrix j of step i there; the wgmma's k16 slice of chain h is chunks 4 i + 2 h and + 1, 32 contiguous
    bytes before the swizzle)."""
    from flint_aot.kernels.fp4 import fp4_x_k
    from flint_aot.kernels.mma import bf16_x_k

    spec = abi.qkv_spec(fmt, True, 16, 2, max_m=tile)
    s = abi.xn_strides(spec)
    assert s == abi.WG_STRIDES and abi.xn_pairs(spec) == (2 if fmt == "nvfp4" else 3)
    n_el = abi.xn_numel(m, s)
    assert n_el == -(-m // 8) * 8 * 2048
    seen = {}
    for t in range(m):
        stores = _wg_stores(s, t, fmt)
        assert len(stores) == 256
        for o, ks in stores.items():
            assert o % 8 == 0 and 0 <= o and o + 8 <= n_el and o not in seen
            assert (o // 64) % 8 == t % 8  # the token's own 128-byte line (row) of the atom
            seen[o] = ks
    for t in range(m):
        g, n = divmod(t, 8)
        for q in range(4):
            for i in range(16):
                for j in range(4):
                    c = 4 * i + j
                    o = g * s[0] + q * s[2] + (c // 8) * 512 + n * 64 + ((c % 8) ^ n) * 8
                    for lane_t in range(4):
                        if fmt == "nvfp4":
                            k0 = fp4_x_k(lane_t, i, 512 * q)
                            want = [k0 + j, k0 + j + 4]
                        else:
                            k0 = bf16_x_k(lane_t, i, 512 * q)
                            want = [k0 + 2 * j, k0 + 2 * j + 1]
                        assert seen[o][2 * lane_t : 2 * lane_t + 2] == want
