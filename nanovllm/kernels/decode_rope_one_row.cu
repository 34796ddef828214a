// decode_rope (kernels/decode_rope.py) as a CUDA kernel for one decode row: q/k RMSNorm, rotary, the
// KV store and split-KV attention with its combine, in one launch. Compiled at run time by NVRTC
// (kernels/nvrtc.py); kernels/cuda_decode_rope.py launches it and says when.
//
// Written for the dependent-latency chain that a one-row layer is: right after the PDL wait it issues
// every load at once (q, the new key and value, the chunk's K/V tile held in registers), computes the
// scores on CUDA cores (4 dims a lane, summed by a butterfly of warp shuffles) and P @ V from registers,
// so no tile goes through shared memory; the chunks' partials are combined by the last chunk to finish
// (an acq_rel atomic counter), as the Triton kernel does.
//
// Grid (KV heads, rows, chunks), 128 threads. Macros: G (query heads a KV head; the launcher takes 2,
// the count measured), NKV (KV heads), BF16 (else float16), POS64 / SLOT64 (int64 positions / slots,
// else int32), PDL (launched as a programmatic dependent), MINB (blocks an SM: 4 keeps 128 registers).
#define D 128
#define BN 64
#define NT 128
#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

__device__ __forceinline__ float to_f(u16 h) {
#if BF16
  return __uint_as_float(((u32)h) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}
__device__ __forceinline__ u16 from_f(float x) {
  u16 h;
#if BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
#endif
  return h;
}
__device__ __forceinline__ float rnd(float x) { return to_f(from_f(x)); }

#if POS64
typedef i64 pos_t;
#else
typedef int pos_t;
#endif
#if SLOT64
typedef i64 slot_t;
#else
typedef int slot_t;
#endif

// Butterfly reduce-scatter of N per-lane values over a warp: afterwards v[0 .. N/32) (one value when
// N <= 32) holds full sums; see flat_index for which.
template <int N>
__device__ __forceinline__ void reduce_round(float* v, int lane, int o) {
#pragma unroll
  for (int j = 0; j < N / 2; ++j) {
    bool up = lane & o;
    float send = up ? v[j] : v[j + N / 2];
    float keep = up ? v[j + N / 2] : v[j];
    v[j] = keep + __shfl_xor_sync(FULL, send, o);
  }
}

#define NS (16 * G)           // scores a lane holds before the reduction: 16 keys x G heads
#define NR (NS >= 32 ? NS / 32 : 1)  // after it

__device__ __forceinline__ void reduce_scores(float* v, int lane) {
#if G == 1
  reduce_round<16>(v, lane, 16); reduce_round<8>(v, lane, 8); reduce_round<4>(v, lane, 4);
  reduce_round<2>(v, lane, 2); v[0] += __shfl_xor_sync(FULL, v[0], 1);
#elif G == 2
  reduce_round<32>(v, lane, 16); reduce_round<16>(v, lane, 8); reduce_round<8>(v, lane, 4);
  reduce_round<4>(v, lane, 2); reduce_round<2>(v, lane, 1);
#else
  reduce_round<64>(v, lane, 16); reduce_round<32>(v, lane, 8); reduce_round<16>(v, lane, 4);
  reduce_round<8>(v, lane, 2); reduce_round<4>(v, lane, 1);
#endif
}
// Flat index (key * G + head) of reduced value j in this lane.
__device__ __forceinline__ int flat_index(int lane, int j) {
#if G == 1
  return lane >> 1;
#else
  return lane * NR + j;
#endif
}
// Max / sum over the lanes that hold the same heads (they differ in lane bits 1-4).
__device__ __forceinline__ float lane_max(float x) {
#pragma unroll
  for (int o = 2; o <= 16; o <<= 1) x = fmaxf(x, __shfl_xor_sync(FULL, x, o));
  return x;
}
__device__ __forceinline__ float lane_sum(float x) {
#pragma unroll
  for (int o = 2; o <= 16; o <<= 1) x += __shfl_xor_sync(FULL, x, o);
  return x;
}

#ifndef MINB
#define MINB 1
#endif
extern "C" __global__ void __launch_bounds__(NT, MINB) decode_rope_cuda(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
    u16* k_cache, u16* v_cache, float* partial_out, float* partial_lse, u16* out, int* counters,
    const int* __restrict__ seqlens, const int* __restrict__ block_tables,
    const pos_t* __restrict__ positions, const slot_t* __restrict__ slots,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t,
    const u16* __restrict__ q_w, const u16* __restrict__ k_w, float q_eps, float k_eps,
    i64 q_sb, i64 q_sh, i64 k_sb, i64 k_sh, i64 v_sb, i64 v_sh, i64 o_sb, i64 o_sh,
    int bt_stride, int nsplit, float scale_log2, int nkv_arg, int bs, int has_norm) {
  const int nkv = NKV;  // compile-time: the tile's loads take immediate offsets
  const int kvh = blockIdx.x, seq = blockIdx.y, split = blockIdx.z;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int H = nkv * G;
  __shared__ float qs[G][D];
  __shared__ float knew[D], vnew[D];
  __shared__ float red[4][G + 1];
  __shared__ float redm[4][G], redl[4][G];
  __shared__ float ps[G][BN];
  __shared__ float accx[G][D];
  __shared__ int is_last;

  // ---- host-built inputs only, before the wait
  const int kv_len = seqlens[seq];
  const int per = (kv_len + nsplit - 1) / nsplit;
  const int split_len = ((per + BN - 1) / BN) * BN;
  const int start = split * split_len;
  const int end = min(start + split_len, kv_len);
  const bool empty = start >= end;
  const int new_i = kv_len - 1;
  const bool has_new = !empty && start <= new_i && new_i < end;
  const i64 slot = has_new ? (i64)slots[seq] : -1;
  const bool subst = has_new && slot >= 0;  // the new key and value come from registers, not the cache
  const int* bt = block_tables + (i64)seq * bt_stride;

  const int d = t, p = d < D / 2 ? d + D / 2 : d - D / 2;
  float c = 0.f, s = 0.f, wq = 1.f, wqp = 1.f, wk = 1.f, wkp = 1.f;
  if (!empty) {
    const i64 pos = (i64)positions[seq];
    c = cos_t[pos * D + d];
    s = sin_t[pos * D + d];
    if (d < D / 2) s = -s;  // rotate_half: the first half takes minus its partner
    if (has_norm) {
      wq = to_f(q_w[d]); wqp = to_f(q_w[p]);
      wk = to_f(k_w[d]); wkp = to_f(k_w[p]);
    }
  }

  // The chunk's first tile: K as 16 keys a warp x 4 dims a lane, V as 32 keys a half-block x 2 dims.
  uint2 kr[16];
  u32 vr[32];
  const int hv = t >> 6, dv = 2 * (t & 63);
#define LOAD_TILE(TS)                                                                           \
  {                                                                                             \
    const i64 base = (i64)bt[(TS) / bs] * bs + ((TS) % bs);                                     \
    _Pragma("unroll") for (int i = 0; i < 16; ++i) {                                            \
      int key = (TS) + 16 * warp + i;                                                           \
      kr[i].x = 0u; kr[i].y = 0u;                                                               \
      if (key < end)                                                                            \
        kr[i] = *(const uint2*)(k_cache + ((base + 16 * warp + i) * nkv + kvh) * D + 4 * lane); \
    }                                                                                           \
    _Pragma("unroll") for (int i = 0; i < 32; ++i) {                                            \
      int key = (TS) + 32 * hv + i;                                                             \
      vr[i] = 0u;                                                                               \
      if (key < end) vr[i] = *(const u32*)(v_cache + ((base + 32 * hv + i) * nkv + kvh) * D + dv); \
    }                                                                                           \
  }

#if PDL
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif

  float m[G], l[G], acc[G][2];
  if (!empty) {
    // ---- q (and the new key, value) after the wait
    float xq[G], xqp[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const u16* row = q + (i64)seq * q_sb + (i64)(kvh * G + g) * q_sh;
      xq[g] = to_f(row[d]);
      xqp[g] = to_f(row[p]);
    }
    float xk = 0.f, xkp = 0.f, xv = 0.f;
    if (subst) {
      const u16* krow = k + (i64)seq * k_sb + (i64)kvh * k_sh;
      xk = to_f(krow[d]);
      xkp = to_f(krow[p]);
      xv = to_f(v[(i64)seq * v_sb + (i64)kvh * v_sh + d]);
    }
    LOAD_TILE(start);  // in flight with the loads above (before the wait it was no faster: docs/performance-notes.md, "Decode attention at one row")
    // sums of squares of the G query heads and the key, across the block
    float sq[G + 1];
#pragma unroll
    for (int g = 0; g < G; ++g) sq[g] = xq[g] * xq[g];
    sq[G] = xk * xk;
#pragma unroll
    for (int g = 0; g <= G; ++g) {
#pragma unroll
      for (int o = 1; o <= 16; o <<= 1) sq[g] += __shfl_xor_sync(FULL, sq[g], o);
    }
    if (lane == 0) {
#pragma unroll
      for (int g = 0; g <= G; ++g) red[warp][g] = sq[g];
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float a = xq[g], b = xqp[g];
      if (has_norm) {
        float r = rsqrtf((red[0][g] + red[1][g] + red[2][g] + red[3][g]) / D + q_eps);
        a = a * r * wq;
        b = b * r * wqp;
      }
      qs[g][d] = rnd(a * c + b * s);  // rounded where rope_store would store it
    }
    if (subst) {
      float a = xk, b = xkp;
      if (has_norm) {
        float r = rsqrtf((red[0][G] + red[1][G] + red[2][G] + red[3][G]) / D + k_eps);
        a = a * r * wk;
        b = b * r * wkp;
      }
      u16 kb = from_f(a * c + b * s);
      knew[d] = to_f(kb);
      vnew[d] = xv;
      const i64 at = (slot * nkv + kvh) * D + d;
      k_cache[at] = kb;
      v_cache[at] = from_f(xv);
    }
    __syncthreads();

    float qf[G][4];
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int j = 0; j < 4; ++j) qf[g][j] = qs[g][4 * lane + j];
    }
#pragma unroll
    for (int g = 0; g < G; ++g) { m[g] = NEG_INF; l[g] = 0.f; acc[g][0] = acc[g][1] = 0.f; }

    for (int ts = start; ts < end; ts += BN) {
      // ---- scores of the warp's 16 keys for the G heads, 4 dims a lane, then reduced across lanes
      float sc[NS];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        int key = ts + 16 * warp + i;
        float kf[4];
        if (subst && key == new_i) {
#pragma unroll
          for (int j = 0; j < 4; ++j) kf[j] = knew[4 * lane + j];
        } else {
          kf[0] = to_f(kr[i].x & 0xffffu); kf[1] = to_f(kr[i].x >> 16);
          kf[2] = to_f(kr[i].y & 0xffffu); kf[3] = to_f(kr[i].y >> 16);
        }
#pragma unroll
        for (int g = 0; g < G; ++g)
          sc[i * G + g] = qf[g][0] * kf[0] + qf[g][1] * kf[1] + qf[g][2] * kf[2] + qf[g][3] * kf[3];
      }
      reduce_scores(sc, lane);
      float tmax[G];
#pragma unroll
      for (int g = 0; g < G; ++g) tmax[g] = NEG_INF;
#pragma unroll
      for (int j = 0; j < NR; ++j) {
        int f = flat_index(lane, j), key = ts + 16 * warp + f / G;
        sc[j] = key < end ? sc[j] * scale_log2 : NEG_INF;
      }
      // each lane's values belong to heads (flat % G); the lane-bit-0 / j pattern is the same on
      // every lane of equal bit 0, so reduce per value slot, then publish by the lanes 0 and 1
      float vmax[NR];
#pragma unroll
      for (int j = 0; j < NR; ++j) vmax[j] = lane_max(sc[j]);
      if (lane < 2 && (G > 1 || lane == 0)) {
#pragma unroll
        for (int j = 0; j < NR; ++j) redm[warp][flat_index(lane, j) % G] = vmax[j];
      }
      __syncthreads();
      float mnew[G], alpha[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        tmax[g] = fmaxf(fmaxf(redm[0][g], redm[1][g]), fmaxf(redm[2][g], redm[3][g]));
        mnew[g] = fmaxf(m[g], tmax[g]);
        alpha[g] = exp2f(m[g] - mnew[g]);  // 0 on the first tile (m = -inf, mnew finite)
      }
      float pv[NR];
#pragma unroll
      for (int j = 0; j < NR; ++j) {
        int f = flat_index(lane, j);
        pv[j] = exp2f(sc[j] - mnew[f % G]);
        ps[f % G][16 * warp + f / G] = rnd(pv[j]);  // P @ V takes p in v's dtype
      }
      float vsum[NR];
#pragma unroll
      for (int j = 0; j < NR; ++j) vsum[j] = lane_sum(pv[j]);
      if (lane < 2 && (G > 1 || lane == 0)) {
#pragma unroll
        for (int j = 0; j < NR; ++j) redl[warp][flat_index(lane, j) % G] = vsum[j];
      }
      __syncthreads();
      // ---- P @ V: this thread's 2 dims over its half's 32 keys
#pragma unroll
      for (int g = 0; g < G; ++g) {
        l[g] = l[g] * alpha[g] + (redl[0][g] + redl[1][g] + redl[2][g] + redl[3][g]);
        m[g] = mnew[g];
        acc[g][0] *= alpha[g];
        acc[g][1] *= alpha[g];
      }
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        int key = ts + 32 * hv + i;
        float v0, v1;
        if (subst && key == new_i) {
          v0 = vnew[dv]; v1 = vnew[dv + 1];
        } else {
          v0 = to_f(vr[i] & 0xffffu); v1 = to_f(vr[i] >> 16);
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float pg = ps[g][32 * hv + i];
          acc[g][0] += pg * v0;
          acc[g][1] += pg * v1;
        }
      }
      if (ts + BN < end) {
        __syncthreads();  // ps, redm, redl are rewritten by the next tile
        LOAD_TILE(ts + BN);
      }
    }
    // the two halves' sums
    if (hv == 1) {
#pragma unroll
      for (int g = 0; g < G; ++g) { accx[g][dv] = acc[g][0]; accx[g][dv + 1] = acc[g][1]; }
    }
    __syncthreads();
    if (hv == 0) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        acc[g][0] = (acc[g][0] + accx[g][dv]) * inv;
        acc[g][1] = (acc[g][1] + accx[g][dv + 1]) * inv;
      }
    }
  }

  const i64 head0 = (i64)seq * H + (i64)kvh * G;
  if (nsplit == 1) {  // the chunk is the context: store the output
    if (hv == 0) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        u16* o = out + (i64)seq * o_sb + (i64)(kvh * G + g) * o_sh + dv;
        o[0] = from_f(empty ? 0.f : acc[g][0]);
        o[1] = from_f(empty ? 0.f : acc[g][1]);
      }
    }
    return;
  }
  if (!empty) {
    if (hv == 0) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float* po = partial_out + ((head0 + g) * nsplit + split) * D + dv;
        po[0] = acc[g][0];
        po[1] = acc[g][1];
        if (t == 0) partial_lse[(head0 + g) * nsplit + split] = m[g] + log2f(l[g]);
      }
    }
  }
  __syncthreads();
  if (t == 0) {
    // release of every thread's partial (ordered before by the barrier), acquire of the others'
    int prev;
    asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(prev) : "l"(counters + seq * nkv + kvh) : "memory");
    is_last = prev == nsplit - 1;
    if (is_last) counters[seq * nkv + kvh] = 0;  // ready for the next call (kernel boundaries order calls)
  }
  __syncthreads();
  if (!is_last) return;

  // ---- the combine: this thread's G dims of one head over the used chunks, 16 chunks a round of loads
  const int num_used = kv_len > 0 ? (kv_len + max(split_len, BN) - 1) / max(split_len, BN) : 0;
  const int tg = t / (NT / G), d0 = (t % (NT / G)) * G;
  const i64 row0 = (head0 + tg) * nsplit;
  float M = NEG_INF, total = 0.f, o[G];
