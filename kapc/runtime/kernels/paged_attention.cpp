// Causal attention of a few query tokens per row over a paged KV cache in vLLM-CPU's layout: the
// verification step of speculative decoding (k + 1 query tokens per row).
//
// Why kapc has its own: vLLM-CPU runs one kernel for every query length, and past one query token
// per row it pays per query token (measured on SmolLM2 at 8 rows x 7936 tokens: 2.3x a decode
// step for 2 tokens, 3.2x for 5; docs/vllm.md). Here the query tokens of a row and the query
// heads of a KV group form one tile, so every key and value block is read once for all of them
// and the tile's dot products run as small register-blocked matrix products.
//
// Layouts: cache[block][kv_head] holds BS keys, then BS values.
// - float32 (vLLM-CPU's "vec" ISA): keys head-dim-major (key t, dim d at d * BS + t), values
//   token-major (value t, dim d at HD * BS + t * HD + d).
// - bfloat16 (vLLM-CPU's "amx" ISA, packed for AMX tiles): keys in halves of 16 tokens, each
//   pairs of dims (key t, dim d at ((t / 16) * HD / 2 + d / 2) * 32 + (t % 16) * 2 + d % 2);
//   values in chunks of 16 dims, each pairs of tokens (value t, dim d at HD * BS +
//   ((d / 16) * BS / 2 + t / 2) * 32 + (d % 16) * 2 + t % 2). Those are the operand tiles of AMX's
//   bfloat16 matrix product, so this kernel reads them as they lie: the bfloat16 variant is
//   built only where the CPU has AMX-BF16. Scores, softmax and outputs sum in float32; each
//   block's softmax weights are rounded to bfloat16 before they meet the values, as in vLLM's.
// Query token i of a row with q tokens and seq_len visible tokens sits at index seq_len - q + i
// of the row's sequence and sees the keys at indices 0 .. seq_len - q + i (its own included).
//
// Work is split into items (row, KV head, query chunk, key split), each computing an unnormalised
// partial output with its running maximum and sum (online softmax); a final pass combines a row's
// key splits. Threads: OpenMP, sharing the runtime torch loaded (libgomp.so.1, by soname).
//
// Compiled at first use for this machine (`-march=native`) with HD and BS fixed at compile time;
// kapc/runtime/kernels/__init__.py builds, caches and calls it.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <omp.h>
// the bfloat16 variant: AMX-BF16, and dims and tokens in whole tiles (vLLM-CPU keeps other head
// dims in its "vec16" layout, never this one)
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && \
    defined(HD) && defined(BS) && HD % 32 == 0 && BS % 32 == 0
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KAPC_BF16 1
#endif

#ifndef HD
#error "HD (head dim) must be defined"
#endif
#ifndef BS
#error "BS (block size) must be defined"
#endif

