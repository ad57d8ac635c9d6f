// CriticalKV's projected value norms on a CPU with AMX, fused: ||V_i W^q||_1 for every token i and query head q,
// without writing the (t, hidden) product out. value_norm_amx.py compiles and calls it (see its docstring).
//
// The product is taken transposed, (W^q)^T V^T: 16 rows of o_proj's weight (16 output features j, 32 of query head
// q's d inputs each) make one AMX tile, and 16 tokens' values, rearranged into AMX's pairwise layout, the other. Each
// 16 x 16 float32 product tile (features x tokens) goes to a 1 KiB buffer that stays in L1, and AVX-512 adds the
// absolute values of its rows to registers of 16 tokens' sums. The weight's tiles are first copied out contiguously
// (a strided tile load of its rows ran at half the speed for head_dim 128), once per call. bfloat16 times bfloat16
// is exact in float32 and the tiles accumulate in float32, so the norms are the float32 ones up to the order of the
// sums.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TOKENS 16   // tokens per tile (its columns: 16 float32 = 64 bytes a row)
#define FEATURES 16 // output features per tile (its rows)
#define PAIRS 16    // pairs of bfloat16 inputs per tile row (64 bytes)
#define TILE 512    // bfloat16 values in a tile (1 KiB)

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

// Asks the kernel for the AMX tile state (Linux grants it per process); 0 on success.
int ckv_amx_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

static void configure(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) {
        config.rows[i] = 16;
        config.colsb[i] = 64;
    }
    _tile_loadconfig(&config);
}

// The 16 tokens' values in AMX's pairwise layout, one 1 KiB tile per 32 inputs (h): tile h's row r holds, for each
// token n, the pair of inputs (h * 32 + 2r, h * 32 + 2r + 1): out[h][r][n] = pairs[n][h * 16 + r], 4 bytes each.
// Tokens past `rows` are zeros.
static void pack_tokens(const uint32_t *pairs, uint32_t *out, int rows, int64_t halves) {
    memset(out, 0, (size_t)halves * PAIRS * TOKENS * sizeof(uint32_t));
    for (int n = 0; n < rows; n++)
        for (int64_t h = 0; h < halves; h++)
            for (int r = 0; r < PAIRS; r++) out[(h * PAIRS + r) * TOKENS + n] = pairs[n * halves * PAIRS + h * PAIRS + r];
}

// sums[c % 4] += |row| for the 16 rows of the product tile in `product` (4 chains: the adds' latency overlaps).
static inline void add_abs_rows(const float *product, __m512 sums[4]) {
    for (int m = 0; m < FEATURES; m += 4)
        for (int c = 0; c < 4; c++)
            sums[c] = _mm512_add_ps(sums[c], _mm512_abs_ps(_mm512_load_ps(product + (m + c) * TOKENS)));
}

// Query head q's norms of the 16 tokens in tiles 0..HALVES-1: the weight's rows through tiles A0 and A1, the product
// in tile C (tile numbers are literals). Leaves the 16 sums in `total`.
#define NORMS_OF_HEAD(HALVES, A0, A1, C)                                                                               \
    do {                                                                                                               \
        __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};         \
        const uint16_t *w = tiles_of_weight + q * blocks * HALVES * TILE;                                              \
        for (int64_t jb = 0; jb < blocks; jb++, w += HALVES * TILE) {                                                  \
            _tile_zero(C);                                                                                             \
            _tile_loadd(A0, w, 64);                                                                                    \
            _tile_dpbf16ps(C, A0, 0);                                                                                  \
            _tile_loadd(A1, w + TILE, 64);                                                                             \
            _tile_dpbf16ps(C, A1, 1);                                                                                  \
            if (HALVES == 4) {                                                                                         \
                _tile_loadd(A0, w + 2 * TILE, 64);                                                                     \
                _tile_dpbf16ps(C, A0, 2);                                                                              \
                _tile_loadd(A1, w + 3 * TILE, 64);                                                                     \
                _tile_dpbf16ps(C, A1, 3);                                                                              \
            }                                                                                                          \
            _tile_stored(C, product, 64);                                                                              \
            add_abs_rows(product, sums);                                                                               \
        }                                                                                                              \
        total = _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3]));                       \
    } while (0)

// values (heads, t, d) bfloat16, contiguous, heads = b * h_kv; weight (hidden, h_q * d) bfloat16, contiguous (o_proj's);
// scratch: room for as many bfloat16 values as the weight; out (heads, t, groups) float32:
// out[i, token, g] = ||V[i, token] W^q||_1 with q = (i % h_kv) * groups + g and W^q[k][j] = weight[j][q * d + k].
// d is 64 or 128, hidden a multiple of 16. Returns 0, or -1 for a d it does not handle.
int ckv_value_norms(const uint16_t *values, const uint16_t *weight, uint16_t *scratch, float *out, int64_t heads,
                    int64_t h_kv, int64_t t, int64_t d, int64_t groups, int64_t hidden, int threads) {
    if (d != 64 && d != 128) return -1;
    const int64_t blocks = hidden / FEATURES, tiles = (t + TOKENS - 1) / TOKENS, in = h_kv * groups * d;
    const int64_t halves = d / (2 * PAIRS);
    const uint16_t *tiles_of_weight = scratch;
#pragma omp parallel num_threads(threads)
    {
        // the weight's tiles, contiguous in the order the loop below reads them: (q, jb, h), each 16 rows x 32 inputs
#pragma omp for schedule(static)
        for (int64_t qj = 0; qj < h_kv * groups * blocks; qj++) {
            const int64_t q = qj / blocks, jb = qj % blocks;
            for (int64_t h = 0; h < halves; h++)
                for (int m = 0; m < FEATURES; m++)
                    memcpy(scratch + (qj * halves + h) * TILE + m * 2 * PAIRS,
                           weight + (jb * FEATURES + m) * in + q * d + h * 2 * PAIRS, 2 * PAIRS * sizeof(uint16_t));
        }
        configure();
        uint32_t packed[4 * PAIRS * TOKENS] __attribute__((aligned(64)));
        float product[FEATURES * TOKENS] __attribute__((aligned(64)));
        float norms[TOKENS] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < heads * tiles; task++) {
            const int64_t i = task / tiles, first = (task % tiles) * TOKENS, kv = i % h_kv;
            const int rows = (int)(t - first < TOKENS ? t - first : TOKENS);
            pack_tokens((const uint32_t *)(values + (i * t + first) * d), packed, rows, halves);
            for (int64_t h = 0; h < halves; h++) {
                switch (h) {  // tile numbers are literals
                case 0: _tile_loadd(0, packed, 64); break;
                case 1: _tile_loadd(1, packed + PAIRS * TOKENS, 64); break;
                case 2: _tile_loadd(2, packed + 2 * PAIRS * TOKENS, 64); break;
                case 3: _tile_loadd(3, packed + 3 * PAIRS * TOKENS, 64); break;
                }
            }
            for (int64_t g = 0; g < groups; g++) {
                const int64_t q = kv * groups + g;
                __m512 total;
                if (d == 64)
                    NORMS_OF_HEAD(2, 4, 5, 6);
                else
                    NORMS_OF_HEAD(4, 4, 5, 6);
                _mm512_store_ps(norms, total);
                for (int n = 0; n < rows; n++) out[((i * t) + first + n) * groups + g] = norms[n];
            }
        }
        _tile_release();
    }
    return 0;
}
