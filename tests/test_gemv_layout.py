"""The GEMV's x fragments in shared memory are read without bank conflicts (docs/kernels.md §2.2, step 7): for
every MMA step, each phase of a 16-byte shared load (8 consecutive lanes: g = 0, 1 and t = 0..3 of lanes
4 g + t) must touch 8 different 16-byte bank groups, for both weight formats and both x layouts (the 8-token
kernels' whole rows, smem_row; the token stream's quarter rows, stream_row). The offsets are the kernel's own
functions (gemv_core.bf16_x_k / fp4_x_k); an NVFP4 order without the t & 2 swap fails here."""

import pytest

from tests.conftest import needs_dsl

pytestmark = needs_dsl


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
def test_x_fragment_reads_are_conflict_free(fp4, layout):
    from flint_aot.kernels import gemv_core as core

    row = core.smem_row(fp4) if layout == "tile8" else core.stream_row(fp4)
    offset = core.fp4_x_k if fp4 else core.bf16_x_k
    steps = core.FP4_WORDS if fp4 else core.NB
    for step in range(steps):
        for g0, groups in _phase_groups(offset, row, step).items():
            assert len(set(groups)) == 8, (layout, "step", step, "lanes of g", g0, g0 + 1, groups)


def test_the_rule_catches_the_unswapped_nvfp4_order():
    """The same rule on the order before the swap (word u at step u for every lane): 2-way conflicts."""
    from flint_aot.kernels import gemv_core as core

    def unswapped(t, i):
        return t * 32 + 128 * (i // 4) + 8 * (i % 4)

    groups = _phase_groups(unswapped, core.stream_row(True), 0)[0]
    assert len(set(groups)) == 4, groups


def test_each_lane_reads_every_word_once():
    """The swap is a permutation of a lane's steps: over its 16 steps, lane t reads each of its 16 words once,
    and the words are those of its chunks 4 c + t (32 k each)."""
    from flint_aot.kernels import gemv_core as core

    for t in range(4):
        ks = sorted(core.fp4_x_k(t, i) for i in range(core.FP4_WORDS))
        want = sorted(128 * c + 32 * t + 8 * u for c in range(4) for u in range(4))
        assert ks == want, t
