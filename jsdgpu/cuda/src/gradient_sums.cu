// The gradient sums' kernels: float32 sums to 16-bit gradients (scale_cast), the label terms
// that the row kernels keep out of 16-bit G, added exactly (label_rows for grad_input,
// label_scatter for grad_weight and grad_bias, over the rows in the order label_order gives), and
// the student's rows times the row scales of a G stored scaled (scale_rows).
// 1/N comes as a device pointer: in a capturable call it is known on the device only.
// Instantiated by jsdgpu/cuda/kernels.py.
#include "common.cuh"

// float32 sums to 16-bit gradients, times grad_output (scale null: 1)
template <int OUT>
__device__ __forceinline__ void scale_cast_body(const float* __restrict__ in, unsigned short* __restrict__ out,
                                           long long n, const float* __restrict__ scale) {
  const float k = scale ? *scale : 1.0f;
  const long long stride = 4LL * gridDim.x * blockDim.x;
  for (long long i = 4LL * (blockIdx.x * (long long)blockDim.x + threadIdx.x); i < n; i += stride) {
    float g[4];
    const int count = n - i < 4 ? (int)(n - i) : 4;
    if (count == 4) {
      const float4 v = *reinterpret_cast<const float4*>(in + i);
      g[0] = v.x * k; g[1] = v.y * k; g[2] = v.z * k; g[3] = v.w * k;
    } else {
      for (int c = 0; c < count; ++c) g[c] = in[i + c] * k;
    }
    store4<OUT>(out, i, g, count);
  }
}

template <int OUT>
__global__ void scale_cast(const float* in, unsigned short* out, long long n, const float* scale) {
  scale_cast_body<OUT>(in, out, n, scale);
}

// scale_rows: out[i] = scale[i] x[i], x and out [rows, hs] in IN's format, one block per row
template <int IN>
__global__ void scale_rows(const void* __restrict__ x, const float* __restrict__ scale, int hs, void* __restrict__ out) {
  const long long i = blockIdx.x;
  const float k = scale[i];
  for (int h = threadIdx.x; h < hs; h += blockDim.x) {
    const float v = k * load_value<IN>(x, i * hs + h);
    store4<IN>(out, i * hs + h, &v, 1);
  }
}

// model_logits: a chunk's logits as a model's (options.LossOptions.models), in place: z = scale (z +
// bias) (bias null: none), then cap tanh(z / cap) where cap > 0 (common.cuh, model_logit: as the
// fused kernel makes them); logits float32 [rows, ld], the first v columns, one block per row
__global__ void model_logits(float* __restrict__ logits, long long ld, int v, const float* __restrict__ bias,
                             float scale, float cap, float inv_cap) {
  float* row = logits + blockIdx.x * ld;
  for (int j = threadIdx.x; j < v; j += blockDim.x)
    row[j] = model_logit(row[j] + (bias ? bias[j] : 0.0f), scale, cap, inv_cap);
}

// model_gradient: G, the gradient in a model's logits z (model_logits'), to the gradient in its raw
// logits, in place: times model_derivative (scale alone where inv_cap is 0); and each row's label
// term (kept out of G: label_terms non-null) times that factor at its label (target[i] >= 0).
// G [rows, g_ld] in G_FMT, z float32 [rows, z_ld], v columns, one block per row.
template <int G_FMT>
__global__ void model_gradient(void* __restrict__ G, long long g_ld, const float* __restrict__ z, long long z_ld,
                               int v, float scale, float inv_cap, const int* __restrict__ target,
                               float* __restrict__ label_terms) {
  const long long i = blockIdx.x;
  const float* zr = z + i * z_ld;
  for (int j = threadIdx.x; j < v; j += blockDim.x) {
    const float g = load_value<G_FMT>(G, i * g_ld + j) * model_derivative(zr[j], scale, inv_cap);
    store4<G_FMT>(G, i * g_ld + j, &g, 1);
  }
  if (threadIdx.x == 0 && label_terms && target[i] >= 0)
    label_terms[i] *= model_derivative(zr[target[i]], scale, inv_cap);
}

