// Which token rows count: select_rows (which the host waits for, then gathers the valid rows by
// gather_rows), and mark_rows and zero_rows for a capturable call (every row computed, the
// ignored ones masked). Instantiated by jsdgpu/cuda/kernels.py.
#include "reduce.cuh"

// The valid rows: which token rows count, and their targets.
//
// One CTA scans the targets in order, in tiles of THREADS * ITEMS: rows gets the
// indices of the rows whose target is not ignore_index (has_ignore: ignore_index is an int64), in
// order, then 0 up to n (so that any prefix of rows can be gathered before the count is read),
// and row_target their targets as int32 (-1 where out of range, and past the count: any prefix
// can be read in the vocabulary's bounds before the count is); out[0] = their count, out[1] = the first row
// whose target is neither ignore_index nor in [0, vocab), out[2] the first ignored row (each n
// where there is none: the rows before out[2] are selected as they are). One CTA keeps
// the order with no second kernel; the targets of T = 8192 rows are one tile.
template <typename T, int THREADS, int ITEMS>
__device__ __forceinline__ void select_rows_body(const T* __restrict__ target, int n, long long ignore_index,
                                            int has_ignore, long long vocab, int* __restrict__ rows,
                                            int* __restrict__ row_target, int* __restrict__ out) {
  __shared__ int done, first_bad, first_ignored;  // rows selected by the tiles before; the first bad
                                                  // and ignored rows
  const int lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    done = 0;
    first_bad = first_ignored = n;
  }
  __syncthreads();
  for (int tile = 0; tile < n; tile += THREADS * ITEMS) {
    const int i0 = tile + threadIdx.x * ITEMS;
    int v[ITEMS];  // the targets as int32 (where they are not bad, they fit)
    unsigned valid = 0;   // bit j: row i0 + j is selected
    int ignored = n;      // the thread's first ignored row
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
      const long long t = i0 + j < n ? (long long)target[i0 + j] : 0;
      v[j] = (int)t;
      if (i0 + j < n && !(has_ignore && t == ignore_index)) {
        valid |= 1u << j;
        // as unsigned, a negative target is >= vocab too
        if ((unsigned long long)t >= (unsigned long long)vocab) {
          atomicMin(&first_bad, i0 + j);
          v[j] = -1;  // read by nothing outside its row before the host's wait (which then raises)
        }
      } else if (i0 + j < n) {
        ignored = min(ignored, i0 + j);
      }
    }
    ignored = __reduce_min_sync(0xffffffffu, ignored);  // one atomic a warp
    if (lane == 0 && ignored < n) atomicMin(&first_ignored, ignored);
    int selected;  // where this thread's rows go (and the tile's count)
    int at = done + block_exclusive_sum<THREADS>(__popc(valid), selected);
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
      if (valid >> j & 1) {
        rows[at] = i0 + j;
        row_target[at] = v[j];
        ++at;
      }
    }
    __syncthreads();  // every thread has read done
    if (threadIdx.x == 0) done += selected;
    __syncthreads();
  }
  for (int i = done + threadIdx.x; i < n; i += THREADS) {  // a prefix past the count: row 0 again, no label
    rows[i] = 0;
    row_target[i] = -1;
  }
  if (threadIdx.x == 0) {
    out[0] = done;
    out[1] = first_bad;
    out[2] = first_ignored;
  }
}

// The first of n token weights that is not finite or is below 0 (n where there is none), into
// *out: a default call's check of its weights, beside its first products like select_rows. One CTA.
__global__ void first_bad_weight(const float* __restrict__ weights, int n, int* __restrict__ out) {
  __shared__ int first;
  if (threadIdx.x == 0) first = n;
  __syncthreads();
  int mine = n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    if (!(weights[i] >= 0.0f && isfinite(weights[i]))) {  // NaN fails the first test
      mine = i;
      break;
    }
  }
  mine = __reduce_min_sync(0xffffffffu, mine);
  if ((threadIdx.x & 31) == 0 && mine < n) atomicMin(&first, mine);
  __syncthreads();
  if (threadIdx.x == 0) *out = first;
}

