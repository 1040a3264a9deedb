"""W8A8 on the CPU: the INT8 GEMM candidates, then one decoder layer W8A8 (INT8, FP8) vs fp32
vs bf16.

    python -m fusednorm.bench_w8a8                       # all tables, Llama-7B layer sizes
    python -m fusednorm.bench_w8a8 --tables gemm --tokens 1,64,512
    python -m fusednorm.bench_w8a8 --tables layer --tokens 1,512 --bf16-max-tokens 1

Table "gemm": [M, K] @ [K, N] (K = N = --hidden) for every GEMM a W8A8 linear could use,
each on the same int8 operands (int8 x in [-128, 127], weights within the range the CPU's
int8 kernels take, see fusednorm.quant.weight_qmax), with its error against the fp64
product of the same operands (max |err| / max |ref|: an int8 GEMM is exact, so anything
above ~1e-6 is a wrong kernel, not rounding):
  fp32_matmul       torch.matmul in fp32 (the baseline the W8A8 layer must beat)
  bf16_matmul       torch.matmul in bf16
  int_mm            torch._int_mm (int8 x int8 -> int32), then the two scales
  onednn_u8         torch.ops.onednn.qlinear_pointwise, activation uint8 with zero point 128
                    (what fusednorm.quant.W8A8Linear runs above quant.FBGEMM_MAX_TOKENS
                    rows), fp32 output, per-token scale after
  onednn_s8         the same with the int8 activation passed as int8 (zero point 0)
  fbgemm            torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32: FBGEMM,
                    takes an fp32 activation and quantizes it per tensor inside (the per-token
                    scale applied after), the only FBGEMM linear with an fp32 output; fed
                    q as fp32 with scale 1 and zero point 128 (exact), what W8A8Linear runs
                    up to quant.FBGEMM_MAX_TOKENS rows
  scaled_mm_fp8     torch._scaled_mm on float8_e4m3fn (this torch's CPU path takes per-tensor
                    scales only), unit scales and fp32 output, the GEMM that
                    W8A8Linear(dtype=torch.float8_e4m3fn) runs on the CPU (its two scale
                    multiplies not timed); its error is the e4m3 rounding of the int8 operands
Table "norm": the quantized norm (dynamic per-token int8, with weight) against its two-step
peers on the same [tokens, hidden] fp32/bf16 input: torch eager (torch.nn.functional.rms_norm
then fusednorm.quant.quantize_per_token) and torch.compile of that same function (Inductor).
Table "layer": one LlamaDecoderLayer (transformers) at fp32, bf16, and W8A8
(fusednorm.quant.patch_hf_w8a8 on the fp32 layer: norms by rms_norm_quant, the residual add
fused into the second, GEMMs by FBGEMM up to quant.FBGEMM_MAX_TOKENS tokens and oneDNN
above), and W8A8 FP8 ("w8a8_fp8": patch_hf_w8a8(dtype=torch.float8_e4m3fn), e4m3 weights
and activations, GEMMs by torch._scaled_mm, a fallback on the CPU; not run where
quant.fp8_unsupported_reason() says why); with --w8a8-onednn also the first W8A8 layer
(oneDNN at every size, add unfused).

Gemm table: each candidate cycles through --weight-sets independent operand sets (default
4: 4 x 16 MB of int8 weights exceed a 32 MB L3, as a real model's weights do). Times are
medians of --repeats calls after one warm-up, the candidates taking turns call by
call, on torch.get_num_threads() threads (--threads). The SIMD columns say what ran:
torch's CPU capability (its own kernels) and fusednorm's Highway target.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

import fusednorm
from fusednorm import quant


def _median_ms(fns: dict, repeats: int) -> dict:
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up (oneDNN builds its primitive on the first call)
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def _gemm_operand_set(m: int, k: int, n: int, skip: set):
    """One set of operands (int8 x, per-token scales, int8 weights in every layout a
    candidate needs): name -> callable and name -> relative error for every candidate."""
    qmax_w = quant.weight_qmax()
    x_q = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    token_scale = torch.rand(m, 1) * 0.01 + 1e-3
    w_q = torch.randint(-qmax_w, qmax_w + 1, (n, k), dtype=torch.int8)
    w_scale = torch.rand(n) * 0.01 + 1e-3
    x_f = x_q.float()
    w_t = w_q.float().t().contiguous()
    cands = {}
    cands["fp32_matmul"] = lambda: torch.matmul(x_f, w_t)
    if "bf16_matmul" not in skip:
        x_b, w_b = x_f.bfloat16(), w_t.bfloat16()
        cands["bf16_matmul"] = lambda: torch.matmul(x_b, w_b)
    if "int_mm" not in skip:
        w_qt = w_q.t()
        cands["int_mm"] = lambda: torch._int_mm(x_q, w_qt).float().mul_(w_scale).mul_(token_scale)
    packed = torch.ops.onednn.qlinear_prepack(w_q, None)
    zp = torch.zeros(n, dtype=torch.int64)

    def onednn(x, x_zp):
        y = torch.ops.onednn.qlinear_pointwise(
            x, 1.0, x_zp, packed, w_scale, zp, None, 1.0, 0, torch.float32, "none", [], ""
        )
        return y.mul_(token_scale)

    # The XOR (int8 -> uint8 + 128) is timed: W8A8Linear does it per call.
    cands["onednn_u8"] = lambda: onednn(x_q.view(torch.uint8).bitwise_xor(0x80), 128)
    cands["onednn_s8"] = lambda: onednn(x_q, 0)
    with quant.quantized_engine("fbgemm"):
        fb_packed = torch.ops.quantized.linear_prepack(
            torch._make_per_channel_quantized_tensor(w_q, w_scale.double(), zp, 0), None
        )
    # The int8 -> fp32 expansion is timed: W8A8Linear does it per call on this path.
    cands["fbgemm"] = lambda: torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        x_q.float(), 1.0, 128, fb_packed
    ).mul_(token_scale)
    if "scaled_mm_fp8" not in skip:
        x_8, w_8 = x_q.to(torch.float8_e4m3fn), w_q.to(torch.float8_e4m3fn)
        one = torch.tensor(1.0)
        cands["scaled_mm_fp8"] = lambda: torch._scaled_mm(
            x_8, w_8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32
        )
    for name in skip - {"fp32_matmul"}:  # the baseline of every ratio always runs
        cands.pop(name, None)
    ref = (x_q.double() @ w_q.double().t()) * w_scale.double() * token_scale.double()
    errors = {}
    for name, fn in cands.items():
        y = fn()
        if name in ("fp32_matmul", "bf16_matmul", "scaled_mm_fp8"):  # scales not timed
            y = y * w_scale * token_scale
        errors[name] = _rel_err(y, ref)
    return cands, errors


def gemm_candidates(m: int, k: int, n: int, skip: set, weight_sets: int = 1):
    """name -> (callable, relative error) for every candidate. With ``weight_sets`` > 1
    each candidate cycles call by call through that many independent operand sets, so
    that its weights are not all cache-resident (a 7B model's layer never fits in L3);
    the error is that of the first set."""
    sets = [_gemm_operand_set(m, k, n, skip) for _ in range(weight_sets)]
    errors = sets[0][1]
    cands = {}
    for name in sets[0][0]:
        fns = itertools.cycle([s[0][name] for s in sets])
        cands[name] = lambda fns=fns: next(fns)()
    return cands, errors


def run_gemm_table(args):
    print(f"\nINT8 GEMM candidates, [M, {args.hidden}] @ [{args.hidden}, {args.hidden}], "
          f"{torch.get_num_threads()} threads, torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, weight qmax {quant.weight_qmax()}, "
          f"{args.weight_sets} weight set(s) cycled")
    print(f"{'M':>5} {'candidate':<14} {'ms':>10} {'x fp32':>8} {'rel err':>9}")
    for m in args.tokens:
        skip = set(args.skip)
        if m > args.slow_max_tokens:
            skip |= {"int_mm", "bf16_matmul", "scaled_mm_fp8"}
        cands, errors = gemm_candidates(m, args.hidden, args.hidden, skip, args.weight_sets)
        times = _median_ms(cands, args.repeats)
        for name, ms in times.items():
            print(f"{m:>5} {name:<14} {ms:>10.2f} {times['fp32_matmul'] / ms:>8.2f} "
                  f"{errors[name]:>9.1e}")
        for name in sorted(skip):
            why = "--skip" if name in args.skip else "M > --slow-max-tokens"
            print(f"{m:>5} {name:<14} {'not run':>10}  ({why})")


def _decoder_layer(hidden: int, intermediate: int, heads: int):
    import transformers
    from transformers.models.llama import modeling_llama

    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
        num_key_value_heads=heads, num_hidden_layers=1, vocab_size=128,
        max_position_embeddings=4096,
    )
    config._attn_implementation = "sdpa"
    layer = modeling_llama.LlamaDecoderLayer(config, layer_idx=0).eval()
    with torch.no_grad():  # norm weights away from 1 so that they count
        layer.input_layernorm.weight.normal_(1.0, 0.1)
        layer.post_attention_layernorm.weight.normal_(1.0, 0.1)
    rope = modeling_llama.LlamaRotaryEmbedding(config)
    return layer, rope


def _two_step_norm_quant(x, w):
    return quant.quantize_per_token(torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6))


def run_norm_table(args):
    compiled = torch.compile(_two_step_norm_quant, dynamic=False)
    print(f"\nRMSNorm + dynamic per-token int8 quantize, {torch.get_num_threads()} threads, "
          f"fusednorm SIMD target {torch.ops.fusednorm.cpu_simd_target()}")
    print(f"{'shape':>12} {'dtype':>6} {'impl':<14} {'us':>10} {'x eager':>8} {'q != fused':>10}")
    for rows in args.norm_rows:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, args.hidden).to(dtype)
            w = (1 + 0.1 * torch.randn(args.hidden)).to(dtype)
            fns = {
                "torch_eager": lambda: _two_step_norm_quant(x, w),
                "torch_compile": lambda: compiled(x, w),
                "fusednorm": lambda: fusednorm.rms_norm_quant(x, w, 1e-6, dtype=torch.int8),
            }
            with torch.inference_mode():
                q_fused = fns["fusednorm"]()[0]
                diffs = {n: int(fn()[0].int().ne(q_fused.int()).sum()) for n, fn in fns.items()}
                times = _median_ms(fns, args.repeats)
            for name, ms in times.items():
                print(f"{rows:>6}x{args.hidden:<5} {str(dtype)[6:]:>6} {name:<14} "
                      f"{ms * 1e3:>10.1f} {times['torch_eager'] / ms:>8.2f} {diffs[name]:>10}")


def run_layer_table(args):
    import copy

    layer_fp32, rope = _decoder_layer(args.hidden, args.intermediate, args.heads)
    layer_w8a8 = copy.deepcopy(layer_fp32)
    quant.patch_hf_w8a8(layer_w8a8)
    layer_w8a8_onednn = None
    if args.w8a8_onednn:  # the first W8A8 layer: oneDNN at every size, residual add unfused
        layer_w8a8_onednn = copy.deepcopy(layer_fp32)
        quant.patch_hf_w8a8(layer_w8a8_onednn, fuse_add=False, gemm="onednn")
    fp8_unsupported = quant.fp8_unsupported_reason()
    layer_w8a8_fp8 = None
    if fp8_unsupported is None:
        layer_w8a8_fp8 = copy.deepcopy(layer_fp32)
        quant.patch_hf_w8a8(layer_w8a8_fp8, dtype=torch.float8_e4m3fn)
    layer_bf16 = copy.deepcopy(layer_fp32).to(torch.bfloat16)
    print(f"\nOne LlamaDecoderLayer (hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{args.heads} heads), {torch.get_num_threads()} threads, torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, fusednorm SIMD target "
          f"{torch.ops.fusednorm.cpu_simd_target()}")
    print(f"{'tokens':>6} {'layer':<19} {'ms':>10} {'x fp32':>8} {'cos vs fp32':>12}")
    for t in args.tokens:
        x = torch.randn(1, t, args.hidden)
        pos = torch.arange(t)[None]
        cos, sin = rope(x, pos)
        mask = None if t == 1 else torch.full((t, t), float("-inf")).triu(1)[None, None]

        def call(layer, dtype):
            xs = x.to(dtype)
            pe = (cos.to(dtype), sin.to(dtype))
            m = None if mask is None else mask.to(dtype)
            return lambda: layer(xs, attention_mask=m, position_embeddings=pe)

        fns = {"fp32": call(layer_fp32, torch.float32), "w8a8": call(layer_w8a8, torch.float32)}
        # torch._scaled_mm's CPU path is a fallback (6.7 s per layer at 1 token on an
        # AVX-512 Intel VM): beyond --slow-max-tokens a run would take hours.
        run_fp8 = layer_w8a8_fp8 is not None and t <= args.slow_max_tokens
        if run_fp8:
            fns["w8a8_fp8"] = call(layer_w8a8_fp8, torch.float32)
        if layer_w8a8_onednn is not None:
            fns["w8a8_onednn_unfused"] = call(layer_w8a8_onednn, torch.float32)
        if t <= args.bf16_max_tokens:
            fns["bf16"] = call(layer_bf16, torch.bfloat16)
        with torch.inference_mode():
            outs = {name: fn().double().flatten() for name, fn in fns.items()}
            times = _median_ms(fns, args.repeats)
        for name, ms in times.items():
            cosine = torch.nn.functional.cosine_similarity(outs[name], outs["fp32"], dim=0).item()
            print(f"{t:>6} {name:<19} {ms:>10.2f} {times['fp32'] / ms:>8.2f} {cosine:>12.5f}")
        if "bf16" not in fns:
            print(f"{t:>6} {'bf16':<19} {'not run':>10}  (tokens > --bf16-max-tokens)")
        if fp8_unsupported is not None:
            print(f"{t:>6} {'w8a8_fp8':<19} {'not run':>10}  ({fp8_unsupported})")
        elif not run_fp8:
            print(f"{t:>6} {'w8a8_fp8':<19} {'not run':>10}  (tokens > --slow-max-tokens)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", default="gemm,norm,layer")
    p.add_argument("--norm-rows", default="1,512,4096", help="rows of the norm table")
    p.add_argument("--tokens", default="1,64,512", help="rows M (comma-separated)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--weight-sets", type=int, default=4,
                   help="gemm table: independent operand sets each candidate cycles through "
                   "(4 x 16 MB of int8 weights at hidden 4096 exceed a 32 MB L3)")
    p.add_argument("--slow-max-tokens", type=int, default=64,
                   help="largest M for the fallback GEMMs (_int_mm, bf16, fp8: seconds each)")
    p.add_argument("--skip", default="",
                   help="gemm table: candidates not to run (comma-separated), e.g. onednn_s8, "
                   "which took seconds per call at M >= 16 on AVX-512")
    p.add_argument("--bf16-max-tokens", type=int, default=1,
                   help="largest token count for the bf16 layer (a fallback GEMM on AVX2)")
    p.add_argument("--w8a8-onednn", action="store_true",
                   help="layer table: also the W8A8 layer with oneDNN at every size and the "
                   "residual add unfused (patch_hf_w8a8(fuse_add=False, gemm='onednn'))")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.norm_rows = [int(t) for t in args.norm_rows.split(",")]
    args.skip = {name for name in args.skip.split(",") if name}
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tables = args.tables.split(",")
    if "gemm" in tables:
        run_gemm_table(args)
    if "norm" in tables:
        run_norm_table(args)
    if "layer" in tables:
        run_layer_table(args)


if __name__ == "__main__":
    main()