namespace {

constexpr int VL = 8;  // floats per vector register (the compiler maps wider or narrower ISAs)
static_assert(HD % VL == 0 && BS % VL == 0, "HD and BS must be multiples of 8");
constexpr int NV_D = HD / VL;
constexpr int NV_B = BS / VL;
constexpr int MT = 3;     // query rows per score tile: MT * NV_B accumulators stay in registers
constexpr int MAXM = 64;  // query rows (tokens x heads of a KV group) per work item

typedef float v8 __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

inline v8 load(const float* p) { v8 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// exp(x) on 8 lanes (Cephes' single-precision range reduction and polynomial, about 1 ulp)
inline v8 vexp(v8 x) {
  x = x < splat(-87.33654f) ? splat(-87.33654f) : x;
  v8 fx = x * splat(1.44269504088896341f) + splat(0.5f);
  v8 fl = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8);
  fl = fl > fx ? fl - splat(1.0f) : fl;  // floor
  x = x - fl * splat(0.693359375f) + fl * splat(2.12194440e-4f);
  v8 z = x * x;
  v8 y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * z + x + splat(1.0f);
  v8i e = (__builtin_convertvector(fl, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &e, sizeof scale);
  return y * scale;
}

inline float hmax(v8 v) {
  float m = v[0];
  for (int i = 1; i < VL; i++) m = v[i] > m ? v[i] : m;
  return m;
}

inline float hsum(v8 v) {
  float s = 0.f;
  for (int i = 0; i < VL; i++) s += v[i];
  return s;
}

struct Item {
  int row, kv_head, m0, m1, b0, b1;  // query rows [m0, m1) of the group tile, blocks [b0, b1)
};

// s[m][t] = q[m] . key[t] for query rows [m0, m0 + n) of one block (n <= MT)
template <int N>
inline void scores(const float* q, const float* keys, float (*s)[BS], int m0) {
  v8 acc[N][NV_B];
  for (int i = 0; i < N; i++)
    for (int j = 0; j < NV_B; j++) acc[i][j] = splat(0.f);
  for (int d = 0; d < HD; d++) {
    v8 k[NV_B];
    for (int j = 0; j < NV_B; j++) k[j] = load(keys + d * BS + j * VL);
    for (int i = 0; i < N; i++) {
      v8 qd = splat(q[(m0 + i) * HD + d]);
      for (int j = 0; j < NV_B; j++) acc[i][j] += qd * k[j];
    }
  }
  for (int i = 0; i < N; i++)
    for (int j = 0; j < NV_B; j++) store(&s[m0 + i][j * VL], acc[i][j]);
}

// One item: M query rows (row m is query token first_token + m / group) of one row's KV group
// over blocks [b0, b1). Writes the unnormalised output o[M][HD], running max mx[M] and sum sm[M].
void attend(const float* q, int M, int group, int first_token, int q_tokens, int seq_len,
            const float* cache, int64_t block_stride, int64_t head_stride, int kv_head,
            const int32_t* table, int b0, int b1, float* o, float* mx, float* sm) {
  alignas(32) float s[MAXM][BS];
  alignas(32) float p[BS];
  for (int m = 0; m < M; m++) mx[m] = -INFINITY, sm[m] = 0.f;
  std::memset(o, 0, sizeof(float) * M * HD);
  const int first_pos = seq_len - q_tokens;  // sequence index of the row's first query token
  for (int b = b0; b < b1; b++) {
    const float* keys = cache + int64_t(table[b]) * block_stride + int64_t(kv_head) * head_stride;
    const float* values = keys + HD * BS;
    const int t0 = b * BS;
    if (b + 1 < b1) {  // the next block is elsewhere in the pool: start fetching it now
      const char* next = reinterpret_cast<const char*>(
          cache + int64_t(table[b + 1]) * block_stride + int64_t(kv_head) * head_stride);
      for (int off = 0; off < int(2 * HD * BS * sizeof(float)); off += 64)
        __builtin_prefetch(next + off);
    }
    int m = 0;
    for (; m + MT <= M; m += MT) scores<MT>(q, keys, s, m);
    static_assert(MT == 3, "the remainder below handles one or two rows");
    if (M - m == 2) scores<2>(q, keys, s, m);
    if (M - m == 1) scores<1>(q, keys, s, m);
    if (t0 + BS > first_pos + first_token + 1) {  // the causal edge (or the sequence end) is here
      for (int r = 0; r < M; r++) {
        int visible = first_pos + first_token + r / group + 1 - t0;
        for (int t = visible < 0 ? 0 : visible; t < BS; t++) s[r][t] = -INFINITY;
      }
    }
    for (int r = 0; r < M; r++) {
      v8 bm = load(&s[r][0]);
      for (int j = 1; j < NV_B; j++) {
        v8 x = load(&s[r][j * VL]);
        bm = x > bm ? x : bm;
      }
      const float block_max = hmax(bm);
      if (block_max == -INFINITY) continue;  // every key of this block is in this query's future
      const float new_max = block_max > mx[r] ? block_max : mx[r];
      const float correction = std::exp(mx[r] - new_max);
      mx[r] = new_max;
      v8 sum = splat(0.f);
      for (int j = 0; j < NV_B; j++) {
        v8 e = vexp(load(&s[r][j * VL]) - splat(new_max));
        sum += e;
        store(&p[j * VL], e);
      }
      sm[r] = sm[r] * correction + hsum(sum);
      v8 acc[NV_D];
      for (int j = 0; j < NV_D; j++) acc[j] = load(o + r * HD + j * VL) * splat(correction);
      for (int t = 0; t < BS; t++) {
        v8 pt = splat(p[t]);
        for (int j = 0; j < NV_D; j++) acc[j] += pt * load(values + t * HD + j * VL);
      }
      for (int j = 0; j < NV_D; j++) store(o + r * HD + j * VL, acc[j]);
    }
  }
}

// The float32 variant: the query tile is scaled as it is copied in.
struct Float32 {
  using Elem = float;
  static void load_query(const float* src, float* dst, float scale) {
    for (int d = 0; d < HD; d++) dst[d] = src[d] * scale;
  }
  static void store_out(float* dst, const float* acc, float inv) {
    for (int d = 0; d < HD; d++) dst[d] = acc[d] * inv;
  }
  static bool ready() { return true; }
  // key splits: enough items for every thread several times over, none shorter than 8 blocks
  static int64_t split(int64_t head_blocks, int threads) {
    const int64_t s = head_blocks / (4 * threads);
    return s < 8 ? 8 : s > 256 ? 256 : s;
  }
  static void pad_queries(float*, int) {}
  static void done() {}
  static void attend(const float* q, int M, int group, int first_token, int q_tokens, int seq_len,
                     const float* cache, int64_t block_stride, int64_t head_stride, int kv_head,
                     const int32_t* table, int b0, int b1, float, float* o, float* mx, float* sm) {
    ::attend(q, M, group, first_token, q_tokens, seq_len, cache, block_stride, head_stride,
             kv_head, table, b0, b1, o, mx, sm);
  }
};

#ifdef KAPC_BF16
constexpr int NH = BS / 16;  // 16-token halves of a block's keys: one score tile's columns each
constexpr int NP = HD / 2;   // dim pairs of a key
constexpr int NC = HD / 16;  // 16-dim chunks of a value: one output tile's columns each
constexpr int TR = 16;       // rows of a tile

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: tile 0 accumulates, tile 1 holds queries or weights, tile 2
// keys or values. Tile state is per thread; each item loads it and the kernel releases it, so
// other AMX users (oneDNN, vLLM's kernel) configure their own as they always do.
inline void configure_tiles() {
  TileConfig cfg;
  for (int i = 0; i < 3; i++) cfg.colsb[i] = 64, cfg.rows[i] = TR;
  _tile_loadconfig(&cfg);
}

// 2^x lane-wise for x <= 12 (a degree-5 polynomial on the fraction, scaled by the integer part;
// relative error about 2e-7, below the bfloat16 rounding the weights then get)
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(1.8775767e-3f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(8.9893397e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5826318e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4015361e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9315308e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.9999994e-1f));
  return _mm512_scalef_ps(y, n);
}

// The kernel may use AMX's tile data in this process (Linux asks each process to request it).
inline bool tiles_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// One item, as attend() above, over the bfloat16 layout with AMX tiles. q: M rows of HD
// bfloat16 (unscaled), padded with zeros to whole tiles; o: as many rows.
void attend_bf16(const uint16_t* q, int M, int group, int first_token, int q_tokens,
                 int seq_len, const uint16_t* cache, int64_t block_stride, int64_t head_stride,
                 int kv_head, const int32_t* table, int b0, int b1, float scale, float* o,
                 float* mx, float* sm) {
  alignas(64) float s[MAXM][BS];
  alignas(64) uint16_t p[MAXM][BS];  // each row's softmax weights of this block, bfloat16 bits
  alignas(64) __m512 sums[MAXM];     // each row's running sum of weights, lane-wise
  const int tiles = (M + TR - 1) / TR;
  for (int m = 0; m < M; m++) mx[m] = -INFINITY, sums[m] = _mm512_setzero_ps();
  const float slack = 8.f / scale, log2_scale = scale * 1.44269504088896341f;
  std::memset(o, 0, sizeof(float) * tiles * TR * HD);
  std::memset(p, 0, sizeof(uint16_t) * tiles * TR * BS);  // padding rows weigh nothing
  configure_tiles();
  const int first_pos = seq_len - q_tokens;
  for (int b = b0; b < b1; b++) {
    const uint16_t* keys =
        cache + int64_t(table[b]) * block_stride + int64_t(kv_head) * head_stride;
    const uint16_t* values = keys + HD * BS;
    const int t0 = b * BS;
    if (b + 1 < b1) {
      const char* next = reinterpret_cast<const char*>(
          cache + int64_t(table[b + 1]) * block_stride + int64_t(kv_head) * head_stride);
      for (int off = 0; off < int(2 * HD * BS * sizeof(uint16_t)); off += 64)
        __builtin_prefetch(next + off);
    }
    // scores: s[rows of tile r][16 tokens of half h] = q . keys, 32 dims at a time
    for (int r = 0; r < tiles; r++)
      for (int h = 0; h < NH; h++) {
        _tile_zero(0);
        for (int k = 0; k < HD / 32; k++) {
          _tile_loadd(1, q + (r * TR) * HD + k * 32, HD * sizeof(uint16_t));
          _tile_stream_loadd(2, keys + (h * NP + k * 16) * 32, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, &s[r * TR][h * 16], BS * sizeof(float));
      }
    const bool edge = t0 + BS > first_pos + first_token + 1;  // the causal edge is here
    for (int r = 0; r < M; r++) {
      __mmask16 seen[BS / 16];  // the keys this row sees (all but at the causal edge)
      for (int j = 0; j < BS / 16; j++) {
        const int visible = edge ? first_pos + first_token + r / group + 1 - t0 - j * 16 : 16;
        seen[j] = visible >= 16 ? 0xFFFF : visible <= 0 ? 0 : __mmask16((1u << visible) - 1);
      }
      __m512 x[BS / 16];
      __m512 bm = _mm512_set1_ps(-INFINITY);
      for (int j = 0; j < BS / 16; j++) {
        x[j] = _mm512_loadu_ps(&s[r][j * 16]);
        bm = _mm512_mask_max_ps(bm, seen[j], x[j], bm);
      }
      // the running maximum (in raw scores) is raised, and what was summed rescaled, only when
      // a score exceeds it by more than 8 / scale: weights up to e^8 sit well within float32
      // and bfloat16 range, and most blocks skip even finding their maximum
      if (mx[r] == -INFINITY || _mm512_cmp_ps_mask(bm, _mm512_set1_ps(mx[r] + slack), _CMP_GT_OQ)) {
        const float block_max = _mm512_reduce_max_ps(bm);
        if (block_max == -INFINITY) {  // every key of this block is in this query's future
          std::memset(p[r], 0, sizeof p[r]);
          continue;
        }
        if (block_max > mx[r] + slack) {
          const float corr = std::exp((mx[r] - block_max) * scale);
          mx[r] = block_max;
          sums[r] = _mm512_mul_ps(sums[r], _mm512_set1_ps(corr));
          for (int d = 0; d < HD; d += 16)
            _mm512_storeu_ps(o + r * HD + d,
                             _mm512_mul_ps(_mm512_loadu_ps(o + r * HD + d), _mm512_set1_ps(corr)));
        }
      }
      const __m512 shift = _mm512_set1_ps(-mx[r] * log2_scale);
      for (int j = 0; j < BS / 16; j++) {
        // e^((x - max) * scale) = 2^(x * scale * log2(e) - max * scale * log2(e))
        const __m512 e = _mm512_maskz_mov_ps(
            seen[j], exp2_ps(_mm512_fmadd_ps(x[j], _mm512_set1_ps(log2_scale), shift)));
        sums[r] = _mm512_add_ps(sums[r], e);
        const __m256bh eb = _mm512_cvtneps_pbh(e);
        std::memcpy(&p[r][j * 16], &eb, sizeof eb);
      }
    }
    // o[rows of tile r][16 dims of chunk c] += p . values, 32 tokens at a time
    for (int r = 0; r < tiles; r++)
      for (int c = 0; c < NC; c++) {
        _tile_loadd(0, o + (r * TR) * HD + c * 16, HD * sizeof(float));
        for (int g = 0; g < BS / 32; g++) {
          _tile_loadd(1, &p[r * TR][g * 32], BS * sizeof(uint16_t));
          _tile_stream_loadd(2, values + (c * (BS / 2) + g * 16) * 32, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, o + (r * TR) * HD + c * 16, HD * sizeof(float));
      }
  }
  for (int r = 0; r < M; r++) {
    sm[r] = _mm512_reduce_add_ps(sums[r]);
    mx[r] *= scale;  // the combine below takes maxima in scaled scores
  }
}

// The bfloat16 variant: queries and outputs are bfloat16; scores are scaled in float32.
struct BFloat16 {
  using Elem = uint16_t;
  static void load_query(const uint16_t* src, uint16_t* dst, float) {
    std::memcpy(dst, src, sizeof(uint16_t) * HD);
  }
  static bool ready() { return tiles_permitted(); }
  // key splits of a fixed 128 blocks, whatever else the step holds: a query's output then
  // depends on its own row's keys alone, bit for bit, as vLLM's does (a step of other rows or
  // more query tokens must not round a row's bfloat16 output otherwise)
  static int64_t split(int64_t, int) { return 128; }
  static void pad_queries(uint16_t* q, int M) {  // zero rows up to a whole tile
    const int tiles = (M + TR - 1) / TR;
    std::memset(q + M * HD, 0, sizeof(uint16_t) * (tiles * TR - M) * HD);
  }
  static void done() { _tile_release(); }
  static void store_out(uint16_t* dst, const float* acc, float inv) {
    for (int c = 0; c < NC; c++) {
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + c * 16),
                                                          _mm512_set1_ps(inv)));
      std::memcpy(dst + c * 16, &r, sizeof r);
    }
  }
  static void attend(const uint16_t* q, int M, int group, int first_token, int q_tokens,
                     int seq_len, const uint16_t* cache, int64_t block_stride,
                     int64_t head_stride, int kv_head, const int32_t* table, int b0, int b1,
                     float scale, float* o, float* mx, float* sm) {
    attend_bf16(q, M, group, first_token, q_tokens, seq_len, cache, block_stride, head_stride,
                kv_head, table, b0, b1, scale, o, mx, sm);
  }
};
#endif

