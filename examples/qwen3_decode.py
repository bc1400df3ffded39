"""A Qwen3 causal LM (Qwen3-1.7B shape by default; --model qwen3-0.6b, qwen3-8b or llama-3.1-8b, random
weights) decoding greedily through `loader.flint_qkv_fused`.

Every decoder layer's attention input -- input RMSNorm (fused residual add), the qkv projection, the q/k
RMSNorm, NeoX RoPE and the write of k and v into a paged KV cache -- is one call of the op; attention over the
paged cache, o_proj, the post-attention norm and the MLP run in torch with the Hugging Face model's own
modules. The result is compared with the model's own forward (Hugging Face `transformers`, its own KV cache):

  (a) teacher-forced: both sides are fed the reference's greedy tokens; per decode step the relative logit
      error max|ours - ref| / max|ref|, its maximum over the steps against a bound measured in the same run
      (twice the distance of the model's own bf16 forward from the same model in fp32), and top-1
      agreement (which must hold at every step whose reference top-1 margin exceeds twice the allowed
      absolute error -- a smaller margin is a near-tie that the allowed error can flip);
  (b) free-running greedy: the first step where our token differs from the reference's, with the
      reference's top-1 margin there (which must be a near-tie in the same sense).

With `--batch N`, N further sequences (prompts of different lengths) decode together: one op call of M = N
tokens per layer and step, each token at its own position and slots in its own block table, each sequence's
teacher-forced logits held to the bound against the model's own forward of that sequence alone.

The whole decode step is also captured in a CUDA graph (shape-static attention over a fixed maximum context
with masking; token, position and slot in device buffers filled before each replay); its teacher-forced
logits are held to the same bound, and a small table gives the per-token latency of the model's own eager
decode, ours eager and ours under graph replay.

    python examples/qwen3_decode.py                                # 28 layers, BF16 weights, BF16 cache
    python examples/qwen3_decode.py --weights nvfp4 --kv-cache fp8
    python examples/qwen3_decode.py --backend reference --tiny     # pure torch, runs on CPU
    python examples/qwen3_decode.py --model qwen3-0.6b --bundle build/qwen3-0.6b    # hidden 1024
    python examples/qwen3_decode.py --model llama-3.1-8b --backend reference --tiny  # no q/k norm
    python examples/qwen3_decode.py --batch 64                     # and 64 sequences decoding together

`--backend reference` swaps the op for a torch implementation of the same numerics (docs/numerics.md, built
from `loader.reference`), so the whole loop and its checks run without a GPU; `--tiny` shrinks vocabulary,
MLP width and layer count but keeps the model's hidden size, heads and head dim 128. The loader backend needs
a bundle holding the model's variant: hidden 4096 (Qwen3-8B, Llama-3.1-8B) has no fused kernels in this
version (their layers exceed one wave of weights in registers), so those two run with --backend reference.
Exit status 1 when a bound fails. Needs `transformers` (5.x), nothing is downloaded.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from loader.abi import MAX_M  # tokens per op call (the op's limit); the prefill runs in chunks of this size

# The model shapes (official configs; head dim 128, random weights). --model picks one; its sizes set these
# module constants for the run. Llama has no per-head q/k norm (the op is called with both norm weights
# None, kernels built with qk_norm: false); its RoPE scaling would live in the caller's cos/sin table, so
# the example uses plain NeoX RoPE at its theta.
MODELS = {
    "qwen3-1.7b": dict(arch="qwen3", hidden=2048, heads=(16, 8), layers=28, mlp=6144, vocab=151936,
                       theta=1e6),
    "qwen3-0.6b": dict(arch="qwen3", hidden=1024, heads=(16, 8), layers=28, mlp=3072, vocab=151936,
                       theta=1e6),
    "qwen3-8b": dict(arch="qwen3", hidden=4096, heads=(32, 8), layers=36, mlp=12288, vocab=151936, theta=1e6),
    "llama-3.1-8b": dict(arch="llama", hidden=4096, heads=(32, 8), layers=32, mlp=14336, vocab=128256,
                         theta=5e5),
}  # fmt: skip
HIDDEN, HEAD_DIM, NUM_Q_HEADS, NUM_KV_HEADS = 2048, 128, 16, 8  # (the default model's; set by use_model)


def use_model(name: str) -> dict:
    """Set the module's sizes to model `name`'s and return its entry of MODELS."""
    global HIDDEN, NUM_Q_HEADS, NUM_KV_HEADS
    m = MODELS[name]
    HIDDEN, (NUM_Q_HEADS, NUM_KV_HEADS) = m["hidden"], m["heads"]
    return m
BLOCK_SIZE = 16  # paged KV cache: tokens per block
E4M3_MAX = 448.0

# Acceptance. The error metric, per decode step: max_v |ours - ref| / max_v |ref| over the step's fp32
# logits. Its bound is measured in the same run, per mode, instead of being a constant:
#     bound = BOUND_FACTOR x floor,  floor = the same metric between the model's own bf16 forward (the
#     reference) and the same model -- same weights, same cache format -- computed in fp32.
# Why: the op is bf16 in / out with fp32 accumulation and does the q/k norm and RoPE in fp32 with one
# rounding, while the model's eager path rounds q and k to bf16 after the norm and after the RoPE products
# (with cos/sin rounded to bf16): q and k differ by about one bf16 ulp in many elements, neither being the
# more exact. This random model amplifies any such difference: after 28 layers even a one-ulp change in a
# few elements (the static step's attention, summed over the masked fixed context, against the eager one)
# moves the logits by 1.5-1.9 % of max|logit|, and the model's own bf16 forward lands 3.5-4.4 % from fp32.
# Two computations each as exact as bf16 allows differ by up to about sqrt(2) x their distance from exact;
# the factor 2 leaves room over that. A defect moves the logits far more: planted in the pure-torch op (2
# layers, floor 1.2 %), q/k norm weights swapped gave 20 %, the input norm weight ignored 51 %, RoPE theta
# 1e4 62 %, k and v swapped 160 %, the cache written with twice the FP8 scale 79 %. (A RoPE position
# offset shared by q and k is invisible by construction: attention sees only relative positions.)
# Measured on CPU with the pure-torch op (seed 0, 28 layers, full vocabulary), ours vs the model / the floor
# / ours vs fp32: BF16 cache 4.6 / 4.4 / 3.7 %, NVFP4 weights 4.7 / 4.3 / 4.1 %, FP8 cache 8.1 / 10.1 / 9.3 %.
# * NVFP4 weights: the reference computes with the dequantized weights rounded to bf16 (<= 2^-9 relative
#   each) while the kernel uses the exact e2m1 x e4m3 x global-scale products: one more rounding of that
#   order, averaged over 2048-term dot products; the same factor, the floor measured with those weights.
# * FP8 KV cache: the reference is the model's own forward over a cache that stores e4m3 values with the same
#   scales (reference_cache), so the bound judges the op, not the format: e4m3 keeps 3 mantissa bits, and
#   where our k and the model's differ by a bf16 ulp the e4m3 rounding can differ by a whole e4m3 step (the
#   floor includes that: fp32 k rounds differently too). The format's own cost is reported against the model
#   with its BF16 cache, under a fixed, loose bound (measured 5.6 % at 2 layers, 15 % at 28) that only
#   catches a gross FP8 defect.
BOUND_FACTOR = 2.0
FP8_VS_BF16_BOUND = 0.3
# FP8 scale = FP8_HEADROOM * amax / 448, amax per layer from the calibration prefill. k is RMS-normalized per
# head before RoPE (a rotation), and v is a linear map of an RMS-normalized input, so their ranges hardly
# move between the prompt and later tokens; a 2x headroom still keeps a decode token slightly above the
# prompt's amax from saturating at +-448, and costs nothing measurable: e4m3's relative precision is the
# same over its normal range (2^-6 .. 448), so halving the scale's use of that range only pushes values below
# amax * 2^-14 into subnormals.
FP8_HEADROOM = 2.0


# ----------------------------------------------------------------------------------------------- the model
def build_model(args, device):
    """The --model's causal LM (Qwen3ForCausalLM, or LlamaForCausalLM) at its shape (or --tiny) with random
    bf16 weights, seeded, on device."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    spec = MODELS[args.model]
    common = dict(
        vocab_size=4096 if args.tiny else spec["vocab"],
        hidden_size=HIDDEN,
        intermediate_size=1024 if args.tiny else spec["mlp"],
        num_hidden_layers=args.layers,
        num_attention_heads=NUM_Q_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        hidden_act="silu",
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": spec["theta"]},
        tie_word_embeddings=True,
        initializer_range=0.02,  # the HF default: hidden std ~1 after each norm, logits std ~0.9
        attention_bias=False,
    )
    if spec["arch"] == "llama":
        cfg = LlamaConfig(**common, mlp_bias=False)
    else:
        cfg = Qwen3Config(**common, use_sliding_window=False)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    # HF initializes every RMSNorm weight to 1, which would hide a kernel that ignores (or swaps) the input
    # norm, q_norm or k_norm weight: give them seeded values around 1, as a trained checkpoint has.
    g = torch.Generator(device=device).manual_seed(args.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g, device=device))
    return model