#define SELECT_ROWS_ARGS \
  int n, long long ignore_index, int has_ignore, long long vocab, int *rows, int *row_target, int *out
// T: the targets' type (int or long long)
template <typename T, int THREADS, int ITEMS>
__global__ void __launch_bounds__(THREADS) select_rows(const T* target, SELECT_ROWS_ARGS) {
  select_rows_body<T, THREADS, ITEMS>(target, n, ignore_index, has_ignore, vocab, rows, row_target, out);
}

// Rows of two matrices, gathered.
//
// out_a[i] = a[rows[i]] and out_b[i] = b[rows[i]] for i < count (blockIdx.y: 0 for a, 1 for b),
// in words of W: rows of a_words and b_words words each (W = uint4 where every row is 16-byte
// aligned, else unsigned short: every dtype here has an even size). One CTA per output row.
template <typename W>
__device__ __forceinline__ void gather_rows_body(const int* __restrict__ rows, const W* __restrict__ a, W* __restrict__ out_a,
                                            long long a_words, const W* __restrict__ b, W* __restrict__ out_b,
                                            long long b_words) {
  const bool is_a = blockIdx.y == 0;
  const long long words = is_a ? a_words : b_words;
  const W* src = (is_a ? a : b) + rows[blockIdx.x] * words;
  W* dst = (is_a ? out_a : out_b) + blockIdx.x * words;
  for (long long k = threadIdx.x; k < words; k += blockDim.x) dst[k] = src[k];
}

// W: uint4 or unsigned short
template <typename W>
__global__ void gather_rows(const int* rows, const W* a, W* out_a, long long a_words, const W* b, W* out_b,
                            long long b_words) {
  gather_rows_body(rows, a, out_a, a_words, b, out_b, b_words);
}

// The valid rows of a capturable call, where the host reads nothing: row_target[i] = the target of
// row i where it is valid, else -1 (ignored, or outside [0, vocab)); status[0] = the count of valid
// rows, status[1] = the first row whose target is neither ignore_index nor in [0, vocab) (n where
// there is none); inv_n[0] = 1 / N with N = normalizer where it is > 0, else max(1, count), or NaN
// where a target is bad (the loss and gradients come out NaN: a bad target never passes
// silently). One CTA, so that thread 0 can finish after every row is counted.
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS) mark_rows(const T* __restrict__ target, int n, long long ignore_index,
                                                     int has_ignore, long long vocab, float normalizer,
                                                     int* __restrict__ row_target, int* __restrict__ status,
                                                     float* __restrict__ inv_n) {
  __shared__ int count, first_bad;
  if (threadIdx.x == 0) {
    count = 0;
    first_bad = n;
  }
  __syncthreads();
  int mine = 0;
  for (int i = threadIdx.x; i < n; i += THREADS) {
    const long long t = (long long)target[i];
    const bool ignored = has_ignore && t == ignore_index;
    // as unsigned, a negative target is >= vocab too
    const bool bad = !ignored && (unsigned long long)t >= (unsigned long long)vocab;
    if (bad) atomicMin(&first_bad, i);
    mine += !ignored && !bad;
    row_target[i] = ignored || bad ? -1 : (int)t;
  }
  atomicAdd(&count, mine);  // integers: the same total in any order
  __syncthreads();
  if (threadIdx.x == 0) {
    status[0] = count;
    status[1] = first_bad;
    const float N = normalizer > 0.0f ? normalizer : (float)max(1, count);
    inv_n[0] = first_bad < n ? __int_as_float(0x7fc00000) : 1.0f / N;
  }
}

// The rows of G whose row_target is -1 zeroed (a capturable call's ignored rows, which the row
// kernels computed like the others): one CTA per row, in 16-byte words (G's rows are 128-byte
// aligned).
__global__ void zero_rows(const int* __restrict__ row_target, uint4* __restrict__ G, long long row_words) {
  if (row_target[blockIdx.x] >= 0) return;
  uint4* row = G + blockIdx.x * row_words;
  for (long long k = threadIdx.x; k < row_words; k += blockDim.x) row[k] = make_uint4(0, 0, 0, 0);
}
