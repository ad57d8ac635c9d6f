// CriticalKV's projected value norms on a CPU with AMX, fused: ||V_i W^q||_1 for every token i and query head q,
// without writing the (t, hidden) product out. value_norm_amx.py compiles and calls it (see its docstring).
//
// The product is taken transposed, (W^q)^T V^T: 16 rows of o_proj's weight (16 output features j, 32 of query head
// q's d inputs each) make one AMX tile, and 16 tokens' values, rearranged into AMX's pairwise layout, the other. Each
// 16 x 16 float32 product tile (features x tokens) goes to a 1 KiB buffer that stays in L1, and AVX-512 adds the
// absolute values of its rows to registers of 16 tokens' sums. The weight's tiles are first copied out contiguously
// (a strided tile load of its rows ran at half the speed for head_dim 128), once per call, and each load of them
// serves 4 tiles of tokens (one served 16 tokens at half the speed for head_dim 128, where a KV head's weight
// outgrows the L2 cache). bfloat16 times bfloat16 is exact in float32 and the tiles accumulate in float32, so the
// norms are the float32 ones up to the order of the sums.
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
#define SHARING 4   // token tiles that share each load of the weight's tiles

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

// sums[m % 2] += |row m| for the 16 rows of the product tile in `product` (2 chains: the adds' latency overlaps).
static inline void add_abs_rows(const float *product, __m512 sums[2]) {
    for (int m = 0; m < FEATURES; m += 2) {
        sums[0] = _mm512_add_ps(sums[0], _mm512_abs_ps(_mm512_load_ps(product + m * TOKENS)));
        sums[1] = _mm512_add_ps(sums[1], _mm512_abs_ps(_mm512_load_ps(product + (m + 1) * TOKENS)));
    }
}

// C (tile 6) = the weight's tiles 0..halves-1 times one token tile's values (`tokens`, through tiles 4 and 5).
static inline void product_tile(const uint32_t *tokens, int64_t halves) {
    _tile_zero(6);
    _tile_loadd(4, tokens, 64);
    _tile_dpbf16ps(6, 0, 4);
    _tile_loadd(5, tokens + PAIRS * TOKENS, 64);
    _tile_dpbf16ps(6, 1, 5);
    if (halves == 4) {
        _tile_loadd(4, tokens + 2 * PAIRS * TOKENS, 64);
        _tile_dpbf16ps(6, 2, 4);
        _tile_loadd(5, tokens + 3 * PAIRS * TOKENS, 64);
        _tile_dpbf16ps(6, 3, 5);
    }
}

// values (heads, t, d) bfloat16, contiguous, heads = b * h_kv; weight (hidden, h_q * d) bfloat16, contiguous (o_proj's);
// scratch: room for as many bfloat16 values as the weight (its tiles, copied out contiguously); out (heads, t, groups) float32:
// out[i, token, g] = ||V[i, token] W^q||_1 with q = (i % h_kv) * groups + g and W^q[k][j] = weight[j][q * d + k].
// d is 64 or 128, hidden a multiple of 16. Returns 0, or -1 for a d it does not handle.
int ckv_value_norms(const uint16_t *values, const uint16_t *weight, uint16_t *scratch, float *out, int64_t heads,
                    int64_t h_kv, int64_t t, int64_t d, int64_t groups, int64_t hidden, int threads) {
    if (d != 64 && d != 128) return -1;
    const int64_t blocks = hidden / FEATURES, in = h_kv * groups * d;
    const int64_t groups_of_tiles = (t + SHARING * TOKENS - 1) / (SHARING * TOKENS);
    const int64_t halves = d / (2 * PAIRS);
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
        uint32_t packed[SHARING * 4 * PAIRS * TOKENS] __attribute__((aligned(64)));
        float product[FEATURES * TOKENS] __attribute__((aligned(64)));
        float norms[TOKENS] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < heads * groups_of_tiles; task++) {
            const int64_t i = task / groups_of_tiles, first = (task % groups_of_tiles) * SHARING * TOKENS;
            const int64_t kv = i % h_kv, left = t - first;
            const int count = (int)(left < SHARING * TOKENS ? (left + TOKENS - 1) / TOKENS : SHARING);
            int rows[SHARING];
            for (int tt = 0; tt < count; tt++) {
                rows[tt] = (int)(left - tt * TOKENS < TOKENS ? left - tt * TOKENS : TOKENS);
                pack_tokens((const uint32_t *)(values + (i * t + first + tt * TOKENS) * d),
                            packed + tt * halves * PAIRS * TOKENS, rows[tt], halves);
            }
            for (int64_t g = 0; g < groups; g++) {
                const int64_t q = kv * groups + g;
                __m512 sums[SHARING][2];
                for (int tt = 0; tt < SHARING; tt++) sums[tt][0] = sums[tt][1] = _mm512_setzero_ps();
                const uint16_t *w = scratch + q * blocks * halves * TILE;
                for (int64_t jb = 0; jb < blocks; jb++, w += halves * TILE) {
                    _tile_loadd(0, w, 64);  // the weight's tiles stay for every token tile of the group
                    _tile_loadd(1, w + TILE, 64);
                    if (halves == 4) {
                        _tile_loadd(2, w + 2 * TILE, 64);
                        _tile_loadd(3, w + 3 * TILE, 64);
                    }
                    for (int tt = 0; tt < count; tt++) {
                        product_tile(packed + tt * halves * PAIRS * TOKENS, halves);
                        _tile_stored(6, product, 64);
                        add_abs_rows(product, sums[tt]);
                    }
                }
                for (int tt = 0; tt < count; tt++) {
                    _mm512_store_ps(norms, _mm512_add_ps(sums[tt][0], sums[tt][1]));
                    for (int n = 0; n < rows[tt]; n++) out[(i * t + first + tt * TOKENS + n) * groups + g] = norms[n];
                }
            }
        }
        _tile_release();
    }
    return 0;
}