def check_model(model):
    """The op is built for these sizes and for default (unscaled) NeoX RoPE: refuse anything else."""
    c = model.config
    rope = c.rope_parameters
    got = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, rope.get("rope_type"))
    want = (HIDDEN, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, "default")
    if got != want or model.model.rotary_emb.attention_scaling != 1.0:
        raise ValueError(f"model (hidden, q heads, kv heads, head dim, rope type) = {got}; this example "
                         f"needs {want} with attention_scaling 1")  # fmt: skip


def qkv_weights(model, fmt: str) -> list[dict]:
    """Per layer, the op's weight arguments: q_proj, k_proj, v_proj rows concatenated as [q; k; v].

    For NVFP4 the concatenation is quantized with loader.nvfp4.quantize, and the dequantized values (rounded
    to bf16) are copied back into q_proj/k_proj/v_proj, so that the model's own forward -- the reference --
    computes with the same weights as the kernel."""
    from loader import nvfp4

    out = []
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous()
            if fmt == "bf16":
                out.append({"weight": w, "weight_scale": None, "global_scale": None})
                continue
            packed, scales, gs = nvfp4.quantize(w)
            dq = nvfp4.dequantize(packed, scales, gs, dtype=torch.float32).bfloat16()
            nq, nk = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0]
            a.q_proj.weight.copy_(dq[:nq])
            a.k_proj.weight.copy_(dq[nq : nq + nk])
            a.v_proj.weight.copy_(dq[nq + nk :])
            out.append({"weight": packed, "weight_scale": scales, "global_scale": gs})
    return out