// Returns 0, or -1 when a row's group of query heads cannot form a tile (group > MAXM), -2 when
// scratch memory cannot be allocated, -3 when K cannot run here (AMX tiles refused). Strides are
// in elements.
template <class K, class E = typename K::Elem>
int run(const E* query, int64_t q_token_stride, int64_t q_head_stride, E* out,
        int64_t o_token_stride, int64_t o_head_stride, const E* cache, int64_t block_stride,
        int64_t head_stride, const int32_t* query_start_loc, const int32_t* seq_lens, int rows,
        const int32_t* block_table, int64_t table_stride, int heads, int kv_heads, float scale) {
  const int group = heads / kv_heads;
  if (group > MAXM) return -1;
  if (!K::ready()) return -3;
  const int tokens_per_tile = MAXM / group;
  int64_t total_blocks = 0;
  for (int r = 0; r < rows; r++) total_blocks += (seq_lens[r] + BS - 1) / BS;
  const int threads = omp_get_max_threads();
  const int64_t split = K::split(total_blocks * kv_heads, threads);

  int n_items = 0;
  for (int r = 0; r < rows; r++) {
    const int qt = query_start_loc[r + 1] - query_start_loc[r];
    const int nb = (seq_lens[r] + BS - 1) / BS;
    if (qt <= 0 || nb <= 0) continue;
    n_items += kv_heads * ((qt + tokens_per_tile - 1) / tokens_per_tile) * int((nb + split - 1) / split);
  }
  Item* items = static_cast<Item*>(std::malloc(sizeof(Item) * (n_items ? n_items : 1)));
  const int64_t item_floats = int64_t(MAXM) * (HD + 2);
  float* partial = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * item_floats * (n_items ? n_items : 1)));
  if (items == nullptr || partial == nullptr) {
    std::free(items);
    std::free(partial);
    return -2;
  }
  int n = 0;
  for (int r = 0; r < rows; r++) {
    const int qt = query_start_loc[r + 1] - query_start_loc[r];
    const int nb = (seq_lens[r] + BS - 1) / BS;
    if (qt <= 0 || nb <= 0) continue;
    for (int g = 0; g < kv_heads; g++)
      for (int t0 = 0; t0 < qt; t0 += tokens_per_tile) {
        const int t1 = t0 + tokens_per_tile < qt ? t0 + tokens_per_tile : qt;
        for (int b0 = 0; b0 < nb; b0 += split)
          items[n++] = Item{r, g, t0 * group, t1 * group, b0, int(b0 + split < nb ? b0 + split : nb)};
      }
  }

  // Rows whose prompts share a prefix (a server's prefix cache) read the same blocks: each item
  // runs right after the first item that starts at the same block for the same KV head and query
  // tile, so what that item read is still in the CPU's caches. Rows that share nothing keep their
  // order, and items keep their places (the combine below needs a row's splits side by side);
  // only the order they run in changes.
  int* order = static_cast<int*>(std::malloc(sizeof(int) * 2 * (n_items ? n_items : 1)));
  if (order == nullptr) {
    std::free(items);
    std::free(partial);
    return -2;
  }
  int* first = order + n_items;  // the first item reading item i's blocks
  auto start_block = [&](const Item& it) {
    return block_table[int64_t(it.row) * table_stride + it.b0];
  };
  auto same_reads = [&](const Item& x, const Item& y) {
    return x.b0 == y.b0 && x.kv_head == y.kv_head && x.m0 == y.m0 &&
           start_block(x) == start_block(y);
  };
  for (int i = 0; i < n_items; i++) order[i] = i;
  std::sort(order, order + n_items, [&](int a, int b) {
    const Item& x = items[a];
    const Item& y = items[b];
    if (x.b0 != y.b0) return x.b0 < y.b0;
    if (x.kv_head != y.kv_head) return x.kv_head < y.kv_head;
    if (x.m0 != y.m0) return x.m0 < y.m0;
    const int32_t px = start_block(x), py = start_block(y);
    return px != py ? px < py : a < b;
  });
  for (int k = 0; k < n_items; k++)
    first[order[k]] = k > 0 && same_reads(items[order[k]], items[order[k - 1]])
                          ? first[order[k - 1]]
                          : order[k];
  for (int i = 0; i < n_items; i++) order[i] = i;
  std::sort(order, order + n_items, [&](int a, int b) {
    return first[a] != first[b] ? first[a] < first[b] : a < b;
  });

