// PTX for sm_90: shared-memory addresses, the cluster, mbarriers, pushes between the CTAs of a
// cluster (st.async) and bulk copies (cp.async.bulk).
#pragma once

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned long long s;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(s) : "l"(p));
  return (unsigned)s;
}

__device__ __forceinline__ unsigned cluster_ctarank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// The lane's index and gridDim.x, read where they are used (volatile: ptxas kept values made
// from them in registers through the fused kernel's row loop, and spilled them)
__device__ __forceinline__ int lane_id() {
  int r;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(r));
  return r;
}

__device__ __forceinline__ int grid_ctas() {
  int r;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// mbarriers in shared memory (by shared-memory address), for the partial results that the CTAs
// of a cluster push to one another with st.async: a push completes its bytes on the receiver's
// mbarrier, so neither side waits on a cluster barrier (whose release fence also waits for every
// global store in flight).

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}

// The one arrival of the barrier's current phase, which completes once `bytes` more have come
__device__ __forceinline__ void mbar_expect_bytes(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// An arrival without bytes
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// v to the shared memory of CTA `rank` of this cluster at the address dst has in ours, its 16
// bytes completed on that CTA's mbarrier at the address bar has in ours
__device__ __forceinline__ void push4(unsigned dst, float4 v, unsigned bar, unsigned rank) {
  unsigned remote_dst, remote_bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_dst) : "r"(dst), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(bar), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                   remote_dst),
               "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(remote_bar)
               : "memory");
}

// bytes (a multiple of 16) from global memory at src to the shared-memory address dst (both
// 16-byte aligned), by the Tensor Memory Accelerator, completed on the mbarrier at bar
__device__ __forceinline__ void bulk_copy(unsigned dst, const float* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Orders this thread's view of shared memory (and, after a barrier, the CTA's) before the
// async proxy's writes to it (bulk copies).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ float4 ld_shared4(unsigned addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr)
               : "memory");
  return v;
}