# ----------------------------------------------------------------------------- the op's torch reference
class TorchQKVFused:
    """Pure-torch stand-in for loader.flint_qkv_fused with the op's numerics (docs/numerics.md §1-4):
    bf16 input norm with the fused residual add, GEMV with fp32 accumulation and one bf16 rounding, per-head
    q/k RMSNorm and NeoX RoPE in fp32 with one rounding, k/v written (bf16, or e4m3 with the per-tensor
    scales) at slot_mapping; negative slots are not written. CPU or CUDA; graph-capturable. NVFP4 weights
    are dequantized to fp32 once per weight tensor and kept."""

    def __init__(self):
        self._dense: dict[tuple[int, tuple], torch.Tensor] = {}

    def _weight(self, weight, weight_scale, global_scale):
        if weight.dtype == torch.bfloat16:
            return weight
        from loader import nvfp4

        key = (weight.data_ptr(), tuple(weight.shape))
        if key not in self._dense:
            self._dense[key] = nvfp4.dequantize(weight, weight_scale, global_scale, dtype=torch.float32)
        return self._dense[key]

    def __call__(self, x, residual, norm_weight, eps, weight, weight_scale, global_scale, q_norm_weight,
                 k_norm_weight, qk_eps, cos_sin_cache, positions, k_cache, v_cache, slot_mapping,
                 num_q_heads, num_kv_heads, *, k_scale=None, v_scale=None):  # fmt: skip
        from loader.reference import fp8_cache_value, qk_norm_rope_ref, rms_norm_ref

        xn, residual_out = rms_norm_ref(x, residual, norm_weight, eps)
        w = self._weight(weight, weight_scale, global_scale)
        qkv = torch.nn.functional.linear(xn.to(w.dtype), w).bfloat16()
        q, k, v = qk_norm_rope_ref(qkv, q_norm_weight, k_norm_weight, qk_eps, cos_sin_cache, positions,
                                   num_q_heads, num_kv_heads, dtype=torch.float32)  # fmt: skip
        s = slot_mapping.shape[0]
        idx = slot_mapping
        keep = None
        if idx.device.type == "cpu" or not torch.cuda.is_current_stream_capturing():
            keep = idx >= 0  # negative slots are not written (a host sync: not while capturing a graph,
            idx = idx[keep]  # where the example's slots, all >= 0, go straight through)
        for cache, val, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
            val = val[:s].bfloat16()
            if cache.dtype != torch.bfloat16:
                val = fp8_cache_value(val, scale)
            if keep is not None:
                val = val[keep]
            flat = cache.view(-1, num_kv_heads, HEAD_DIM).view(torch.uint8)  # (index ops on e4m3 vary)
            flat.index_copy_(0, idx, val.view(torch.uint8))
        return q.bfloat16().reshape(x.shape[0], num_q_heads * HEAD_DIM), residual_out


