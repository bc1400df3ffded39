"""The hidden-size (K) and q/k-norm specialization axes without a GPU: what loader.abi says each kind can be
built for, the xn layouts at other hidden sizes (and their old constants at 2048), the spec names, the
loader's checks of K-sized tensors, and which kernels the ops pick for a hidden size and for q/k norm off
(a dry run: CPU tensors, launches recorded instead of made)."""

import pytest
import torch

from loader import abi, checks
from tests.conftest import needs_dsl
from tests.test_loader_cpu import _DryRun

WAVES = "several waves"  # the reason named for the qkv and gemv kernels past hidden 2048


# ----------------------------------------------------------------------------- loader.abi
@pytest.mark.parametrize(
    "kind, k, norm, why",
    [
        ("norm", 512, "separate", None),
        ("norm", 1024, "separate", None),
        ("norm", 1536, "separate", None),
        ("norm", 4096, "separate", None),
        ("norm", 8192, "separate", None),
        ("norm", 256, "separate", "512..8192 for norm"),
        ("norm", 8704, "separate", "a multiple of 512 in 512..8192 for norm"),  # (a CTA: k / 8 threads)
        ("norm", 16384, "separate", "512..8192 for norm"),
        ("norm", 1000, "separate", "a multiple of 512 in 512..8192"),
        ("norm", 0, "separate", "512..8192"),
        ("norm", True, "separate", "an integer"),
        ("norm", 2048.0, "separate", "an integer"),
        ("norm", "2048", "separate", "an integer"),
        ("qkv", 1024, "separate", None),
        ("qkv", 1536, "separate", None),
        ("qkv", 2048, "separate", None),
        ("qkv", 2048, "prologue", None),
        ("qkv", 512, "separate", "a multiple of 512 in 1024..2048 for qkv"),
        ("qkv", 1280, "separate", "a multiple of 512 in 1024..2048 for qkv"),
        ("qkv", 2560, "separate", "1024..2048 for qkv; larger layers need a weight stream of " + WAVES),
        ("qkv", 4096, "separate", "1024..2048 for qkv; larger layers need a weight stream of " + WAVES),
        ("qkv", 5120, "separate", WAVES),
        ("qkv", 1024, "prologue", "2048 for the prologue design (use norm: separate)"),
        ("qkv", 1536, "prologue", "prologue design"),
        ("gemv", 1024, "separate", None),
        ("gemv", 2048, "separate", None),
        ("gemv", 512, "separate", "1024..2048 for gemv"),
        ("gemv", 4096, "separate", "1024..2048 for gemv; larger layers need a weight stream of " + WAVES),
        ("gemv", 2304, "separate", "1024..2048 for gemv"),
        ("gemv", False, "separate", "an integer"),
    ],
)  # fmt: skip
def test_hidden_refusal_says_what_each_kind_builds(kind, k, norm, why):
    """loader.abi.hidden_refusal: the norm 512..8192; qkv and gemv 1024..2048 (past it, where a multiple of
    512, refused naming the weight stream of several waves it would need); the prologue design 2048 only."""
    got = abi.hidden_refusal(kind, k, norm)
    if why is None:
        assert got is None, got
    else:
        assert got is not None and why in got, got
        if WAVES not in why:  # the multi-wave reason only where a stream of several waves would be the fix
            assert WAVES not in got, got