#pragma omp parallel
  {
#pragma omp for schedule(dynamic, 1) nowait
    for (int k = 0; k < n_items; k++) {
      const int i = order[k];
      const Item& it = items[i];
      const int qt = query_start_loc[it.row + 1] - query_start_loc[it.row];
      const int M = it.m1 - it.m0;
      alignas(64) E q[MAXM * HD];
      for (int m = 0; m < M; m++) {
        const int token = (it.m0 + m) / group, h = it.kv_head * group + (it.m0 + m) % group;
        K::load_query(query + int64_t(query_start_loc[it.row] + token) * q_token_stride +
                          int64_t(h) * q_head_stride,
                      q + m * HD, scale);
      }
      K::pad_queries(q, M);
      float* o = partial + int64_t(i) * item_floats;
      K::attend(q, M, group, it.m0 / group, qt, seq_lens[it.row], cache, block_stride,
                head_stride, it.kv_head, block_table + int64_t(it.row) * table_stride, it.b0,
                it.b1, scale, o, o + int64_t(MAXM) * HD, o + int64_t(MAXM) * HD + MAXM);
    }
    K::done();
  }

  // combine each query row's key splits (consecutive items with the same row, head and tile)
  for (int i = 0; i < n_items;) {
    int j = i + 1;
    while (j < n_items && items[j].row == items[i].row && items[j].kv_head == items[i].kv_head &&
           items[j].m0 == items[i].m0)
      j++;
    const Item& it = items[i];
    for (int m = 0; m < it.m1 - it.m0; m++) {
      float top = -INFINITY;
      for (int k = i; k < j; k++) {
        const float x = partial[int64_t(k) * item_floats + int64_t(MAXM) * HD + m];
        top = x > top ? x : top;
      }
      alignas(32) float acc[HD] = {};
      float den = 0.f;
      for (int k = i; k < j; k++) {
        const float* o = partial + int64_t(k) * item_floats;
        const float x = o[int64_t(MAXM) * HD + m];
        if (x == -INFINITY) continue;
        const float w = std::exp(x - top);
        den += w * o[int64_t(MAXM) * HD + MAXM + m];
        for (int d = 0; d < HD; d++) acc[d] += w * o[m * HD + d];
      }
      const int token = (it.m0 + m) / group, h = it.kv_head * group + (it.m0 + m) % group;
      K::store_out(out + int64_t(query_start_loc[it.row] + token) * o_token_stride +
                       int64_t(h) * o_head_stride,
                   acc, 1.f / den);
    }
    i = j;
  }
  std::free(order);
  std::free(items);
  std::free(partial);
  return 0;
}

}  // namespace