# --------------------------------------------------------------------------------------- paged KV cache
class PagedKV:
    """Per layer k and v caches [num_blocks, 16, 8, 128] (bf16, or float8_e4m3fn with fp32 scales of one
    element) for `seqs` sequences of up to `capacity` tokens each. Each sequence's block table is a seeded
    random choice among twice as many physical blocks, disjoint from the others', so slots are not simply
    the positions."""

    def __init__(self, num_layers, capacity, device, fp8_scales=None, seed=0, seqs=1):
        self.blocks = -(-capacity // BLOCK_SIZE)
        num_blocks = 2 * self.blocks * seqs + 1
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_blocks, generator=g)
        tables = [perm[s * self.blocks : (s + 1) * self.blocks] for s in range(seqs)]
        self.tables_host = [t.tolist() for t in tables]
        self.tables = [t.to(device) for t in tables]  # device block tables, read by the attention (and graph)
        self.table_host, self.table = self.tables_host[0], self.tables[0]
        self.max_ctx = self.blocks * BLOCK_SIZE
        dtype = torch.float8_e4m3fn if fp8_scales is not None else torch.bfloat16
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        # Zero-filled: the graph's attention reads every block of the table, masked, and a masked slot must
        # hold a finite value (0 x NaN is NaN). Allocated, zeroed and gathered as bytes, since indexing and
        # fill kernels cover uint8 on every device and torch version, float8 not necessarily.
        nbytes = HEAD_DIM * (2 if dtype == torch.bfloat16 else 1)

        def alloc():
            return torch.zeros((*shape[:-1], nbytes), dtype=torch.uint8, device=device).view(dtype)

        self.k = [alloc() for _ in range(num_layers)]
        self.v = [alloc() for _ in range(num_layers)]
        self.scales = fp8_scales  # list of (k_scale, v_scale) per layer, or None

    def reset(self):
        for c in self.k + self.v:
            c.view(torch.uint8).zero_()

    def slot(self, pos: int, seq: int = 0) -> int:
        return self.tables_host[seq][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    def kv_kwargs(self, i):
        if self.scales is None:
            return {}
        return {"k_scale": self.scales[i][0], "v_scale": self.scales[i][1]}

    def gather(self, i, ctx: int | None, seq: int = 0):
        """Layer i's keys and values [T, 8, 128] in fp32 for the first ceil(ctx/16) blocks of sequence seq's
        table (T = ctx), or all of them (T = max_ctx) when ctx is None -- the graph's fixed shape."""
        table = self.tables[seq] if ctx is None else self.tables[seq][: -(-ctx // BLOCK_SIZE)]
        out = []
        for cache, j in ((self.k[i], 0), (self.v[i], 1)):
            t = cache.view(torch.uint8)[table].view(cache.dtype).reshape(-1, NUM_KV_HEADS, HEAD_DIM).float()
            if ctx is not None:
                t = t[:ctx]
            if self.scales is not None:
                t = t * self.scales[i][j]
            out.append(t)
        return out


# -------------------------------------------------------------------------------------- our decode loop
class FlintDecoder:
    """The decoder loop over model.model.layers with the attention input done by `op`."""

    def __init__(self, model, op, weights, cache: PagedKV, cos_sin):
        self.model, self.op, self.cache, self.cos_sin = model, op, cache, cos_sin
        self.scaling = model.model.layers[0].self_attn.scaling
        self.layers = []
        for layer, w in zip(model.model.layers, weights, strict=True):
            a = layer.self_attn
            qkn = hasattr(a, "q_norm")  # (Llama: none; the op takes both norm weights None)
            self.layers.append({
                "layer": layer,
                "norm_w": layer.input_layernorm.weight.detach(),
                "eps": float(layer.input_layernorm.variance_epsilon),
                "q_norm_w": a.q_norm.weight.detach() if qkn else None,
                "k_norm_w": a.k_norm.weight.detach() if qkn else None,
                "qk_eps": float(a.q_norm.variance_epsilon) if qkn else 1e-6,
                **w,
            })  # fmt: skip

    def attend(self, i, q, positions, ctx):
        """Causal GQA attention of q [M, 16*128] over the paged cache, softmax in fp32 -> bf16 [M, 2048]. ctx:
        the first sequence's cached tokens (None: all, the graph's shape), a pair (sequence, tokens) for all
        rows, or a list of such pairs, one per row (a batch of sequences)."""
        if isinstance(ctx, list):
            return torch.cat([self.attend_one(i, q[b : b + 1], positions[b : b + 1], c, s)
                              for b, (s, c) in enumerate(ctx)])  # fmt: skip
        seq, ctx = ctx if isinstance(ctx, tuple) else (0, ctx)
        return self.attend_one(i, q, positions, ctx, seq)

    def attend_one(self, i, q, positions, ctx, seq=0):
        m = q.shape[0]
        k, v = self.cache.gather(i, ctx, seq)  # [T, 8, 128]
        qh = q.float().view(m, NUM_KV_HEADS, NUM_Q_HEADS // NUM_KV_HEADS, HEAD_DIM)
        scores = torch.einsum("mhrd,thd->mhrt", qh, k) * self.scaling
        t = torch.arange(k.shape[0], device=q.device)
        masked = t[None, :] > positions[:, None]  # [M, T]: later tokens, and unwritten slots of the table
        scores = scores.masked_fill(masked[:, None, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        return torch.einsum("mhrt,thd->mhrd", p, v).reshape(m, NUM_Q_HEADS * HEAD_DIM).bfloat16()

    def forward(self, tokens, positions, slots, ctx):
        """Hidden states after the final norm, bf16 [M, 2048], for tokens at positions (int64 [M], device)
        whose k/v go to slots; ctx = tokens in the cache after this call, or None for the fixed max_ctx."""
        x = self.model.model.embed_tokens(tokens)
        residual = None
        for i, lw in enumerate(self.layers):
            q, residual = self.op(
                x, residual, lw["norm_w"], lw["eps"], lw["weight"], lw["weight_scale"], lw["global_scale"],
                lw["q_norm_w"], lw["k_norm_w"], lw["qk_eps"], self.cos_sin, positions, self.cache.k[i],
                self.cache.v[i], slots, NUM_Q_HEADS, NUM_KV_HEADS, **self.cache.kv_kwargs(i),
            )  # fmt: skip
            layer = lw["layer"]
            residual = residual + layer.self_attn.o_proj(self.attend(i, q, positions, ctx))
            x = layer.mlp(layer.post_attention_layernorm(residual))
        return self.model.model.norm(x + residual)

    def _ids(self, values):
        return torch.tensor(values, dtype=torch.int64, device=self.cos_sin.device)

    def prefill(self, prompt: list[int], seq: int = 0):
        """The prompt through our own path in chunks of up to 16 tokens (one op call per layer and chunk).

        Why not fill the cache from the model's own prefill: then the prompt's k/v would carry HF's eager
        numerics (bf16 RoPE) instead of the op's, the FP8 cache would hold values the op never wrote, and
        the decode steps would attend over a cache that the op under test did not produce. Chunked, the
        prefill also exercises the op at M = 8 and a partial chunk, slots crossing a block boundary, and
        causal masking inside a chunk. Returns the last prompt token's hidden state [1, 2048]."""
        h = None
        for p0 in range(0, len(prompt), MAX_M):
            chunk = prompt[p0 : p0 + MAX_M]
            pos = list(range(p0, p0 + len(chunk)))
            slots = self._ids([self.cache.slot(p, seq) for p in pos])
            h = self.forward(self._ids(chunk), self._ids(pos), slots, ctx=(seq, p0 + len(chunk)))
        return h[-1:]

    def step_batch(self, tokens: list[int], positions: list[int]):
        """One eager decode step of a batch: token b of sequence b at its own position (M = len(tokens)),
        each attending over its own pos + 1 cached tokens."""
        slots = [self.cache.slot(p, b) for b, p in enumerate(positions)]
        return self.forward(self._ids(tokens), self._ids(positions), self._ids(slots),
                            ctx=[(b, p + 1) for b, p in enumerate(positions)])  # fmt: skip

    def step(self, token: int | torch.Tensor, pos: int):
        """One eager decode step (M = 1) attending over exactly pos + 1 cached tokens."""
        tok = token.view(1) if isinstance(token, torch.Tensor) else self._ids([token])
        return self.forward(tok, self._ids([pos]), self._ids([self.cache.slot(pos)]), ctx=pos + 1)


class StaticStep:
    """The whole decode step (embedding .. final norm, bf16 lm_head, argmax) on static buffers: token,
    position and slot are device tensors filled before each run, attention covers the cache's fixed
    max_ctx with masking. On CUDA it is captured once into a CUDA graph and replayed; on CPU the same body
    runs eagerly (it still checks the fixed-shape masked attention)."""

    def __init__(self, dec: FlintDecoder, first_token: int, first_pos: int):
        self.dec = dec
        dev = dec.cos_sin.device
        self.tok = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int64, device=dev)
        self.slot = torch.zeros(1, dtype=torch.int64, device=dev)
        self.graph = None
        # the warm-up runs write the first step's k/v at its slot: the replay writes the same values there
        self.set(first_token, first_pos)
        if dev.type == "cuda":
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):  # loads the kernels and warms the allocator outside capture
                    self._body()
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.hidden, self.next = self._body()

    def _body(self):
        h = self.dec.forward(self.tok, self.pos, self.slot, ctx=None)
        return h, self.dec.model.lm_head(h).argmax(dim=-1)

    def set(self, token: int | torch.Tensor | None, pos: int):
        if isinstance(token, torch.Tensor):
            self.tok.copy_(token.view(1))
        elif token is not None:
            self.tok.fill_(token)
        self.pos.fill_(pos)
        self.slot.fill_(self.dec.cache.slot(pos))

    def run(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.hidden, self.next = self._body()
        return self.hidden


# ------------------------------------------------------------------------------------------ the checks
def fp32_logits(model):
    """Logits in fp32 from the bf16 final hidden state, for both sides: the 151936 bf16 logits of the
    model's own head would be rounded to a 2^-6 grid near |logit| ~ 3, as coarse as a typical top-1 margin
    of this random model, making ties out of rounding."""
    w = model.lm_head.weight.detach().float()
    return lambda h: h.float().reshape(-1, w.shape[1]) @ w.T


def reference_cache(model, scales=None):
    """The model's own KV cache (HF DynamicCache). With FP8 scales, one that stores what an e4m3 cache
    holds: each k/v written is rounded to e4m3 with its layer's scale (loader.reference.fp8_cache_value, the
    op's cache-write numerics) and read back as value x scale -- the model's own forward over an FP8 cache."""
    from transformers import DynamicCache

    if scales is None:
        return DynamicCache(config=model.config)
    from loader.reference import fp8_cache_value

    def fake(t, s):
        return (fp8_cache_value(t, s).float() * s).to(t.dtype)

    class FP8Cache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            ks, vs = scales[layer_idx]
            return super().update(fake(key_states, ks), fake(value_states, vs), layer_idx, *args, **kwargs)

    return FP8Cache(config=model.config)


def reference_decode(model, prompt, steps, logits_of, scales=None, tokens=None):
    """The model's own forward: prefill with its own KV cache, then `steps` decode steps, greedy or fed
    `tokens`. Returns (fp32 logits [steps, V], tokens [steps], per-layer (k amax, v amax) of the prefill)."""
    dev = model.device
    cache = reference_cache(model, scales)
    out = model.model(input_ids=torch.tensor([prompt], device=dev), past_key_values=cache, use_cache=True)
    amax = [(lay.keys.abs().amax().float(), lay.values.abs().amax().float()) for lay in cache.layers]
    logits, out_tokens = [], []
    h = out.last_hidden_state[:, -1]
    for t in range(steps):
        lg = logits_of(h)[0]
        logits.append(lg)
        out_tokens.append(int(lg.argmax()) if tokens is None else tokens[t])
        if t + 1 < steps:
            ids = torch.tensor([[out_tokens[-1]]], device=dev)
            h = model.model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
    return torch.stack(logits), out_tokens, amax


def fp32_teacher_forced(model, prompt, tokens, scales=None, m32=None):
    """The same model (same weights, same cache format) in fp32 (m32, or a copy made here), one forward over
    prompt + tokens[:-1]: the yardstick for how far any bf16 computation of this model -- its own included
    -- lands."""
    m32 = m32 if m32 is not None else copy.deepcopy(model).float()
    ids = torch.tensor([prompt + tokens[:-1]], device=model.device)
    h = m32.model(input_ids=ids, past_key_values=reference_cache(m32, scales), use_cache=True)
    return h.last_hidden_state[0, len(prompt) - 1 :] @ m32.lm_head.weight.T


def ours_teacher_forced(dec, prompt, ref_tokens, logits_of, static=False):
    """Our logits [steps, V], fed the reference's tokens; eagerly, or through the static (graph) step."""
    dec.cache.reset()
    h = dec.prefill(prompt)
    logits = [logits_of(h)[0]]
    n = len(prompt)
    st = StaticStep(dec, ref_tokens[0], n) if static and len(ref_tokens) > 1 else None
    for t in range(1, len(ref_tokens)):
        if st is not None:
            st.set(ref_tokens[t - 1], n + t - 1)
            h = st.run()
        else:
            h = dec.step(ref_tokens[t - 1], n + t - 1)
        logits.append(logits_of(h)[0])
    return torch.stack(logits)


def ours_batched_teacher_forced(dec, prompts, ref_tokens, logits_of):
    """A batch of sequences decoding together: each prompt prefilled on its own, then per step ONE call of
    the op per layer for all sequences (M = the batch), sequence b's token at its own position and slots.
    Our logits [batch, steps, V], each sequence fed the reference's tokens."""
    dec.cache.reset()
    logits = [[logits_of(dec.prefill(p, seq=b))[0]] for b, p in enumerate(prompts)]
    for t in range(1, len(ref_tokens[0])):
        h = dec.step_batch([tk[t - 1] for tk in ref_tokens], [len(p) + t - 1 for p in prompts])
        for b, lg in enumerate(logits_of(h)):
            logits[b].append(lg)
    return torch.stack([torch.stack(lg) for lg in logits])


def batched(args, model, op, weights, device, logits_of, cos_sin, scales):
    """--batch N: N random prompts of different lengths (so different positions and context), decoded
    together; each sequence's logits against the model's own forward of that sequence alone, with the bound
    of the worst sequence's floor."""
    g = torch.Generator().manual_seed(args.seed + 4)
    lens = [args.prompt_len + 3 * b for b in range(args.batch)]
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    refs = [reference_decode(model, p, args.steps, logits_of, scales) for p in prompts]
    m32 = copy.deepcopy(model).float()
    floors = [compare(r[0], fp32_teacher_forced(model, p, r[1], scales, m32))
              for p, r in zip(prompts, refs, strict=True)]  # fmt: skip
    del m32
    cache = PagedKV(args.layers, max(lens) + args.steps, device, scales, seed=args.seed + 5, seqs=args.batch)
    dec = FlintDecoder(model, op, weights, cache, cos_sin)
    ours = ours_batched_teacher_forced(dec, prompts, [r[1] for r in refs], logits_of)
    bound = BOUND_FACTOR * max(f["max"] for f in floors) * args.bound_scale
    per_seq = [compare(o, r[0], bound) for o, r in zip(ours, refs, strict=True)]
    worst = max(range(args.batch), key=lambda b: per_seq[b]["max"])
    return dict(per_seq[worst], ok=all(c["ok"] for c in per_seq), seq=worst, lens=lens, floor=floors[worst])


def ours_free_running(dec, prompt, steps, logits_of):
    dec.cache.reset()
    h = dec.prefill(prompt)
    tokens = []
    for t in range(steps):
        tokens.append(int(logits_of(h)[0].argmax()))
        if t + 1 < steps:
            h = dec.step(tokens[-1], len(prompt) + t)
    return tokens


def margins(logits):
    top2 = logits.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def compare(ours, ref, bound=None):
    """Per-step relative logit error max_v |ours - ref| / max_v |ref|, top-1 agreement, and (given a bound)
    whether the error stays within it and every top-1 disagreement is at a near-tie of the reference: a
    top-1 margin below twice the allowed absolute error, which is all such an error can flip."""
    scale = ref.abs().amax(dim=-1)
    rel = (ours - ref).abs().amax(dim=-1) / scale
    agree = ours.argmax(dim=-1) == ref.argmax(dim=-1)
    r = {"rel": rel.tolist(), "max": float(rel.max()), "median": float(rel.median()),
         "top1": float(agree.float().mean()), "bound": bound}  # fmt: skip
    if bound is not None:
        near_tie = margins(ref) <= 2 * bound * scale
        r["decisive_flips"] = [t for t in range(len(rel)) if not agree[t] and not near_tie[t]]
        r["ok"] = r["max"] <= bound and not r["decisive_flips"]
    return r


# -------------------------------------------------------------------------------------------- latency
def _timed(fn, n, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn(n)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / n * 1e3


def latency(model, dec, prompt, steps, device):
    """ms per decode token, greedy with the next token kept on the device (no host sync per step):
    the model's own eager decode (HF forward + its DynamicCache, bf16 lm_head), ours eager, ours replayed."""
    from transformers import DynamicCache

    warm = min(8, steps // 4)
    n = steps - warm
    n0 = len(prompt)
    rows = {}

    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt], device=device), past_key_values=cache, use_cache=True)
    tok = [out.logits[0, -1].argmax()]

    def hf(k):
        for _ in range(k):
            lg = model(input_ids=tok[0].view(1, 1), past_key_values=cache, use_cache=True).logits
            tok[0] = lg[0, -1].argmax()

    hf(warm)
    rows["model's own eager decode (HF, DynamicCache)"] = _timed(hf, n, device)

    dec.cache.reset()
    h = dec.prefill(prompt)
    state = {"tok": dec.model.lm_head(h).argmax(dim=-1), "pos": n0}

    def eager(k):
        for _ in range(k):
            h = dec.step(state["tok"], state["pos"])
            state["tok"] = dec.model.lm_head(h).argmax(dim=-1)
            state["pos"] += 1

    eager(warm)
    rows["ours eager (flint op + torch paged attention)"] = _timed(eager, n, device)

    dec.cache.reset()
    h = dec.prefill(prompt)
    st = StaticStep(dec, int(dec.model.lm_head(h).argmax()), n0)
    state = {"pos": n0}

    def replay(k):
        for _ in range(k):
            st.run()
            state["pos"] += 1
            st.set(st.next, state["pos"])

    replay(warm)
    label = "ours, static step (CPU, no graph)" if st.graph is None else "ours, whole step in one CUDA graph"
    rows[label] = _timed(replay, n, device)
    return rows, n


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=tuple(MODELS), default="qwen3-1.7b",
                   help="the model's shape (default qwen3-1.7b); llama-3.1-8b has no q/k norm")  # fmt: skip
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: the model's; 2 with --tiny)")  # fmt: skip
    p.add_argument("--steps", type=int, default=64, help="decode steps compared and timed (default 64)")
    p.add_argument("--prompt-len", type=int, default=20, help="random prompt tokens (default 20)")
    p.add_argument("--weights", choices=("bf16", "nvfp4"), default="bf16")
    p.add_argument("--kv-cache", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--bundle", default=None, help="flint bundle directory (default: the loader finds it)")
    p.add_argument(
        "--backend",
        choices=("loader", "reference"),
        default="loader",
        help="loader: the AOT kernels (CUDA); reference: a pure-torch op of the same numerics",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="vocab 4096, MLP 1024, 2 layers (hidden, heads, head dim unchanged): for CPU runs",
    )
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-latency", action="store_true", help="skip the latency table")
    p.add_argument("--batch", type=int, default=1,
                   help=f"also decode this many sequences together (2..{MAX_M}: one op call of M = batch per "
                        "layer and step), each checked against the model")  # fmt: skip
    p.add_argument("--bound-scale", type=float, default=1.0, help="multiply every acceptance bound (tests)")
    args = p.parse_args(argv)  # fmt: skip
    if args.layers is None:
        args.layers = 2 if args.tiny else MODELS[args.model]["layers"]
    if args.steps < 2 or args.prompt_len < 1 or args.layers < 1:
        p.error("need --steps >= 2, --prompt-len >= 1, --layers >= 1")
    if not 1 <= args.batch <= MAX_M:
        p.error(f"need 1 <= --batch <= {MAX_M}")
    return args


def run(argv=None) -> dict:
    """Builds, decodes, compares and times; prints a report and returns it as a dict ("passed": bool)."""
    args = parse_args(argv)
    use_model(args.model)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.backend == "loader":
        if device.type != "cuda":
            raise SystemExit("--backend loader needs a CUDA device (use --backend reference on CPU)")
        import loader

        # an explicit --bundle is loaded; otherwise the one already in use, or the loader's default search
        bundle = loader.load_bundle(args.bundle) if args.bundle else loader.current_bundle()
        op, backend = loader.flint_qkv_fused, f"loader.flint_qkv_fused, bundle {bundle.path}"
    else:
        op, backend = TorchQKVFused(), "pure-torch reference op"
    from loader.reference import make_cos_sin_cache

    fp8 = args.kv_cache == "fp8"
    t_start = time.perf_counter()
    with torch.inference_mode():
        model = build_model(args, device)
        check_model(model)
        weights = qkv_weights(model, args.weights)
        g = torch.Generator().manual_seed(args.seed + 2)
        prompt = torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=g).tolist()
        logits_of = fp32_logits(model)
        print(
            f"{type(model).__name__} ({args.model}): {args.layers} layers, hidden {HIDDEN}, heads "
            f"{NUM_Q_HEADS}/{NUM_KV_HEADS}, vocab {model.config.vocab_size}, MLP "
            f"{model.config.intermediate_size}, random bf16 weights (seed {args.seed}) on {device} "
            f"(built in {time.perf_counter() - t_start:.1f} s)\nqkv weights {args.weights}, KV cache "
            f"{args.kv_cache}, op: {backend}; prompt {args.prompt_len} tokens, {args.steps} decode steps"
        )

        # the model's own forward (HF, its own cache); its prefill also calibrates the FP8 scales
        ref, tokens, amax = reference_decode(model, prompt, args.steps, logits_of)
        scales = None
        if fp8:
            scales = [tuple(FP8_HEADROOM * a.reshape(1) / E4M3_MAX for a in kv) for kv in amax]
            kss, vss = [float(s[0]) for s in scales], [float(s[1]) for s in scales]
            print(
                f"FP8 scales ({FP8_HEADROOM:g} x amax / 448 of the prefill, per layer): k {min(kss):.3g}.."
                f"{max(kss):.3g}, v {min(vss):.3g}..{max(vss):.3g}"
            )
            ref_bf16_cache = ref
            # the primary reference: the model's own forward over a cache holding e4m3 values
            ref, tokens, _ = reference_decode(model, prompt, args.steps, logits_of, scales)
            ref_bf16_cache, _, _ = reference_decode(model, prompt, args.steps, logits_of, tokens=tokens)
        ref32 = fp32_teacher_forced(model, prompt, tokens, scales)

        cache = PagedKV(args.layers, args.prompt_len + args.steps, device, scales, seed=args.seed + 3)
        cos_sin = make_cos_sin_cache(
            model.config.max_position_embeddings,
            base=float(model.config.rope_parameters["rope_theta"]),
            device=device,
        )
        dec = FlintDecoder(model, op, weights, cache, cos_sin)
        ours = ours_teacher_forced(dec, prompt, tokens, logits_of)
        ours_static = ours_teacher_forced(dec, prompt, tokens, logits_of, static=True)
        free = ours_free_running(dec, prompt, args.steps, logits_of)
        batch = None
        if args.batch > 1:
            batch = batched(args, model, op, weights, device, logits_of, cos_sin, scales)

    static = "CUDA graph" if device.type == "cuda" else "static step (CPU, no graph)"
    floor = compare(ref, ref32)
    bound = BOUND_FACTOR * floor["max"] * args.bound_scale
    rows = {  # name -> comparison; those with a bound are acceptance checks
        "model vs model in fp32 (the floor)": floor,
        "ours eager vs model in fp32": compare(ours, ref32),
        "ours eager vs model": compare(ours, ref, bound),
        f"ours {static} vs model": compare(ours_static, ref, bound),
        f"ours {static} vs ours eager": compare(ours_static, ours),
    }
    if fp8:
        rows["ours eager vs model with a BF16 cache"] = compare(
            ours, ref_bf16_cache, FP8_VS_BF16_BOUND * args.bound_scale
        )
    if batch is not None:
        rows[f"ours batched ({args.batch} sequences) vs model, worst"] = batch
    m = margins(ref)
    scale = ref.abs().amax(dim=-1)
    div = next((t for t, (a, b) in enumerate(zip(free, tokens, strict=True)) if a != b), None)
    free_ok = div is None or bool(m[div] <= 2 * bound * scale[div])
    ties = int((m == 0).sum())

    print(
        "\n(a) teacher-forced on the model's greedy tokens; error = max|logits - ref| / max|ref| per step "
        "(fp32 logits)\n  ours eager vs model, per step:"
    )
    for i in range(0, args.steps, 8):
        print(f"  {i:4d}: " + " ".join(f"{e:.2e}" for e in rows["ours eager vs model"]["rel"][i : i + 8]))
    print(f"\n  {'comparison':50s} {'max':>9s} {'median':>9s} {'top-1':>6s} {'bound':>7s}")
    for name, r in rows.items():
        verdict = "" if r["bound"] is None else f" {r['bound']:7.3g} {'ok' if r['ok'] else 'FAIL'}"
        flips = f" flips at decisive steps {r['decisive_flips']}" if r.get("decisive_flips") else ""
        print(f"  {name:50s} {r['max']:9.2e} {r['median']:9.2e} {r['top1']:6.3f}{verdict}{flips}")
    extra = f" x {args.bound_scale:g} (--bound-scale)" if args.bound_scale != 1 else ""
    print(f"  bound = {BOUND_FACTOR:g} x the floor's max{extra}")
    if batch is not None:
        print(f"  batched: {args.batch} sequences of prompt lengths {batch['lens'][0]}..{batch['lens'][-1]} "
              f"decoding together (one op call of M = {args.batch} per layer and step); worst sequence "
              f"{batch['seq']}, its bound {BOUND_FACTOR:g} x the worst floor {batch['floor']['max']:.2e}")
    print(
        f"  reference top-1 margin: min {float(m.min()):.3g}, median {float(m.median()):.3g} ({ties} exact "
        f"ties); max|logit| median {float(scale.median()):.3g}"
    )
    if div is None:
        print(f"(b) free-running greedy: same tokens as the model for all {args.steps} steps")
    else:
        verdict = "a near-tie: ok" if free_ok else "NOT a near-tie: FAIL"
        print(
            f"(b) free-running greedy: first divergence at step {div} (ours {free[div]}, model "
            f"{tokens[div]}); the model's top-1 margin there {float(m[div]):.3g} = "
            f"{float(m[div] / scale[div]):.2e} x max|logit| ({verdict})"
        )

    lat = None
    if not args.no_latency:
        with torch.inference_mode():
            lat, n = latency(model, dec, prompt, args.steps, device)
        print(
            f"\nper-token decode latency, ms ({n} greedy steps after warm-up, context {args.prompt_len}.."
            f"{args.prompt_len + args.steps}):"
        )
        for k, v in lat.items():
            print(f"  {k:52s} {v:8.3f}")

    checks = {name: r["ok"] for name, r in rows.items() if r["bound"] is not None}
    checks["free-running divergence only at a near-tie"] = free_ok
    checks["reference margins not degenerate"] = ties < args.steps // 2
    passed = all(checks.values())
    print(
        f"\n{'PASS' if passed else 'FAIL: ' + '; '.join(k for k, v in checks.items() if not v)} "
        f"({time.perf_counter() - t_start:.1f} s)"
    )
    return {"passed": passed, "checks": checks, "bound": bound, "comparisons": rows, "divergence": div,
            "tokens_model": tokens, "tokens_ours": free, "latency_ms": lat, "batch": batch}  # fmt: skip


def main(argv=None) -> int:
    return 0 if run(argv)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