def test_hidden_helpers_at_2048_are_the_old_constants():
    """The functions of the axis at the default hidden size give the constants every bundle before the axis
    was built with (the values at HEAD before it, written out), and scale with k."""
    assert abi.HIDDEN == 2048 and abi.spec_hidden(None) == abi.spec_hidden({}) == 2048
    assert abi.spec_hidden(abi.norm_spec(True, 1024)) == 1024
    assert (abi.SCALE_COLS, abi.NVFP4_ROW_BYTES, abi.MAX_GEMV_ROWS) == (128, 1024, 1048560)
    assert (abi.scale_cols(1024), abi.nvfp4_row_bytes(1024), abi.max_gemv_rows(1024)) == (64, 512, 2097136)
    assert abi.max_gemv_rows(1536) == (1 << 31) // 1536 - 16 == 1398085  # (rows * k: 32-bit offsets)
    assert abi.TOKENS_LIMIT == abi.tokens_limit(2048) == 524280
    assert abi.tokens_limit(8192) == ((1 << 31) - 1) // 8192 == 262143
    for k in abi.NORM_HIDDEN:  # the norm kernel's 32-bit row offsets, the per-head op's grid
        assert abi.tokens_limit(k) * k < 1 << 31 and -(-abi.tokens_limit(k) // abi.QKNRC_TOKENS) <= 65535
    assert abi.ROW_MAJOR == abi.row_major() == (16384, 2048, 512)
    assert abi.WG_STRIDES == abi.wg_strides() == (16384, 64, 4096)
    assert (abi.tile8_row("bf16"), abi.tile8_row("nvfp4")) == (2080, 2056)
    assert abi.ring_strides("bf16") == (17408, 544, 4352) and abi.ring_strides("nvfp4") == (16640, 520, 4160)
    assert abi.row_major(1024) == (8192, 1024, 256) and abi.wg_strides(1024) == (8192, 64, 2048)
    assert (abi.tile8_row("bf16", 1024), abi.tile8_row("nvfp4", 1024)) == (1056, 1032)
    assert abi.ring_strides("bf16", 1024) == (9216, 288, 2304)
    assert abi.ring_strides("nvfp4", 1536) == (4 * 8 * 392, 392, 8 * 392)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("k", [1024, 1536, 2048])
def test_xn_strides_follow_the_specs_hidden_size(fmt, k):
    """The xn each qkv kernel reads, at its spec's hidden size: the 8-token kernels' padded rows
    (8 r, r, k / 4) with r = tile8_row(fmt, k), the 16-token stream's ring layout, the 32- and 64-token
    kernels' wgmma tiles, plain rows for the prologue design (and the norm ops); at 2048 the old constants."""
    def spec(tile, norm="separate"):
        return abi.qkv_spec(fmt, True, 16, 2, "bf16", norm, tile, k)

    pad = 8 if fmt == "nvfp4" else 32  # (abi.x_row_pad: the bank layouts of docs/kernels.md §2)
    r, row = abi.tile8_row(fmt, k), abi.stream_row(fmt, k)
    assert r == k + pad and row == k // 4 + pad
    assert abi.xn_strides(spec(8)) == (8 * r, r, k // 4)
    assert abi.xn_strides(spec(16)) == abi.ring_strides(fmt, k) == (32 * row, row, 8 * row)
    assert abi.xn_strides(spec(32)) == abi.xn_strides(spec(64)) == abi.wg_strides(k)
    for tile in abi.M_TILES:
        assert abi.xn_strides(spec(tile, "prologue")) == abi.row_major(k) == (8 * k, k, k // 4)
    if k == 2048:
        assert abi.xn_strides(spec(8)) == (8 * abi.tile8_row(fmt), abi.tile8_row(fmt), 512)
        assert abi.xn_strides(spec(16)) == abi.ring_strides(fmt)
        assert abi.xn_strides(spec(32)) == abi.WG_STRIDES
        assert abi.xn_strides(spec(8, "prologue")) == abi.xn_strides(None) == abi.ROW_MAJOR
    else:
        assert abi.xn_strides(spec(8)) != abi.xn_strides(abi.qkv_spec(fmt, True, 16, 2, max_m=8))
    assert [abi.xn_pairs(spec(t)) for t in abi.M_TILES] == ([1, 1, 2, 2] if fmt == "nvfp4" else [0, 0, 3, 3])


def _xn_offset(strides, k, t, c):
    """Element offset of token t's element c (hidden size k) in an xn of these strides: the norm kernel's
    formula (a thread's 8 elements: quarter c // (k / 4), element c % (k / 4) of it)."""
    group, row, quarter = strides
    q, w = divmod(c, k // 4)
    return (t // 8) * group + (t % 8) * row + q * quarter + w


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("k", [1024, 1536])
@pytest.mark.parametrize("tile", [8, 16])
def test_xn_rows_and_ring_hold_every_element_once_at_other_hidden_sizes(fmt, k, tile):
    """At hidden 1024 and 1536 the norm kernel's stores (8 elements a thread) land at distinct, 16-byte
    aligned offsets inside xn_numel; the 8-token kernels' m rows are one block of m x tile8_row elements;
    in the 16-token ring, each group's K quarter is the n rows of stream_row elements from
    (4 g + q) 8 stream_row on (one bulk copy), row j's k / 4 values first."""
    s = abi.xn_strides(abi.qkv_spec(fmt, True, 16, 2, max_m=tile, hidden=k))
    for m in range(1, tile + 1):
        n_el, seen = abi.xn_numel(m, s), set()
        if tile == 8:
            assert n_el == m * abi.tile8_row(fmt, k)
        for t in range(m):
            for c in range(0, k, 8):
                o = _xn_offset(s, k, t, c)
                assert o % 8 == 0 and 0 <= o and o + 8 <= n_el and o not in seen, (m, t, c, o)
                seen.add(o)
                if tile == 16:
                    row = abi.stream_row(fmt, k)
                    g, j, q = t // 8, t % 8, c // (k // 4)
                    block = (4 * g + q) * 8 * row
                    assert block + j * row <= o < block + j * row + k // 4
                    assert block + min(m - 8 * g, 8) * row <= n_el
        assert len(seen) == m * k // 8


def _wg_stores(strides, k, t, fmt):
    """The norm kernel's wgmma-tile stores of token t at hidden size k (NormKernel.store_wg), run on integers
    through its own index arithmetic (norm.wg_step, wg_partner, wg_offset; NVFP4's pair order
    device.MMA_PAIRS) for its k / 8 threads (k / 32 a quarter) and 3 shuffle rounds: {offset: the 8 k}."""
    from flint_aot.kernels.device import MMA_PAIRS
    from flint_aot.kernels.norm import wg_offset, wg_partner, wg_step

    group, row, quarter = strides
    bf16, qc = fmt == "bf16", k // 4 // 8  # qc: threads (8-element chunks) per K quarter
    order = range(8) if bf16 else MMA_PAIRS
    tids = range(k // 8)
    q = {i: i // qc for i in tids}
    tq = {i: wg_step(i % qc, bf16)[0] for i in tids}
    step = {i: wg_step(i % qc, bf16)[1] for i in tids}
    words = {i: [(8 * i + order[2 * j], 8 * i + order[2 * j + 1]) for j in range(4)] for i in tids}
    held = {i: list(words[i]) for i in tids}
    for r in range(1, 4):  # round r: a butterfly shuffle inside the warp, with the thread of t ^ r
        for i in tids:
            p = i ^ wg_partner(r, bf16)
            assert p // 32 == i // 32 and (q[p], step[p], tq[p]) == (q[i], step[i], tq[i] ^ r), (k, i, r)
            held[i][tq[i] ^ r] = words[p][tq[i]]
    out = {}
    for i in tids:
        o = wg_offset((t // 8) * group + q[i] * quarter, 4 * step[i] + tq[i], t % 8, row)
        out[o] = [c for pair in held[i] for c in pair]
    return out


@needs_dsl
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("k", [1024, 1536, 2048])
@pytest.mark.parametrize("m", [1, 9, 32, 57])
def test_the_wgmma_tiles_at_other_hidden_sizes(m, k, fmt):
    """The 32- and 64-token kernels' xn at hidden k (wg_strides(k)): the norm's stores of every token are
    distinct, inside xn_numel, in the token's own 128-byte lines, and the 16-byte chunk 4 i + j of token n's
    group and quarter is MMA pair j of the 8 k that lane t reads at step i (fp4.fp4_x_k / mma.bf16_x_k of
    quarter q, k / 128 steps), at (chunk // 8) KB + 128 n + 16 ((chunk % 8) ^ n) of the group and quarter's
    k / 256 KB (8 KB at 2048; at 1536 warps hold parts of two quarters: each shuffle stays in one)."""
    from flint_aot.kernels.fp4 import fp4_x_k
    from flint_aot.kernels.mma import bf16_x_k, steps

    spec = abi.qkv_spec(fmt, True, 16, 2, max_m=64, hidden=k)
    s = abi.xn_strides(spec)
    assert s == abi.wg_strides(k) and steps(k) == k // 128
    n_el = abi.xn_numel(m, s)
    assert n_el == -(-m // 8) * 8 * k
    seen = {}
    for t in range(m):
        stores = _wg_stores(s, k, t, fmt)
        assert len(stores) == k // 8
        for o, ks in stores.items():
            assert o % 8 == 0 and 0 <= o and o + 8 <= n_el and o not in seen
            assert (o // 64) % 8 == t % 8
            seen[o] = ks
    for t in range(m):
        g, n = divmod(t, 8)
        for q in range(4):
            for i in range(steps(k)):
                for j in range(4):
                    c = 4 * i + j
                    o = g * s[0] + q * s[2] + (c // 8) * 8 * s[1] + n * 64 + ((c % 8) ^ n) * 8
                    for lane_t in range(4):
                        if fmt == "nvfp4":
                            k0 = fp4_x_k(lane_t, i, k // 4 * q)
                            want = [k0 + j, k0 + j + 4]
                        else:
                            k0 = bf16_x_k(lane_t, i, k // 4 * q)
                            want = [k0 + 2 * j, k0 + 2 * j + 1]
                        assert seen[o][2 * lane_t : 2 * lane_t + 2] == want, (t, q, i, j, lane_t)
    assert len(seen) == m * k // 8


def test_spec_constructors_and_names():
    """Every spec names its hidden size (norm, qkv, gemv) and q/k norm (qkv, qk_norm_rope_cache); the names
    of hidden 2048 and q/k norm on are those of every bundle before the axes, the others add _k{hidden}
    after the heads (qkv), res{0,1} (norm), the format (gemv), and _qkn0 after rope{0,1}."""
    assert abi.norm_spec(True) == {"residual": True, "hidden": 2048}
    assert abi.gemv_spec("nvfp4", 16) == {"weight_format": "nvfp4", "max_m": 16, "hidden": 2048}
    assert abi.qk_norm_rope_cache_spec(True) == {"rope": True, "kv_cache_dtype": "bf16", "qk_norm": True}
    assert abi.qkv_spec("bf16", True, 16, 8) == {"weight_format": "bf16", "rope": True, "heads": [16, 8],
                                                 "kv_cache_dtype": "bf16", "norm": "separate", "max_m": 8,
                                                 "hidden": 2048, "qk_norm": True}  # fmt: skip
    assert abi.qkv_spec("bf16", 1, 16, 8, hidden=1024.0, qk_norm=0)["hidden"] == 1024
    qknrc = abi.qk_norm_rope_cache_spec
    names = [
        ("norm", abi.norm_spec(True), "norm_res1"),
        ("norm", abi.norm_spec(True, 1024), "norm_res1_k1024"),
        ("norm", abi.norm_spec(False, 4096), "norm_res0_k4096"),
        ("gemv", abi.gemv_spec("nvfp4", 16), "gemv_nvfp4_m16"),
        ("gemv", abi.gemv_spec("nvfp4", 16, 1024), "gemv_nvfp4_k1024_m16"),
        ("gemv", abi.gemv_spec("bf16", 8, 1536), "gemv_bf16_k1536"),
        ("qk_norm_rope_cache", qknrc(True), "qk_norm_rope_cache_rope1"),
        ("qk_norm_rope_cache", qknrc(True, qk_norm=False), "qk_norm_rope_cache_rope1_qkn0"),
        ("qk_norm_rope_cache", qknrc(False, "fp8_e4m3", False), "qk_norm_rope_cache_rope0_qkn0_kvfp8"),
        ("qkv", abi.qkv_spec("bf16", True, 16, 8, "fp8_e4m3", "separate", 64, 1024, False),
         "qkv_bf16_rope1_qkn0_h16x8_k1024_kvfp8_m64"),
        ("qkv", abi.qkv_spec("nvfp4", False, 32, 4, "bf16", "prologue", 16),
         "qkv_nvfp4_rope0_h32x4_prologue_m16"),
        ("qkv", abi.qkv_spec("nvfp4", False, 8, 1, hidden=1536), "qkv_nvfp4_rope0_h8x1_k1536"),
        ("qkv", abi.qkv_spec("bf16", True, 8, 1, qk_norm=False), "qkv_bf16_rope1_qkn0_h8x1"),
    ]  # fmt: skip
    for kind, spec, name in names:
        assert abi.spec_name(kind, spec) == name, (spec, name)
    # (a spec of a bundle before the axes, without the keys: the same name as hidden 2048 / q/k norm on)
    assert abi.spec_name("norm", {"residual": True}) == "norm_res1"
    assert abi.spec_name("qk_norm_rope_cache", {"rope": False, "kv_cache_dtype": "bf16"}) == (
        "qk_norm_rope_cache_rope0")  # fmt: skip


# ----------------------------------------------------------------------------- loader.checks
@pytest.fixture
def on_gpu0(monkeypatch):
    """CPU tensors that say they are on cuda:0 (as tests/test_loader_cpu.py's dry run fakes them)."""
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)


def _nvfp4(n, k):
    from loader import nvfp4

    return nvfp4.quantize((torch.randn(n, k) * 0.02).bfloat16())


def test_weight_checks_follow_the_hidden_size(on_gpu0):
    """checks.weight at k = 1024: BF16 [N, 1024] (N given, or any multiple of 16 up to max_gemv_rows(1024));
    [N, 2048] is refused naming [N, 1024]; at the default k the reverse."""
    bf = torch.zeros(48, 1024, dtype=torch.bfloat16)
    assert checks.weight(bf, None, None, 0, 48, 1024) == ("bf16", 48)
    assert checks.weight(bf, None, None, 0, None, 1024) == ("bf16", 48)
    wide = torch.zeros(48, 2048, dtype=torch.bfloat16)
    assert checks.weight(wide, None, None, 0, 48) == ("bf16", 48)
    for n in (48, None):
        with pytest.raises(ValueError, match=r"^weight must have shape \[48, 1024\], got \[48, 2048\]$"):
            checks.weight(wide, None, None, 0, n, 1024)
    with pytest.raises(ValueError, match=r"^weight must have shape \[48, 2048\], got \[48, 1024\]$"):
        checks.weight(bf, None, None, 0, 48)
    with pytest.raises(ValueError, match=rf"N a multiple of 16 in 16\.\.{abi.max_gemv_rows(1024)} "):
        checks.weight(torch.zeros(40, 1024, dtype=torch.bfloat16), None, None, 0, None, 1024)
    with pytest.raises(TypeError, match=r"bf16 \[N, 1024\] or NVFP4 uint8 \[N, 512\], got torch.float16"):
        checks.weight(bf.half(), None, None, 0, 48, 1024)


def test_nvfp4_weight_checks_follow_the_hidden_size(on_gpu0):
    """NVFP4 at k = 1024: codes uint8 [N, 512] and block scales [pad128(N), 64] (e4m3 or a uint8 view); the
    codes or scales of hidden 2048 are refused naming the shapes of 1024."""
    w, ws, gs = _nvfp4(144, 1024)
    assert w.shape == (144, 512) and ws.shape == (256, 64)
    assert checks.weight(w, ws, gs, 0, 144, 1024) == ("nvfp4", 144)
    assert checks.weight(w, ws.view(torch.uint8), gs, 0, None, 1024) == ("nvfp4", 144)
    w2, ws2, gs2 = _nvfp4(144, 2048)
    assert checks.weight(w2, ws2, gs2, 0, 144) == ("nvfp4", 144)
    with pytest.raises(ValueError, match=r"^weight must have shape \[144, 512\], got \[144, 1024\]$"):
        checks.weight(w2, ws2, gs2, 0, 144, 1024)
    with pytest.raises(ValueError, match=r"^weight_scale must have shape \[256, 64\], got \[256, 128\]$"):
        checks.weight(w, ws2, gs, 0, 144, 1024)
    with pytest.raises(ValueError, match=r"^weight_scale must have shape \[256, 128\], got \[256, 64\]$"):
        checks.weight(w2, ws, gs2, 0, 144)
    with pytest.raises(ValueError, match=r"^weight_scale must have shape \[256, 64\], got \[128, 64\]$"):
        checks.weight(w, ws[:128], gs, 0, 144, 1024)  # (rows padded to 128)


def test_activation_and_row_shapes_follow_the_hidden_size(on_gpu0):
    """checks.activations with cols None takes any K (x.shape[1], the kernel lookup then refuses one the
    bundle lacks) but not 0 columns; given cols, exactly those; rows(m, k) and hidden(k) are the shapes of the
    residual and the norm weight at k (at 2048 the prebuilt ones)."""
    for k in (1024, 1536, 2048, 4096):
        assert checks.activations(torch.zeros(3, k, dtype=torch.bfloat16)) == (3, 0)
    with pytest.raises(ValueError, match=r"^x must have shape \[M, K\] with 1 <= M <= 64 .*got \[3, 0\]$"):
        checks.activations(torch.zeros(3, 0, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^qkv must have shape \[M, 2560\] .*got \[3, 1024\]$"):
        checks.activations(torch.zeros(3, 1024, dtype=torch.bfloat16), "qkv", 2560)
    assert checks.rows(5, 1024) == torch.Size([5, 1024]) and checks.rows(70, 1536) == torch.Size([70, 1536])
    assert checks.rows(5) is checks.ROWS[5] and checks.rows(5, 2048) is checks.ROWS[5]
    assert checks.hidden(1024) == torch.Size([1024]) and checks.hidden(2048) is checks.HIDDEN_SHAPE


# ----------------------------------------------------------------------------- the ops (dry run)
AXES = {"archs": ["sm_90a"], "hidden": [1024, 2048], "norm": {"residual": [True, False]},
        "qkv": {"weight_format": ["bf16", "nvfp4"], "rope": [True], "heads": [[16, 8, 1024], [8, 1, 2048]],
                "qk_norm": [True, False]},
        "gemv": {"weight_format": ["bf16", "nvfp4"]},
        "qk_norm_rope_cache": {"rope": [True], "qk_norm": [True, False]}}  # fmt: skip


def _entries(raw):
    """Manifest entries for a config's specializations, each kernel's parameters from its signature (as
    tests/test_loader_cpu.py's _default_bundle_entries, for any config)."""
    from flint_aot.config import expand, validate
    from flint_aot.kernels import kernel_class
    from flint_aot.kernels.compile import kernel_params
    from loader.manifest import KernelEntry, Param

    out = []
    for s in expand(validate(raw)):
        k = kernel_class(s.kind)(s.spec, s.arch)
        params = kernel_params(k.entry_point(), k.ptr_types())
        out.append(KernelEntry(s.kind, s.name, s.spec, s.arch, f"{s.name}.cubin", 1, "0" * 64, s.name,
                               k.block, k.cluster, 0, k.grid or abi.GRID[s.kind],
                               tuple(Param(*p) for p in params), "k"))  # fmt: skip
    return out


def _case(m, nq, nkv, fmt, k, qk_norm=True):
    """flint_qkv_fused's arguments at hidden size k (CPU tensors)."""
    from loader.reference import make_cos_sin_cache

    n = (nq + 2 * nkv) * 128
    w, ws, gs = _nvfp4(n, k) if fmt == "nvfp4" else ((torch.randn(n, k) * 0.02).bfloat16(), None, None)
    kvc = torch.zeros(4, 2, 16, nkv, 128, dtype=torch.bfloat16)
    nw = torch.ones(128).bfloat16() if qk_norm else None
    return dict(x=torch.randn(m, k).bfloat16(), residual=torch.randn(m, k).bfloat16(),
                norm_weight=torch.ones(k).bfloat16(), eps=1e-6, weight=w, weight_scale=ws, global_scale=gs,
                q_norm_weight=nw, k_norm_weight=None if nw is None else nw.clone(), qk_eps=1e-6,
                cos_sin_cache=make_cos_sin_cache(64), positions=torch.arange(m), k_cache=kvc[:, 0],
                v_cache=kvc[:, 1], slot_mapping=torch.arange(m), num_q_heads=nq,
                num_kv_heads=nkv)  # fmt: skip


_HEAD = ("q_norm_weight", "k_norm_weight", "qk_eps", "cos_sin_cache", "positions", "k_cache", "v_cache",
         "slot_mapping", "num_q_heads", "num_kv_heads")  # fmt: skip


@needs_dsl
def test_the_ops_launch_the_kernels_of_xs_hidden_size_and_of_qk_norm(monkeypatch):
    """Against a bundle of hidden 1024 and 2048 and q/k norm on and off: each op launches the kernel of
    x.shape[1] (the norm with the xn layout of the qkv kernel it feeds, at that hidden size), the q/k norm
    weights None launch the kernels built without q/k norm (reading no weights: null pointers), tensors of
    them the ones with; a hidden size the bundle lacks is a LookupError naming what it has."""
    import loader

    dry = _DryRun(monkeypatch, _entries(AXES))
    for fmt in ("bf16", "nvfp4"):
        for m in (3, 12, 40):
            for qkn in (True, False):
                c = _case(m, 16, 8, fmt, 1024, qkn)
                dry.launched.clear()
                q, r = loader.flint_qkv_fused(**c)
                assert q.shape == (m, 16 * 128) and r.shape == (m, 1024)
                (norm, nv, _), (qkv, qv, _) = dry.launched
                tile = abi.m_tiles(m)[0]
                spec = abi.qkv_spec(fmt, True, 16, 8, "bf16", "separate", tile, 1024, qkn)
                assert norm.spec == abi.norm_spec(True, 1024) and qkv.spec == spec, (norm.name, qkv.name)
                assert (nv["xn_group"], nv["xn_row"], nv["xn_quarter"]) == abi.xn_strides(spec)
                assert nv["xn_pairs"] == abi.xn_pairs(spec) and qv["x"] == nv["xn"]
                if qkn:
                    assert qv["q_norm_weight"] == c["q_norm_weight"].data_ptr() != 0
                    assert qv["k_norm_weight"] == c["k_norm_weight"].data_ptr() != 0
                else:
                    assert qv["q_norm_weight"] == qv["k_norm_weight"] == 0
                    assert qkv.name.startswith(f"qkv_{fmt}_rope1_qkn0_h16x8_k1024")
    c = _case(2, 8, 1, "bf16", 2048, False)  # (the other head geometry: at hidden 2048 only)
    dry.launched.clear()
    loader.flint_qkv_fused(**c)
    assert [e.name for e, _, _ in dry.launched] == ["norm_res1", "qkv_bf16_rope1_qkn0_h8x1"]
    assert dry.launched[0][1]["xn_row"] == abi.tile8_row("bf16")

    for k, suffix in ((1024, "_k1024"), (2048, "")):
        x, w = torch.randn(2, k).bfloat16(), torch.ones(k).bfloat16()
        dry.launched.clear()
        loader.rms_norm(x, w, 1e-6)
        loader.fused_add_rms_norm(x, x.clone(), w, 1e-6)
        assert [e.name for e, _, _ in dry.launched] == [f"norm_res0{suffix}", f"norm_res1{suffix}"]
        strides = [(v["xn_group"], v["xn_row"], v["xn_quarter"]) for _, v, _ in dry.launched]
        assert strides == [abi.row_major(k)] * 2
        for fmt in ("bf16", "nvfp4"):
            w, ws, gs = _nvfp4(160, k) if fmt == "nvfp4" else (torch.randn(160, k).bfloat16(), None, None)
            dry.launched.clear()
            y = loader.gemv(torch.randn(20, k).bfloat16(), w, ws, gs)
            assert y.shape == (20, 160)
            assert [e.name for e, _, _ in dry.launched] == [f"gemv_{fmt}{suffix}_m32"]

    for qkn in (True, False):
        c = _case(5, 8, 1, "bf16", 1024, qkn)
        dry.launched.clear()
        q = loader.qk_norm_rope_cache(torch.randn(5, 10 * 128).bfloat16(), **{n: c[n] for n in _HEAD})
        ((e, v, _),) = dry.launched
        assert q.shape == (5, 8 * 128) and e.name == "qk_norm_rope_cache_rope1" + ("" if qkn else "_qkn0")
        assert (v["q_norm_weight"] == 0) is (not qkn) and (v["k_norm_weight"] == 0) is (not qkn)

    dry.launched.clear()
    have = (r"no norm kernel for hidden=1536, residual=False on sm_90a; it has: hidden=1024, residual=False; "
            r"hidden=1024, residual=True; hidden=2048, residual=False")  # fmt: skip
    with pytest.raises(LookupError, match=have):
        loader.rms_norm(torch.randn(2, 1536).bfloat16(), torch.ones(1536).bfloat16(), 1e-6)
    with pytest.raises(LookupError, match="no qkv kernel for .*hidden=2048"):  # (16 x 8 heads: at 1024 only)
        loader.flint_qkv_fused(**_case(2, 16, 8, "bf16", 2048))
    with pytest.raises(LookupError, match="no gemv kernel for hidden=1536"):
        loader.gemv(torch.randn(2, 1536).bfloat16(), torch.randn(16, 1536).bfloat16())
    assert not dry.launched


@needs_dsl
def test_hidden_sized_tensors_of_another_size_are_refused_naming_the_shape(monkeypatch):
    """At x = [M, 1024]: a residual, norm weight or weight of hidden 2048 is refused naming the shape of
    1024, before anything is launched."""
    import loader

    dry = _DryRun(monkeypatch, _entries(AXES))
    x = torch.randn(2, 1024).bfloat16()
    with pytest.raises(ValueError, match=r"^weight must have shape \[1024\], got \[2048\]$"):
        loader.rms_norm(x, torch.ones(2048).bfloat16(), 1e-6)
    with pytest.raises(ValueError, match=r"^residual must have shape \[2, 1024\], got \[2, 2048\]$"):
        loader.fused_add_rms_norm(x, torch.randn(2, 2048).bfloat16(), torch.ones(1024).bfloat16(), 1e-6)
    with pytest.raises(ValueError, match=r"^weight must have shape \[48, 1024\], got \[48, 2048\]$"):
        loader.gemv(x, torch.randn(48, 2048).bfloat16())
    c = _case(2, 16, 8, "bf16", 1024)
    for key, bad, want in (("norm_weight", torch.ones(2048).bfloat16(), r"norm_weight .*\[1024\]"),
                           ("residual", torch.randn(2, 2048).bfloat16(), r"residual .*\[2, 1024\]"),
                           ("weight", torch.randn(32 * 128, 2048).bfloat16(), r"weight .*\[4096, 1024\]")):
        with pytest.raises(ValueError, match=f"^{want}, got "):
            loader.flint_qkv_fused(**dict(c, **{key: bad}))
    assert not dry.launched


@needs_dsl
def test_a_hidden_size_no_bundle_can_hold_says_so(monkeypatch):
    """x of a width flint-aot cannot build kernels for (1025; 1000: not multiples of 512) whose tensors pass
    the shape checks (NVFP4 codes of 1025 // 2 bytes, 1025 // 16 scales): a LookupError saying no bundle has
    them and what is accepted, not the advice to add the size to the config; nothing launched. A hidden size
    that can be built but is missing (1536) keeps the bundle's list."""
    import loader
    from loader import nvfp4

    dry = _DryRun(monkeypatch, _entries(AXES))
    w = nvfp4.quantize((torch.randn(48, 1024) * 0.03).bfloat16())
    with pytest.raises(LookupError, match=r"^gemv: x has 1025 columns, a hidden size flint-aot cannot build "
                                          r"gemv kernels for \(accepted: a multiple of 512 in 1024\.\.2048"):
        loader.gemv(torch.randn(3, 1025).bfloat16(), *w)
    with pytest.raises(LookupError, match=r"^rms_norm: x has 1000 columns, .* norm kernels for"):
        loader.rms_norm(torch.randn(2, 1000).bfloat16(), torch.ones(1000).bfloat16(), 1e-6)
    with pytest.raises(LookupError, match=r"no gemv kernel for .*hidden=1536.*it has: .*hidden=1024"):
        loader.gemv(torch.randn(3, 1536).bfloat16(), torch.randn(48, 1536).bfloat16())
    assert not dry.launched


@needs_dsl
@pytest.mark.parametrize("none", ["q_norm_weight", "k_norm_weight"])
def test_the_qk_norm_weights_are_both_tensors_or_both_none(monkeypatch, none):
    """One q/k norm weight None and the other a tensor is a ValueError naming both, from the fused op and the
    per-head op, before anything is launched."""
    import loader

    dry = _DryRun(monkeypatch, _entries(AXES))
    want = (r"^q_norm_weight and k_norm_weight must both be tensors \(q/k norm\) or both None \(no q/k "
            r"norm\)$")  # fmt: skip
    c = dict(_case(2, 16, 8, "bf16", 1024), **{none: None})
    qkv = torch.randn(2, 32 * 128).bfloat16()
    for op in (loader.flint_qkv_fused, torch.ops.flint.qkv_fused):
        with pytest.raises(ValueError, match=want):
            op(**c)
    for op in (loader.qk_norm_rope_cache, torch.ops.flint.qk_norm_rope_cache):
        with pytest.raises(ValueError, match=want):
            op(qkv, **{n: c[n] for n in _HEAD})
    assert not dry.launched


def test_the_torch_ops_take_no_qk_norm_weights():
    """torch.ops.flint.qkv_fused and qk_norm_rope_cache declare the q/k norm weights optional (Tensor?), so
    that a call without q/k norm reaches the op (and its checks) under torch.compile too."""
    import loader  # noqa: F401 (registers torch.ops.flint)

    for op in (torch.ops.flint.qkv_fused, torch.ops.flint.qk_norm_rope_cache):
        args = {a.name: str(a.type) for a in op.default._schema.arguments}
        assert args["q_norm_weight"] == args["k_norm_weight"] == "Optional[Tensor]", args


def test_the_reference_without_qk_norm():
    """loader.reference.qk_norm_rope_ref with both norm weights None: q and k are the bf16-rounded heads
    (rotated when there is a table), v unchanged; with weights, normed; and the whole chain at hidden 1024."""
    from loader import reference as ref

    g = torch.Generator().manual_seed(0)
    m, nq, nkv = 3, 4, 2
    qkv = torch.randn(m, (nq + 2 * nkv) * 128, generator=g) * 3
    heads = qkv.bfloat16().double().reshape(m, nq + 2 * nkv, 128)
    pos = torch.tensor([0, 5, 63])
    q, k, v = ref.qk_norm_rope_ref(qkv, None, None, 1e-6, None, pos, nq, nkv)
    assert torch.equal(q, heads[:, :nq]) and torch.equal(k, heads[:, nq:nq + nkv])
    assert torch.equal(v, heads[:, nq + nkv:])
    ones = torch.ones(128).bfloat16()
    qn, kn, _ = ref.qk_norm_rope_ref(qkv, ones, ones, 1e-6, None, pos, nq, nkv)
    assert not torch.allclose(qn, q) and torch.allclose(qn.pow(2).mean(-1), torch.ones(m, nq).double())
    table = ref.make_cos_sin_cache(64)
    qr, kr, _ = ref.qk_norm_rope_ref(qkv, None, None, 1e-6, table, pos, nq, nkv)
    assert torch.equal(qr[0], q[0]) and not torch.allclose(qr[1:], q[1:])  # (position 0: no rotation)
    assert torch.allclose(qr.norm(dim=-1), q.norm(dim=-1))  # a rotation of each pair
    x, w = torch.randn(m, 1024, generator=g).bfloat16(), (1 + 0.1 * torch.randn(1024, generator=g)).bfloat16()
    dense = (torch.randn((nq + 2 * nkv) * 128, 1024, generator=g) * 0.03).bfloat16()
    out = ref.qkv_fused_ref(x, None, w, 1e-6, dense, None, None, 1e-6, None, pos, nq, nkv)
    xn = ref.rms_norm_ref(x, None, w, 1e-6)[0]
    assert out["xn"].shape == (m, 1024) and torch.equal(out["xn"], xn)
    want = ref.gemv_ref(xn, dense).bfloat16().double().reshape(m, -1, 128)
    assert torch.equal(out["q"], want[:, :nq]) and torch.equal(out["k"], want[:, nq:nq + nkv])