// label_rows: grad_input[i] += *inv_n * label_terms[i] * ws[target[i]] for the rows whose label this
// rank owns (target[i] >= 0); grad_input float32 [rows, hs], one block per row.
template <int IN>
__device__ __forceinline__ void label_rows_body(const float* __restrict__ label_terms, const int* __restrict__ target,
                                           const void* __restrict__ ws, int hs, const float* __restrict__ inv_n,
                                           float* __restrict__ grad_input) {
  const int i = blockIdx.x;
  const long long label = target[i];
  if (label < 0) return;
  const float k = label_terms[i] * *inv_n;
  for (int h = threadIdx.x; h < hs; h += blockDim.x)
    grad_input[(long long)i * hs + h] += k * load_value<IN>(ws, label * hs + h);
}

#define LABEL_ROWS_ARGS \
  const float *label_terms, const int *target, const void *ws, int hs, const float *inv_n, float *grad_input
template <int IN>
__global__ void label_rows(LABEL_ROWS_ARGS) { label_rows_body<IN>(label_terms, target, ws, hs, inv_n, grad_input); }

// grad_weight[label] += k * sum over the rows i with that label of label_terms[i] * x[i], and
// grad_bias[label] likewise, with k = *inv_n (times *scale where scale is not null). order: the
// rows sorted by label, stably; sorted_target: their labels (-1: a label on another rank).
// grad_weight (or grad_bias) null: left alone. grad_weight is the float32 sums (OUT = OUT_F32) or
// the finished gradient in the inputs' dtype (OUT = IN); grad_bias is always float32 sums.
// Block b works only where a label's rows start, and adds them in order: no atomics, so the
// results have the same bits on every run.

template <int IN, int OUT>
__device__ __forceinline__ void label_scatter_body(const float* __restrict__ label_terms, const int* __restrict__ order,
                                              const int* __restrict__ sorted_target, int n_rows,
                                              const void* __restrict__ x, int hs, const float* __restrict__ inv_n,
                                              const float* __restrict__ scale, void* __restrict__ grad_weight,
                                              float* __restrict__ grad_bias) {
  const int begin = blockIdx.x;
  const long long label = sorted_target[begin];
  if (label < 0 || (begin > 0 && sorted_target[begin - 1] == label)) return;
  int end = begin + 1;
  while (end < n_rows && sorted_target[end] == label) ++end;
  const float k = scale ? *inv_n * *scale : *inv_n;
  for (int h = threadIdx.x; grad_weight != nullptr && h < hs; h += blockDim.x) {
    float acc = 0.0f;
    for (int r = begin; r < end; ++r) {
      const int i = order[r];
      acc += label_terms[i] * load_value<IN>(x, (long long)i * hs + h);
    }
    const float sum = load_value<OUT>(grad_weight, label * hs + h) + k * acc;
    store4<OUT>(grad_weight, label * hs + h, &sum, 1);
  }
  if (grad_bias != nullptr && threadIdx.x == 0) {
    float acc = 0.0f;
    for (int r = begin; r < end; ++r) acc += label_terms[order[r]];
    grad_bias[label] += k * acc;
  }
}

#define LABEL_SCATTER_ARGS                                                                                \
  const float *label_terms, const int *order, const int *sorted_target, int n_rows, const void *x, int hs, \
      const float *inv_n, const float *scale, void *grad_weight, float *grad_bias
#define LABEL_SCATTER_CALL label_terms, order, sorted_target, n_rows, x, hs, inv_n, scale, grad_weight, grad_bias
// IN: the inputs' format; OUT: grad_weight's
template <int IN, int OUT>
__global__ void label_scatter(LABEL_SCATTER_ARGS) { label_scatter_body<IN, OUT>(LABEL_SCATTER_CALL); }

// order[rank] = i, rank = the number of rows j with label[j] < label[i], or label[j] == label[i]
// and j < i: the rows sorted by label, stably (so label_scatter adds each label's rows in row
// order, and the bits repeat), without a sort's host synchronization. n^2 comparisons (67 M at n =
// 8192), a warp per row, its lanes reading 32 labels at a time (one thread per row, the labels in
// tiles through shared memory, kept a few dozen SMs busy: 0.11 ms at n = 8192, profiled).
template <int THREADS>
__global__ void __launch_bounds__(THREADS) label_order(const int* __restrict__ label, int n, int* __restrict__ order) {
  const int i = blockIdx.x * (THREADS / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (i >= n) return;  // the whole warp
  const int mine = label[i];
  int rank = 0;
  for (int j = lane; j < n; j += 32) {
    const int other = label[j];
    rank += other < mine || (other == mine && j < i);
  }
  for (int mask = 16; mask > 0; mask >>= 1) rank += __shfl_xor_sync(0xffffffffu, rank, mask);
  if (lane == 0) order[rank] = i;
}
