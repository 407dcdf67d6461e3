// What every kernel family shares: float constants, the fast exp2 and log2, the 16-bit output
// formats and float4 helpers. The mode codes (FORWARD_KL, JSD, REVERSE_KL, and the row kernels'
// JSD_MIRRORED) and the format codes (OUT_F32, OUT_F16, OUT_BF16) are defined ahead of this header
// by the loader (jsdgpu/cuda/sources.py), from the Python enums and codes that the launchers use
// too.
#pragma once

#define NEG_INF __int_as_float(0xff800000)
#define D_INF __longlong_as_double(0x7ff0000000000000LL)
#define FLT_MIN_NORMAL 1.17549435e-38f
#define FLT_MAX_FINITE 3.40282347e+38f
#define LOG2E 1.44269504088896341f
#define LN2 0.693147180559945309f

// .ftz: a result below the smallest normal float (1.2e-38) is 0, and lg2 is only given normal
// numbers; without it each one costs three more instructions (the profile counted them)
__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float lg2(float x) {
  float r;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// max(x, y), but NaN where either is NaN
__device__ __forceinline__ float max_nan(float x, float y) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
}

template <int OUT>
__device__ __forceinline__ unsigned short to_16bit(float x) {
  unsigned short r;
  if (OUT == OUT_BF16)
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

// lo and hi in OUT's 16-bit format, lo in the low half (the lower address)
template <int OUT>
__device__ __forceinline__ unsigned pack_16bit(float lo, float hi) {
  unsigned r;
  if (OUT == OUT_BF16)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Four consecutive gradient values to G[k..k + n), n <= 4, in OUT's format; G + k is 16-byte
// (f32) / 8-byte aligned.
template <int OUT>
__device__ __forceinline__ void store4(void* G, long long k, const float g[4], int n) {
  if (OUT == OUT_F32) {
    float* out = static_cast<float*>(G) + k;
    if (n == 4) {
      *reinterpret_cast<float4*>(out) = make_float4(g[0], g[1], g[2], g[3]);
    } else {
      for (int j = 0; j < n; ++j) out[j] = g[j];
    }
  } else {
    unsigned short* out = static_cast<unsigned short*>(G) + k;
    if (n == 4) {
      *reinterpret_cast<uint2*>(out) = make_uint2(pack_16bit<OUT>(g[0], g[1]), pack_16bit<OUT>(g[2], g[3]));
    } else {
      for (int j = 0; j < n; ++j) out[j] = to_16bit<OUT>(g[j]);
    }
  }
}

// a value of x (of IN's format) as float32
template <int IN>
__device__ __forceinline__ float load_value(const void* x, long long k) {
  if (IN == OUT_F32) return static_cast<const float*>(x)[k];
  const unsigned short v = static_cast<const unsigned short*>(x)[k];
  if (IN == OUT_BF16) return __uint_as_float((unsigned)v << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
}

__device__ __forceinline__ float max4(float4 v) { return fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)); }

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// v with its values j in [from, to) replaced by x
__device__ __forceinline__ float4 fill(float4 v, int from, int to, float x) {
  const bool r[4] = {from <= 0 && 0 < to, from <= 1 && 1 < to, from <= 2 && 2 < to, from <= 3 && 3 < to};
  return make_float4(r[0] ? x : v.x, r[1] ? x : v.y, r[2] ? x : v.z, r[3] ? x : v.w);
}

// tanh(u) in float32, the soft caps': below |u| = TANH_POLY_BELOW, u + u^3 P(u^2) (P:
// sources.tanh_poly, in the prelude; within 2 ulp, tests/test_cuda_sources.py), where
// 1 - 2 / (e^2|u| + 1) would cancel; above, that formula by ex2 and rcp (tanhf's operations there;
// within 4 ulp, tests/test_model_logits.py), its sign u's (infinities give +-1, NaN NaN)
__device__ __forceinline__ float tanh_poly(float u) {
  const float s = u * u;
  return fmaf(u * s, fmaf(fmaf(fmaf(TANH_P3, s, TANH_P2), s, TANH_P1), s, TANH_P0), u);
}

__device__ __forceinline__ float soft_tanh(float u) {
  if (fabsf(u) < TANH_POLY_BELOW) return tanh_poly(u);
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(ex2(fabsf(u) * (2.0f * LOG2E)) + 1.0f));
  return copysignf(fmaf(-2.0f, r, 1.0f), u);
}

// a model's logit from its raw one x (bias added): scale x, then cap tanh(. inv_cap) where cap > 0
// (options.LossOptions.models; inv_cap = 1 / cap: a product in the fused kernel's loads, not a
// division)
__device__ __forceinline__ float model_logit(float x, float scale, float cap, float inv_cap) {
  const float z = scale * x;
  return cap > 0.0f ? cap * soft_tanh(z * inv_cap) : z;
}

// dz/dx of model_logit at its z: scale (1 - (z inv_cap)^2), the cap's tanh derivative (inv_cap 0:
// no cap)
__device__ __forceinline__ float model_derivative(float z, float scale, float inv_cap) {
  const float u = z * inv_cap;
  return scale * (1.0f - u * u);
}

// model_logit of four columns; where the cap is well above the logits (Gemma's 30), nearly every
// warp has all its columns below TANH_POLY_BELOW and skips soft_tanh's exponential and reciprocal
// (the same values either way: the vote decides only which code runs)
__device__ __forceinline__ float4 model_logits4(float4 v, float scale, float cap, float inv_cap) {
  if (cap > 0.0f) {
    const float4 u = make_float4(scale * v.x * inv_cap, scale * v.y * inv_cap, scale * v.z * inv_cap,
                                 scale * v.w * inv_cap);
    const float most = fmaxf(fmaxf(fabsf(u.x), fabsf(u.y)), fmaxf(fabsf(u.z), fabsf(u.w)));  // NaN: tanh_poly's NaN
    if (__all_sync(__activemask(), most < TANH_POLY_BELOW))
      return make_float4(cap * tanh_poly(u.x), cap * tanh_poly(u.y), cap * tanh_poly(u.z), cap * tanh_poly(u.w));
  }
  return make_float4(model_logit(v.x, scale, cap, inv_cap), model_logit(v.y, scale, cap, inv_cap),
                     model_logit(v.z, scale, cap, inv_cap), model_logit(v.w, scale, cap, inv_cap));
}

__device__ __forceinline__ float component(float4 v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// topk_logits' epilogue: a row's 4 threads (quad 0..3) take a tile's columns 8 i + 2 quad + e (e =
// 0, 1), so of each 32-column word of the row's slot bitmap these bits are quad's columns, and
// these its quads before: the order in which the row's slots' logits are packed (topk_logits.cu;
// topk_rows.cu, FromProduct::place, finds them again)
__device__ __forceinline__ unsigned quad_columns(int quad) { return 0x01010101u * (3u << 2 * quad); }
__device__ __forceinline__ unsigned quads_before(int quad) { return 0x01010101u * ((1u << 2 * quad) - 1u); }