#pragma unroll
  for (int j = 0; j < G; ++j) o[j] = 0.f;
  for (int s0 = 0; s0 < num_used; s0 += 16) {
    float lse[16], part[16][G];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      bool used = s0 + r < num_used;
      lse[r] = used ? __ldcg(partial_lse + row0 + s0 + r) : NEG_INF;
#pragma unroll
      for (int j = 0; j < G; ++j) part[r][j] = used ? __ldcg(partial_out + (row0 + s0 + r) * D + d0 + j) : 0.f;
    }
    float mn = M;
#pragma unroll
    for (int r = 0; r < 16; ++r) mn = fmaxf(mn, lse[r]);
    float scale = exp2f(M - mn);  // 0 on the first round
    total *= scale;
#pragma unroll
    for (int j = 0; j < G; ++j) o[j] *= scale;
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float w = exp2f(lse[r] - mn);
      total += w;
#pragma unroll
      for (int j = 0; j < G; ++j) o[j] += w * part[r][j];
    }
    M = mn;
  }
  float inv = total > 0.f ? 1.f / total : 0.f;
  u16* orow = out + (i64)seq * o_sb + (i64)(kvh * G + tg) * o_sh + d0;
#pragma unroll
  for (int j = 0; j < G; ++j) orow[j] = from_f(o[j] * inv);
}