extern "C" {

int kapc_head_dim() { return HD; }
int kapc_block_size() { return BS; }

// Attention over vLLM-CPU's float32 "vec" layout; see run() for the return codes.
int kapc_paged_attention(const float* query, int64_t q_token_stride, int64_t q_head_stride,
                         float* out, int64_t o_token_stride, int64_t o_head_stride,
                         const float* cache, int64_t block_stride, int64_t head_stride,
                         const int32_t* query_start_loc, const int32_t* seq_lens, int rows,
                         const int32_t* block_table, int64_t table_stride, int heads,
                         int kv_heads, float scale) {
  return run<Float32>(query, q_token_stride, q_head_stride, out, o_token_stride, o_head_stride, cache,
                        block_stride, head_stride, query_start_loc, seq_lens, rows, block_table,
                        table_stride, heads, kv_heads, scale);
}

// Whether kapc_paged_attention_bf16 was built (the CPU has AMX-BF16).
int kapc_has_bf16() {
#ifdef KAPC_BF16
  return 1;
#else
  return 0;
#endif
}

// Attention over vLLM-CPU's bfloat16 "amx" layout (bfloat16 bits as uint16); -3 where the CPU
// has no AMX-BF16 or the process may not use its tiles.
int kapc_paged_attention_bf16(const uint16_t* query, int64_t q_token_stride,
                              int64_t q_head_stride, uint16_t* out, int64_t o_token_stride,
                              int64_t o_head_stride, const uint16_t* cache, int64_t block_stride,
                              int64_t head_stride, const int32_t* query_start_loc,
                              const int32_t* seq_lens, int rows, const int32_t* block_table,
                              int64_t table_stride, int heads, int kv_heads, float scale) {
#ifdef KAPC_BF16
  return run<BFloat16>(query, q_token_stride, q_head_stride, out, o_token_stride, o_head_stride, cache,
                        block_stride, head_stride, query_start_loc, seq_lens, rows, block_table,
                        table_stride, heads, kv_heads, scale);
#else
  return -3;
#endif
}

}  // extern "C"
