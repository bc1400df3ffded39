"""The compiled schedules the design depends on (docs/kernels.md), read from the SASS (nvdisasm from the
nvidia-cuda-nvdisasm wheel), for every kernel kind and both architectures: weights issued before
griddepcontrol.wait (ACQBULK), activations after it, no local memory, at most 168 registers for the GEMV
kernels (3 CTAs of 128 threads per SM: one wave), and for the token stream shared memory that does not grow
with the tile."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import needs_dsl

pytestmark = needs_dsl


def _nvdisasm():
    try:
        import nvidia.cu13  # noqa: F401  (namespace package of the wheel)

        for base in nvidia.cu13.__path__:
            p = Path(base) / "bin" / "nvdisasm"
            if p.exists():
                return str(p)
    except ImportError:
        pass
    return shutil.which("nvdisasm")


def _sass(cubin: bytes, tmp_path) -> list[str]:
    tool = _nvdisasm()
    if tool is None:  # (CI installs it with the dev extra: there its absence is a failure, not a skip)
        (pytest.fail if os.environ.get("CI") else pytest.skip)("nvdisasm not found (pip install "
                                                               "nvidia-cuda-nvdisasm)")  # fmt: skip
    f = tmp_path / "k.cubin"
    f.write_bytes(cubin)
    out = subprocess.run([tool, "-c", str(f)], capture_output=True, text=True, check=True).stdout
    return [ln.split(";")[0].strip() for ln in out.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]


def _split(sass, expect=1):
    """(before, after) the first griddepcontrol.wait (ACQBULK). The qkv kernel has two: the threads that copy
    the activations (the prologue design: all, for the input norm's slices) wait for the predecessor
    themselves, the whole CTA after its weights (the guarded wait)."""
    waits = [i for i, ln in enumerate(sass) if "ACQBULK" in ln]
    assert len(waits) == expect, f"expected {expect} griddepcontrol.wait (ACQBULK), got {len(waits)}"
    return sass[: waits[0]], sass[waits[0] + 1 :]


def _compile(kind, spec, arch):
    from flint_aot.kernels import kernel_class
    from loader.elf import read_cubin

    c = kernel_class(kind)(spec, arch).compile(arch, "flint_t")
    (k,) = read_cubin(c.cubin).kernels.values()
    return c, k.registers


def _group_loop(sass, after):
    """The SASS of the token stream's group loop: from its first MMA to its first send of partial sums."""
    loop = sass[sass.index(next(ln for ln in after if "HMMA" in ln)):]
    return loop[: next(i for i, ln in enumerate(loop) if "STAS.64" in ln)]


def _no_spills(sass):
    assert not any(re.search(r"\b(STL|LDL)\b", ln) for ln in sass), "local memory (spills)"


def _static_smem(cubin: bytes) -> int:
    """Bytes of the kernel's static shared memory (its .nv.shared.<entry> section)."""
    from loader.elf import _sections

    secs, strndx = _sections(cubin)
    names = secs[strndx]
    name = lambda sec: cubin[names.offset + sec.name_off :].split(b"\0", 1)[0]  # noqa: E731
    return sum(sec.size for sec in secs if name(sec).startswith(b".nv.shared."))


def _spec(kind, fmt, kv, norm, tile):
    from loader import abi

    return abi.qkv_spec(fmt, True, 16, 2, kv, norm, tile) if kind == "qkv" else abi.gemv_spec(fmt, tile)


# (the two-kernel design's kernels of 32 and 64 tokens: test_the_32_and_64_token_kernels_use_wgmma_passes)
GEMV_CASES = [("qkv", fmt, kv, norm, tile) for fmt in ("bf16", "nvfp4") for norm in ("separate", "prologue")
              for kv in ("bf16", "fp8_e4m3") for tile in (8, 16, 32, 64)
              if (kv == "bf16" or norm == "prologue") and not (norm == "separate" and tile > 16)] + [
    ("gemv", fmt, None, None, tile) for fmt in ("bf16", "nvfp4") for tile in (8, 16, 32, 64)]  # fmt: skip


# every case on sm_90a (the GPUs we run on); on sm_100a (built, never run here) one per kind, format and tile
ARCH_CASES = [(*c, "sm_90a") for c in GEMV_CASES] + [
    (*c, "sm_100a") for c in GEMV_CASES if c[2] in (None, "bf16") and c[3] in (None, "separate")
]


@pytest.mark.parametrize("kind,fmt,kv,norm,tile,arch", ARCH_CASES)
def test_gemv_schedules(tmp_path, kind, fmt, kv, norm, tile, arch):
    """Tile 8 (the 8-token kernels: x of all K in shared memory, warps = K quarters) and the token stream
    (tiles 16 and 64: a CTA per K quarter of 64 rows, x one group of 8 tokens at a time by bulk copies)."""
    c, regs = _compile(kind, _spec(kind, fmt, kv, norm, tile), arch)
    sass = _sass(c.cubin, tmp_path)
    before, after = _split(sass, 2 if kind == "qkv" or tile > 8 else 1)
    weights = [ln for ln in sass if re.search(r"\bLDG\..*CONSTANT", ln)]
    assert all(ln in before for ln in weights) and not any("CONSTANT" in ln for ln in after)
    assert len(weights) == (32 if fmt == "bf16" else 16)  # 16 B each (BF16); 8 x 16 B codes + 8 x 4 B scales
    x_loads = [ln for ln in sass if re.search(r"\bLDG\.E\.128\b", ln) and "CONSTANT" not in ln]
    bulk = [ln for ln in sass if "UBLKCP" in ln]
    # one group's MMAs: the 8-token kernels' (straight-line), the stream's loop body (a loop at run time)
    assert sum(bool(re.search(r"\bHMMA\.16816\.F32\.BF16\b", ln)) for ln in after) == 32
    if kind == "qkv" or tile > 8:  # x fragments from shared memory
        assert sum(bool(re.search(r"\bLDS\.128\b", ln)) for ln in after) >= 16
    if tile > 8:  # the token stream: each group's partial sums to their owners, 2 x 8 bytes per thread
        assert sum(bool(re.search(r"\bSTAS\.64\b", ln)) for ln in after) >= 2
        if norm != "prologue":  # bulk copies of the groups' K quarters (and RoPE coefficients), after the
            # copier's own wait; no x from global memory
            assert len(bulk) >= 2 and all(ln in after for ln in bulk) and not x_loads
            assert not any("MULTICAST" in ln for ln in bulk)
        else:  # x and the residual read twice per token (the sums, then the group's normalisation)
            assert x_loads and all(ln in after for ln in x_loads)
    elif norm == "separate":  # xn read once per cluster: one multicast bulk copy, after the copier's own wait
        assert len(bulk) == 1 and "MULTICAST" in bulk[0] and bulk[0] in after and not x_loads
    elif norm == "prologue":  # each CTA reads its slice of x and the residual (4 warps x 2 tokens, with and
        # without a residual: 2 + 1 loads each) and its norm weight (2 chunks), all after the wait; the slices
        # go to the peers by st.async (7 x 16 B of r and one 4-byte sum per token, in both branches)
        assert not bulk and len(x_loads) == 2 + 2 * 3 and all(ln in after for ln in x_loads)
        assert sum(bool(re.search(r"\bSTAS\.128\b", ln)) for ln in after) == 2 * 2 * 7
    else:  # the 8-token standalone GEMV: x from global memory after the wait
        assert len(x_loads) == 16 and all(ln in after for ln in x_loads), "x must be read after the wait"
    assert not any(re.search(r"\bLDG\.E\.64\b", ln) for ln in before), "positions / slots after the wait"
    if fmt == "nvfp4":  # the e2m1 decode (8 HMUL2 a code word) of 12 (8-token qkv) / 8 (8-token gemv) of each
        # row's 16 words before the wait; the stream decodes all 16 once, at least its 12 before the wait
        decoded = sum("HMUL2" in ln for ln in before)
        if tile == 8:
            assert decoded == (64 if kind == "gemv" else 96)
        else:
            assert 96 <= decoded <= 128
    _no_spills(sass)
    # every warp provably converged at its shuffles: a shuffle given a collective fallback is the sign that
    # ptxas lost track (a ring refilled without a CTA barrier and no warp barrier after the copying
    # threads' branch: 168 registers and NVFP4 up to 1.2 us slower, docs/kernels.md §2.5)
    assert not any("WARPSYNC.COLLECTIVE" in ln for ln in sass)
    if tile > 16 and norm is None:  # the standalone GEMV's ring refills after a CTA barrier, in the loop
        loop = _group_loop(sass, after)
        assert any(re.search(r"\bBAR\.SYNC\b", ln) for ln in loop) and any("UBLKCP" in ln for ln in loop)
    # one wave (3 CTAs of 128 threads per SM) needs <= 168 registers; the standalone 8-token BF16 GEMV
    # compiles to 172 on sm_100a (2 CTAs per SM there; not run: no Blackwell GPU)
    assert regs <= (176 if (kind, fmt, tile, arch) == ("gemv", "bf16", 8, "sm_100a") else 168), regs


@pytest.mark.parametrize("kind,fmt,norm", [("qkv", "bf16", "prologue"), ("qkv", "nvfp4", "prologue"),
                                           ("gemv", "bf16", None)])  # fmt: skip
def test_stream_shared_memory_does_not_follow_m(kind, fmt, norm):
    """The token stream's x ring (dynamic shared memory, stages of 8 tokens' K quarter) has a fixed number of
    stages whatever M: 3 at 64 tokens, 2 in the prologue design (the two-kernel design's 32- and 64-token
    kernels: a ring of 4 wgmma stages, test_the_32_and_64_token_kernels_use_wgmma_passes). What grows with
    the tile is the owner's per-group buffers (partial sums, the exchange, slots and positions, the
    prologue's sums of squares), at most 3.6 KB per group of 8 tokens. And three CTAs of the 32- and 64-token
    kernels fit the 164 KB carveout (1 KB reserved per CTA), which leaves 92 KB of the SM's 256 KB to L1: the
    weight loads in flight pass through it (a 64-token kernel whose three CTAs took the 228 KB carveout got
    its weights 2 us later and cost 2.4 us more per layer: docs/kernels.md §2.5)."""
    from flint_aot.kernels.stream_gemv import GROUP
    from loader import abi

    sizes = []
    for tile in (32, 64):
        c, _ = _compile(kind, _spec(kind, fmt, "bf16", norm, tile), "sm_90a")
        sizes.append((_static_smem(c.cubin), c.dyn_smem))
    (s32, d32), (s64, d64) = sizes
    stage = GROUP * abi.stream_row(fmt) * 2
    stages = 2 if norm == "prologue" else 3
    assert d32 == stages * stage and d64 == stages * stage, sizes
    assert 0 <= s64 - s32 <= 4 * 3712 and s32 + d32 <= s64 + d64, sizes
    for s, d in sizes:
        assert 3 * (s + d + 1024) <= 164 * 1024, sizes


@pytest.mark.parametrize("tile", [32, 64])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_32_and_64_token_kernels_use_wgmma_passes(tmp_path, arch, fmt, tile):
    """The two-kernel design's 32- and 64-token kernels (docs/kernels.md §2.6) on sm_90a: weights before the
    wait, x by bulk copies after it; group 0 by mma.sync (x by ldmatrix from the wgmma tiles), groups 1-3 in
    one pass of 32 wgmma (16 steps x 2 chains, N = 24) that ptxas does not serialize (one arrive, one wait;
    it waits after every wgmma when the registers do not suffice), those of the words past the kernel's
    wg_reg with A from shared memory; at 64 tokens a second such four (group 4, then a pass); the other
    paths by mma.sync; CTA barriers of its own for A's park and the 64-token kernels' refills, no
    collective shuffles; within 168 registers, no spills; a ring of 4
    stages and A's parked words, shared memory that does not depend on M, three CTAs within the 196 KB
    carveout. sm_100a has no wgmma: the same layout, every group by mma.sync (built, not run here), its
    64-token ring refilled on "read" mbarriers (only there: sm_90a's kernels initialise none)."""
    from flint_aot.kernels.stream_gemv import WG_REG
    from flint_aot.kernels.wgmma import WG_CORE
    from loader import abi

    spec = abi.qkv_spec(fmt, True, 16, 2, "bf16", "separate", tile)
    assert abi.wgmma_stream(spec) and abi.xn_strides(spec) == abi.WG_STRIDES
    assert abi.xn_pairs(spec) == (2 if fmt == "nvfp4" else 3)
    c, regs = _compile("qkv", spec, arch)
    sass = _sass(c.cubin, tmp_path)
    before, after = _split(sass, 2)
    weights = [ln for ln in sass if re.search(r"\bLDG\..*CONSTANT", ln)]
    assert len(weights) == (16 if fmt == "nvfp4" else 32) and all(ln in before for ln in weights)
    bulk = [ln for ln in sass if "UBLKCP" in ln]
    assert bulk and all(ln in after for ln in bulk)
    assert not [ln for ln in sass if re.search(r"\bLDG\.E\.128\b", ln) and "CONSTANT" not in ln]
    count = lambda pat: sum(bool(re.search(pat, ln)) for ln in after)  # noqa: E731
    wgmma = count(r"\bHGMMA\.")
    passes = tile // 32
    if arch == "sm_90a":
        in_regs = 2 * WG_REG[tile]  # (2 chains a word)
        assert wgmma == 32 * passes and count(r"\bHGMMA\.\S+ R\d+, R\d+, gdesc") == in_regs * passes
        assert count(r"WARPGROUP\.ARRIVE") == passes and count(r"WARPGROUP\.DEPBAR") == passes, "serialized"
        # group 0 (and group 4), the loop of fewer groups (and of the groups after a pass at 64 tokens)
        assert count(r"\bHMMA\.16816\.F32\.BF16\b") == 2 * passes * 32
        # CTA barriers: the cluster wait's (ptxas lowers barrier.cluster.wait with one) and A's park; at 64
        # tokens one before the refill of stage 0 (BF16: the park's) and one before those of stages 1-3
        assert count(r"\bBAR\.SYNC\b") == 2 + (tile == 64) * (2 if fmt == "nvfp4" else 1)
    else:
        assert wgmma == 0 and count(r"\bHMMA\.16816\.F32\.BF16\b") >= 32
        if tile == 64:  # a stage refilled on its "read" mbarrier, with no CTA barrier in the group loop
            loop = _group_loop(sass, after)
            assert not any(re.search(r"\bBAR\.SYNC\b", ln) for ln in loop)
            assert any("UBLKCP" in ln for ln in loop)
    # mbarriers initialised: a stage's "in" one (4), and at 64 tokens on sm_100a its "read" one (4); one per
    # group's partial sums; the slots' staging and the cos|sin rows
    reads = 4 if (arch, tile) == ("sm_100a", 64) else 0
    assert sum("SYNCS.EXCH.64" in ln for ln in before) == 4 + reads + tile // 8 + 2
    assert count(r"\bLDSM\.") >= 16
    # no collective path for the shuffles (refills on "read" mbarriers in the fours gave sm_90a's 64-token
    # kernels one: 0.2-0.5 us a layer slower, docs/kernels.md §2.6)
    assert not any("WARPSYNC.COLLECTIVE" in ln for ln in sass)
    _no_spills(sass)
    assert regs <= 168, regs
    stage = 8 * abi.K_QUARTER * 2
    assert c.dyn_smem == 4 * stage + 8 * (16 - WG_REG[tile]) * 4 * WG_CORE
    assert 3 * (_static_smem(c.cubin) + c.dyn_smem + 1024) <= 196 * 1024


def test_the_stream_asks_for_load_balanced_clusters():
    """The token stream's kernels are launched with the load-balancing cluster policy (docs/kernels.md §2.5),
    the 8-token kernels with the driver's default, for which they were measured faster."""
    from flint_aot.kernels import kernel_class

    for fmt in ("bf16", "nvfp4"):
        for tile in (8, 16, 32, 64):
            k = kernel_class("qkv")(_spec("qkv", fmt, "bf16", "separate", tile), "sm_90a")
            assert k.cluster_policy == ("load_balancing" if tile > 8 else ""), (fmt, tile)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_norm_schedule(tmp_path, arch):
    c, _ = _compile("norm", {"residual": True}, arch)
    sass = _sass(c.cubin, tmp_path)
    before, after = _split(sass)
    assert any("PREEXIT" in ln for ln in before), "launch_dependents must come first"
    assert sum(bool(re.search(r"\bLDG\.E\.128\b", ln)) for ln in after) == 2  # x and the residual
    assert sum(bool(re.search(r"\bLDG\b", ln)) for ln in before) == 1  # the norm weight only
    _no_spills(sass)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_qk_norm_rope_cache_schedule(tmp_path, kv, arch):
    from loader import abi

    c, _ = _compile("qk_norm_rope_cache", abi.qk_norm_rope_cache_spec(True, kv), arch)
    sass = _sass(c.cubin, tmp_path)
    before, after = _split(sass)
    assert any("PREEXIT" in ln for ln in before), "launch_dependents must come first"
    loads_before = [ln for ln in before if re.search(r"\bLDG\b", ln)]
    # the q and k norm weights of this lane's 8 dims and of their RoPE partners: 4 loads of 16 bytes, and no
    # other load before the wait
    assert len(loads_before) == 4 and all("LDG.E.128" in ln for ln in loads_before), loads_before
    assert any(re.search(r"\bLDG\.E\.64\b", ln) for ln in after), "positions / slots after the wait"
    # a half-warp per token of QKNRC_HEADS heads: qkv in 16-byte loads (one a head), q in 16-byte stores, each
    # head's sum in the lane and 9 shuffles (lane ^ 1, then the 8 blocks' sums)
    heads = abi.QKNRC_HEADS
    assert sum("LDG.E.128" in ln for ln in after) >= heads and any("STG.E.128" in ln for ln in after)
    assert sum("SHFL.IDX" in ln for ln in after) == heads * 8
    if kv == "fp8_e4m3":  # e4m3 conversion with saturation, one byte per cache element
        assert any("F2FP" in ln and "E4M3" in ln for ln in after) and any(re.search(r"\bSTG\.E\.U8\b", ln)
                                                                         for ln in after)  # fmt: skip
    _no_spills(sass)
