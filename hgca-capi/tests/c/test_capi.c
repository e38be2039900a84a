/* The C ABI's test: every public function, against a double-precision
 * reference written here, and the bad-input table. Built by
 * scripts/capi.sh with -std=c11 -Wall -Wextra -pedantic -Werror and
 * -fsanitize=address,undefined, linked to the static library. */
#include "hgca.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int passed, failed;

#define CHECK(cond, ...)                                              \
    do {                                                              \
        if (cond) {                                                   \
            passed++;                                                 \
        } else {                                                      \
            failed++;                                                 \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);               \
            printf(__VA_ARGS__);                                      \
            printf(" (last error: %s)\n", hgca_last_error());         \
        }                                                             \
    } while (0)

#define OK(call) CHECK((call) == HGCA_OK, "%s", #call)

/* SplitMix64, values in [-1, 1). */
static uint64_t rng_state = 12345;
static double rnd(void) {
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) / (double)(1ull << 53) * 2.0 - 1.0;
}
static size_t below(size_t n) { return (size_t)((rnd() + 1.0) * 0.5 * (double)n) % n; }

/* Reference: softmax attention of q [d] over rows (keys k[j*ks], values v[j*vs])
 * of the token list `set`, in double. out[d], returns the natural lse. */
typedef const float *(*row_fn)(const void *ctx, size_t h, size_t j, int value);
static double ref_attend(const float *q, size_t d, double scale, row_fn row, const void *ctx,
                         size_t h, const uint32_t *set, size_t n, double *out) {
    double m = -INFINITY, l = 0.0;
    for (size_t c = 0; c < d; c++) out[c] = 0.0;
    if (n == 0) return -INFINITY;
    double *s = malloc(n * sizeof *s);
    for (size_t i = 0; i < n; i++) {
        const float *k = row(ctx, h, set[i], 0);
        double acc = 0.0;
        for (size_t c = 0; c < d; c++) acc += (double)q[c] * (double)k[c];
        s[i] = acc * scale;
        if (s[i] > m) m = s[i];
    }
    for (size_t i = 0; i < n; i++) {
        double w = exp(s[i] - m);
        const float *v = row(ctx, h, set[i], 1);
        l += w;
        for (size_t c = 0; c < d; c++) out[c] += w * (double)v[c];
    }
    for (size_t c = 0; c < d; c++) out[c] /= l;
    free(s);
    return m + log(l);
}

/* ------------------------------------------------------------ a vLLM CPU cache */

enum { HK = 2, QH = 4, D = 8, BS = 16, NB = 20, B = 3 };
static float cache[2 * NB * HK * BS * D];
static uint32_t table[B * 8];
static uint32_t seq_lens[B] = {70, 1, 33};

typedef struct { size_t seq; } seq_ctx;

static const float *vllm_row(const void *ctx, size_t h, size_t j, int value) {
    size_t b = ((const seq_ctx *)ctx)->seq;
    size_t page = table[b * 8 + j / BS];
    size_t off = ((page * HK + h) * BS + j % BS) * D;
    return cache + (value ? (size_t)NB * HK * BS * D : 0) + off;
}

static void build_cache(void) {
    for (size_t i = 0; i < sizeof cache / sizeof cache[0]; i++) cache[i] = NAN;
    uint32_t order[NB];
    for (uint32_t i = 0; i < NB; i++) order[i] = i;
    for (size_t i = NB - 1; i > 0; i--) {
        size_t j = below(i + 1);
        uint32_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    size_t next = 0;
    for (size_t b = 0; b < B; b++) {
        size_t pages = (seq_lens[b] + BS - 1) / BS;
        for (size_t p = 0; p < 8; p++) table[b * 8 + p] = p < pages ? order[next++] : 999; /* padding: never read */
        for (size_t j = 0; j < seq_lens[b]; j++) {
            seq_ctx c = {b};
            for (size_t h = 0; h < HK; h++) {
                float *k = (float *)vllm_row(&c, h, j, 0), *v = (float *)vllm_row(&c, h, j, 1);
                for (size_t x = 0; x < D; x++) {
                    k[x] = (float)rnd();
                    v[x] = (float)rnd() + 0.25f;
                }
            }
        }
    }
}

static hgca_paged_cache cache_desc(void) {
    hgca_paged_cache c;
    memset(&c, 0, sizeof c);
    c.size = sizeof c;
    c.dtype = HGCA_DTYPE_F32;
    c.layout = HGCA_KV_VLLM_CPU;
    c.k = cache;
    c.k_len = sizeof cache / sizeof cache[0];
    c.num_blocks = NB;
    c.block_size = BS;
    c.kv_heads = HK;
    c.head_dim = D;
    return c;
}

static hgca_block_table table_desc(void) {
    hgca_block_table t;
    memset(&t, 0, sizeof t);
    t.size = sizeof t;
    t.kind = HGCA_TABLE_DENSE;
    t.batch = B;
    t.table = table;
    t.max_blocks = 8;
    t.seq_lens = seq_lens;
    return t;
}

static const hgca_shape shape = {sizeof(hgca_shape), QH, HK, D, 0.0f};

static int close_to(double got, double want, double tol) {
    if (isinf(want)) return got == want;
    return fabs(got - want) <= tol * (1.0 + fabs(want));
}

/* ------------------------------------------------------------ tests */

static void test_version(void) {
    CHECK(hgca_version() == ((HGCA_VERSION_MAJOR << 16) | (HGCA_VERSION_MINOR << 8) | HGCA_VERSION_PATCH),
          "version %u", (unsigned)hgca_version());
    CHECK(strcmp(hgca_version_string(), "0.1.0") == 0, "version string %s", hgca_version_string());
}

/* Two partials of a split token set, merged, equal the reference over the union (both bases, both layouts). */
static void test_merge(void) {
    enum { T = 2, H = 3, DD = 5, N = 9 };
    float k[N * DD], v[N * DD], q[T * H * DD];
    for (size_t i = 0; i < N * DD; i++) { k[i] = (float)rnd(); v[i] = (float)rnd(); }
    for (size_t i = 0; i < T * H * DD; i++) q[i] = (float)(2.0 * rnd());
    /* rows of a flat [N, DD] K and V */
    struct flat { const float *k, *v; } f = {k, v};
    uint32_t a[] = {0, 2, 5, 7}, bb[] = {1, 3, 4, 6, 8}, all[] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    for (unsigned base = 0; base < 2; base++) {
        for (unsigned lay = 0; lay < 2; lay++) {
            float oa[T * H * DD], ob[T * H * DD], la[T * H], lb[T * H], o[T * H * DD], l[T * H];
            double want_o[T * H][DD], want_l[T * H];
            for (size_t t = 0; t < T; t++) {
                for (size_t h = 0; h < H; h++) {
                    size_t r = t * H + h, li = lay == HGCA_LSE_TOKENS_HEADS ? r : h * T + t;
                    const float *qr = q + r * DD;
                    double tmp[DD];
                    /* inline reference over three sets */
                    const uint32_t *sets[3] = {a, bb, all};
                    size_t ns[3] = {4, 5, 9};
                    for (int s = 0; s < 3; s++) {
                        double m = -INFINITY, sum = 0, sc[N];
                        for (size_t i = 0; i < ns[s]; i++) {
                            double acc = 0;
                            for (size_t c = 0; c < DD; c++) acc += (double)qr[c] * f.k[sets[s][i] * DD + c];
                            sc[i] = acc / sqrt((double)DD);
                            if (sc[i] > m) m = sc[i];
                        }
                        for (size_t c = 0; c < DD; c++) tmp[c] = 0;
                        for (size_t i = 0; i < ns[s]; i++) {
                            double w = exp(sc[i] - m);
                            sum += w;
                            for (size_t c = 0; c < DD; c++) tmp[c] += w * f.v[sets[s][i] * DD + c];
                        }
                        double lse = m + log(sum);
                        double lse_b = base == HGCA_LSE_BASE_2 ? lse / log(2.0) : lse;
                        for (size_t c = 0; c < DD; c++) {
                            double x = tmp[c] / sum;
                            if (s == 0) oa[r * DD + c] = (float)x;
                            if (s == 1) ob[r * DD + c] = (float)x;
                            if (s == 2) want_o[r][c] = x;
                        }
                        if (s == 0) la[li] = (float)lse_b;
                        if (s == 1) lb[li] = (float)lse_b;
                        if (s == 2) want_l[li] = lse_b;
                    }
                }
            }
            hgca_state parts[2] = {{oa, T * H * DD, la, T * H}, {ob, T * H * DD, lb, T * H}};
            OK(hgca_merge(parts, 2, T, H, DD, base, lay, o, T * H * DD, l, T * H));
            int good = 1;
            for (size_t r = 0; r < T * H; r++) {
                good &= close_to(l[r], want_l[r], 1e-5);
                for (size_t c = 0; c < DD; c++) good &= close_to(o[r * DD + c], want_o[r][c], 1e-5);
            }
            CHECK(good, "merge base %u layout %u equals the reference over the union", base, lay);
            /* in place: a <- merge(a, b) */
            hgca_state src = {ob, T * H * DD, lb, T * H};
            OK(hgca_merge_into(oa, T * H * DD, la, T * H, &src, T, H, DD, base, lay));
            good = 1;
            for (size_t r = 0; r < T * H * DD; r++) good &= oa[r] == o[r] || close_to(oa[r], o[r], 1e-6);
            for (size_t r = 0; r < T * H; r++) good &= close_to(la[r], l[r], 1e-6);
            CHECK(good, "merge_into base %u layout %u equals the N-way merge", base, lay);
        }
    }
    /* Two empty partials: (0, -inf), never NaN. */
    float eo[DD] = {0}, el[1] = {-INFINITY}, fo[DD] = {0}, fl[1] = {-INFINITY}, mo[DD], ml[1];
    hgca_state e2[2] = {{eo, DD, el, 1}, {fo, DD, fl, 1}};
    OK(hgca_merge(e2, 2, 1, 1, DD, HGCA_LSE_BASE_2, HGCA_LSE_TOKENS_HEADS, mo, DD, ml, 1));
    CHECK(ml[0] == -INFINITY && mo[0] == 0.0f && !isnan(mo[DD - 1]), "two empty partials give (0, -inf)");
}

/* Batched paged decode (sparse and dense) over the vLLM cache against the reference. */
static void test_decode(hgca_cpu *cpu) {
    hgca_paged_cache c = cache_desc();
    hgca_block_table t = table_desc();
    float q[B * QH * D];
    for (size_t i = 0; i < B * QH * D; i++) q[i] = (float)(1.5 * rnd());
    /* selections: every other token of KV head 0, a random third of head 1 */
    uint32_t idx[B][2 * 70];
    size_t offs[B][HK + 1];
    hgca_selection sels[B];
    for (size_t b = 0; b < B; b++) {
        size_t n = 0;
        offs[b][0] = 0;
        for (uint32_t j = 0; j < seq_lens[b]; j += 2) idx[b][n++] = j;
        offs[b][1] = n;
        for (uint32_t j = 0; j < seq_lens[b]; j++)
            if (below(3) == 0) idx[b][n++] = j;
        offs[b][2] = n;
        sels[b].indices = idx[b];
        sels[b].indices_len = n;
        sels[b].offsets = offs[b];
        sels[b].offsets_len = HK + 1;
    }
    for (int sparse = 0; sparse < 2; sparse++) {
        for (unsigned base = 0; base < 2; base++) {
            float out[B * QH * D], lse[B * QH];
            hgca_outputs o = {sizeof o, out, B * QH * D, lse, B * QH, base, HGCA_LSE_HEADS_TOKENS, NULL, 0};
            OK(hgca_decode_batch(cpu, &shape, q, B * QH * D, &c, &t, sparse ? sels : NULL, B, &o));
            int good = 1;
            for (size_t b = 0; b < B; b++) {
                seq_ctx ctx = {b};
                for (size_t h = 0; h < QH; h++) {
                    size_t g = h / (QH / HK);
                    uint32_t allset[70];
                    for (uint32_t j = 0; j < 70; j++) allset[j] = j;
                    const uint32_t *set = sparse ? idx[b] + offs[b][g] : allset;
                    size_t n = sparse ? offs[b][g + 1] - offs[b][g] : seq_lens[b];
                    double ro[D];
                    double rl = ref_attend(q + (b * QH + h) * D, D, 1.0 / sqrt((double)D), vllm_row, &ctx, g, set, n, ro);
                    if (base == HGCA_LSE_BASE_2) rl /= log(2.0);
                    good &= close_to(lse[h * B + b], rl, 1e-5); /* vLLM layout [heads, tokens] */
                    for (size_t x = 0; x < D; x++) good &= close_to(out[(b * QH + h) * D + x], ro[x], 1e-5);
                }
            }
            CHECK(good, "paged decode (sparse %d, base %u) equals the reference", sparse, base);
        }
    }
    /* Shards on the caller's "pool": each shard alone, concatenated, equals the whole call. */
    float whole[B * QH * D], wl[B * QH], parts[B * QH * D], pl[B * QH];
    hgca_outputs o = {sizeof o, whole, B * QH * D, wl, B * QH, HGCA_LSE_BASE_E, HGCA_LSE_TOKENS_HEADS, NULL, 0};
    OK(hgca_decode_batch(cpu, &shape, q, B * QH * D, &c, &t, sels, B, &o));
    size_t nth = 4;
    for (size_t ith = 0; ith < nth; ith++) {
        size_t first = 0, count = 0;
        OK(hgca_shard_rows(&shape, B, ith, nth, &first, &count));
        hgca_outputs so = {sizeof so, parts + first * D, count * D, pl + first, count, HGCA_LSE_BASE_E, HGCA_LSE_TOKENS_HEADS, NULL, 0};
        OK(hgca_decode_batch_shard(cpu, ith, nth, &shape, q, B * QH * D, &c, &t, sels, B, &so));
    }
    CHECK(memcmp(whole, parts, sizeof whole) == 0 && memcmp(wl, pl, sizeof wl) == 0, "4 shards equal the whole call");
    /* Weights: each attended entry's softmax weight; sparse weights of a shard are its part. */
    size_t wfirst = 0, wcount = 0;
    OK(hgca_shard_weights(&shape, &c, &t, sels, B, 0, 1, &wfirst, &wcount));
    float *w = malloc(wcount * sizeof *w);
    o.weights = w;
    o.weights_len = wcount;
    OK(hgca_decode_batch(cpu, &shape, q, B * QH * D, &c, &t, sels, B, &o));
    double sum = 0;
    size_t group = QH / HK, n0 = offs[0][1];
    for (size_t i = 0; i < n0; i++) sum += w[i]; /* sequence 0, KV head 0, its first query head */
    CHECK(wfirst == 0 && close_to(sum, 1.0, 1e-5), "weights of a head sum to 1 (%f, %zu)", sum, group);
    free(w);
}

static void test_append(hgca_cpu *cpu) {
    hgca_paged_cache c = cache_desc();
    hgca_block_table t = table_desc();
    enum { NQ = 5 };
    float q[NQ * QH * D], out[NQ * QH * D], lse[NQ * QH];
    for (size_t i = 0; i < NQ * QH * D; i++) q[i] = (float)rnd();
    size_t visible0 = seq_lens[0] - NQ + 1;
    hgca_outputs o = {sizeof o, out, NQ * QH * D, lse, NQ * QH, HGCA_LSE_BASE_E, HGCA_LSE_TOKENS_HEADS, NULL, 0};
    OK(hgca_append_attention(cpu, &shape, q, NQ, visible0, &c, &t, 0, &o));
    int good = 1;
    seq_ctx ctx = {0};
    uint32_t set[70];
    for (uint32_t j = 0; j < 70; j++) set[j] = j;
    for (size_t i = 0; i < NQ; i++)
        for (size_t h = 0; h < QH; h++) {
            double ro[D];
            double rl = ref_attend(q + (i * QH + h) * D, D, 1.0 / sqrt((double)D), vllm_row, &ctx, h / 2, set, visible0 + i, ro);
            good &= close_to(lse[i * QH + h], rl, 1e-5);
            for (size_t x = 0; x < D; x++) good &= close_to(out[(i * QH + h) * D + x], ro[x], 1e-5);
        }
    CHECK(good, "causal append equals the reference");
}

static void test_selection(hgca_cpu *cpu) {
    hgca_paged_cache c = cache_desc();
    hgca_block_table t = table_desc();
    hgca_page_bounds *pb = NULL;
    OK(hgca_page_bounds_new(&c, &pb));
    OK(hgca_page_bounds_update(pb, &c, &t, 0));
    float q[QH * D];
    for (size_t i = 0; i < QH * D; i++) q[i] = (float)rnd();
    size_t pages = (seq_lens[0] + BS - 1) / BS;
    float ub[HK * 8];
    OK(hgca_page_upper_bounds(cpu, &shape, q, QH * D, &c, &t, 0, pb, ub, HK * pages));
    /* every score of every key of a page is under its bound */
    int good = 1;
    seq_ctx ctx = {0};
    for (size_t h = 0; h < QH; h++)
        for (size_t j = 0; j < seq_lens[0]; j++) {
            const float *k = vllm_row(&ctx, h / 2, j, 0);
            double s = 0;
            for (size_t x = 0; x < D; x++) s += (double)q[h * D + x] * k[x];
            s /= sqrt((double)D);
            good &= s <= ub[(h / 2) * pages + j / BS] + 1e-5;
        }
    CHECK(good, "page bounds bound every key");
    uint32_t sel[HK * 70];
    size_t offs[HK + 1];
    hgca_selection_out so = {sel, HK * 70, offs, HK + 1, 0};
    OK(hgca_select_top_pages(ub, HK * pages, HK, pages, BS, seq_lens[0], 2, &so));
    size_t top = so.written;
    /* two pages per head: of 16 tokens, or one of them the last page (6 tokens) */
    good = offs[0] == 0 && offs[HK] == top;
    for (size_t g = 0; g < HK; g++) {
        size_t n = offs[g + 1] - offs[g];
        good &= n == 32 || n == 16 + 6;
        for (size_t i = offs[g] + 1; i < offs[g + 1]; i++) good &= sel[i] > sel[i - 1];
        /* the pages taken have the highest bounds */
        float lowest_taken = INFINITY, highest_left = -INFINITY;
        for (size_t p = 0; p < pages; p++) {
            int taken = 0;
            for (size_t i = offs[g]; i < offs[g + 1]; i++) taken |= sel[i] / BS == p;
            if (taken && ub[g * pages + p] < lowest_taken) lowest_taken = ub[g * pages + p];
            if (!taken && ub[g * pages + p] > highest_left) highest_left = ub[g * pages + p];
        }
        good &= lowest_taken >= highest_left;
    }
    CHECK(good, "top-2 pages per head, in token order, the highest bounds: %zu", top);
    hgca_head_mass rep[HK];
    OK(hgca_select_by_mass(ub, HK * pages, HK, pages, BS, seq_lens[0], 1.0f, 1.0f, &so, rep, HK));
    CHECK(so.written == HK * seq_lens[0] && rep[0].pages == pages, "mass 1.0 takes every page");
    /* too small a buffer: HGCA_CAPACITY and the count needed */
    hgca_selection_out tiny = {sel, 3, offs, HK + 1, 0};
    CHECK(hgca_select_top_pages(ub, HK * pages, HK, pages, BS, seq_lens[0], 2, &tiny) == HGCA_CAPACITY && tiny.written == top,
          "a short selection buffer says how much is needed");
    /* MAW update and the threshold rule */
    float maw[HK * 10];
    for (size_t i = 0; i < HK * 10; i++) maw[i] = 0.1f * (float)(i % 10);
    uint32_t at[2] = {3, 12};
    float wts[2] = {1.0f, 1.0f};
    OK(hgca_maw_update_gather(maw, HK * 10, at, wts, 2, 0.5f));
    CHECK(close_to(maw[3], 0.5 * 0.3 + 0.5, 1e-6) && close_to(maw[12], 0.5 * 0.2 + 0.5, 1e-6), "maw update");
    uint32_t past[2] = {3, HK * 10};
    CHECK(hgca_maw_update_gather(maw, HK * 10, past, wts, 2, 0.5f) == HGCA_INDEX && strstr(hgca_last_error(), "idx") &&
              close_to(maw[3], 0.5 * 0.3 + 0.5, 1e-6),
          "an index past the MAW is refused, naming idx, and nothing is written");
    float betas[HK] = {1.0f, 1.0f};
    hgca_selection_out ts = {sel, HK * 70, offs, HK + 1, 0};
    OK(hgca_select_threshold(maw, HK * 10, HK, 10, betas, 2, &ts));
    /* threshold 0.5: head 0 keeps 0.6..0.9 and maw[3] = 0.65; head 1 keeps maw[12] = 0.6 and 0.6..0.9 */
    CHECK(offs[1] == 5 && ts.written == 10, "threshold select: %zu then %zu", offs[1], ts.written);
    /* A page handed to another owner: reset, then the bounds follow the new keys. */
    seq_ctx ctx0 = {0};
    float *k0 = (float *)vllm_row(&ctx0, 0, 0, 0);
    float saved0 = k0[0];
    k0[0] = 100.0f;
    OK(hgca_page_bounds_update(pb, &c, &t, 0));
    uint32_t p0 = table[0];
    OK(hgca_page_bounds_reset(pb, p0));
    OK(hgca_page_bounds_update(pb, &c, &t, 0));
    float qe[QH * D] = {0};
    qe[0] = 1.0f; /* head 0 (KV head 0) scores k[0] / sqrt(D) */
    OK(hgca_page_upper_bounds(cpu, &shape, qe, QH * D, &c, &t, 0, pb, ub, HK * pages));
    CHECK(ub[0] >= 100.0 / sqrt((double)D) - 1e-4, "reset page bounds follow the new keys: %f", ub[0]);
    k0[0] = saved0;
    CHECK(hgca_page_bounds_reset(NULL, 0) == HGCA_NULL_POINTER, "reset of a null handle");
    hgca_page_bounds_free(pb);
}

/* A hybrid layer under `cfg` that attends every entry: full attention, step by step. */
static void run_hybrid(const hgca_hybrid_config *cfg_in, const char *what) {
    hgca_hybrid_config cfg = *cfg_in;
    hgca_hybrid *h = NULL;
    OK(hgca_hybrid_new(&shape, &cfg, &h));
    enum { STEPS = 40 };
    static float ks[STEPS][HK * D], vs[STEPS][HK * D];
    int good = 1;
    for (size_t s = 0; s < STEPS; s++) {
        float q[QH * D], out[QH * D];
        for (size_t i = 0; i < HK * D; i++) { ks[s][i] = (float)rnd(); vs[s][i] = (float)rnd(); }
        for (size_t i = 0; i < QH * D; i++) q[i] = (float)(2.0 * rnd());
        if (s % 2 == 0) {
            OK(hgca_hybrid_forward(h, q, QH * D, ks[s], HK * D, vs[s], HK * D, 1, out, QH * D));
        } else {
            OK(hgca_hybrid_append(h, ks[s], HK * D, vs[s], HK * D, 1));
            OK(hgca_hybrid_attend(h, q, QH * D, out, QH * D));
        }
        for (size_t hq = 0; hq < QH; hq++) {
            size_t g = hq / 2;
            double m = -INFINITY, l = 0, sc[STEPS], ro[D] = {0};
            for (size_t j = 0; j <= s; j++) {
                double a = 0;
                for (size_t x = 0; x < D; x++) a += (double)q[hq * D + x] * ks[j][g * D + x];
                sc[j] = a / sqrt((double)D);
                if (sc[j] > m) m = sc[j];
            }
            for (size_t j = 0; j <= s; j++) {
                double w = exp(sc[j] - m);
                l += w;
                for (size_t x = 0; x < D; x++) ro[x] += w * vs[j][g * D + x];
            }
            for (size_t x = 0; x < D; x++) good &= close_to(out[hq * D + x], ro[x] / l, 1e-4);
        }
    }
    CHECK(good, "hybrid decode loop equals full attention (%s)", what);
    size_t len = 0;
    OK(hgca_hybrid_len(h, &len));
    hgca_step_stats st;
    memset(&st, 0, sizeof st);
    st.size = sizeof st;
    OK(hgca_hybrid_stats(h, &st));
    CHECK(len == STEPS && st.cpu_tokens + st.window_tokens == STEPS && st.cpu_tokens > 0,
          "len %zu, cpu %zu, window %zu", len, st.cpu_tokens, st.window_tokens);
    if (cfg.recovery == HGCA_RECOVERY_MASS) {
        CHECK(st.mass_estimated > 0.999f && st.mass_estimated <= 1.0f && st.selected == HK * st.cpu_tokens,
              "mass selector, target 1: estimate %g, %zu of %zu entries", (double)st.mass_estimated, st.selected,
              HK * st.cpu_tokens);
    } else {
        CHECK(isnan(st.mass_estimated), "no mass estimate under another rule: %g", (double)st.mass_estimated);
    }
    hgca_hybrid_free(h);
}

static void test_hybrid(void) {
    hgca_hybrid_config cfg;
    OK(hgca_hybrid_config_default(&cfg));
    CHECK(cfg.recovery == HGCA_RECOVERY_MASS && cfg.mass_target > 0.0f && cfg.mass_target <= 1.0f,
          "the default rule is the mass selector (%u, target %g)", cfg.recovery, (double)cfg.mass_target);
    cfg.dtype = HGCA_DTYPE_F32;
    cfg.window = 16;
    cfg.block = 4;
    cfg.threads = 1;
    /* The sinks cover everything, under the frozen rule. */
    cfg.sinks = 1000;
    cfg.recovery = HGCA_RECOVERY_FROZEN;
    run_hybrid(&cfg, "all entries are sinks");
    /* The mass selector with target 1 leaves out no entry of nonzero weight. */
    cfg.sinks = 4;
    cfg.recovery = HGCA_RECOVERY_MASS;
    cfg.mass_target = 1.0f;
    cfg.mass_max_share = 1.0f;
    run_hybrid(&cfg, "mass target 1");
}

static int has(const char *msg, const char *word) { return strstr(msg, word) != NULL; }

static void test_bad_input(hgca_cpu *cpu) {
    hgca_paged_cache c = cache_desc();
    hgca_block_table t = table_desc();
    float q[B * QH * D] = {0}, out[B * QH * D], lse[B * QH];
    hgca_outputs o = {sizeof o, out, B * QH * D, lse, B * QH, HGCA_LSE_BASE_E, HGCA_LSE_TOKENS_HEADS, NULL, 0};
    /* null handle, null output struct, null output buffer */
    CHECK(hgca_decode_batch(NULL, &shape, q, B * QH * D, &c, &t, NULL, 0, &o) == HGCA_NULL_POINTER && has(hgca_last_error(), "cpu"), "null cpu");
    CHECK(hgca_decode_batch(cpu, &shape, q, B * QH * D, &c, &t, NULL, 0, NULL) == HGCA_NULL_POINTER, "null outputs");
    hgca_outputs nul = o;
    nul.out = NULL;
    CHECK(hgca_decode_batch(cpu, &shape, q, B * QH * D, &c, &t, NULL, 0, &nul) == HGCA_NULL_POINTER && has(hgca_last_error(), "out"), "null out");
    CHECK(hgca_cpu_new(1, NULL) == HGCA_NULL_POINTER, "null out handle");
    /* wrong lengths */
    CHECK(hgca_decode_batch(cpu, &shape, q, B * QH * D - 1, &c, &t, NULL, 0, &o) == HGCA_LENGTH && has(hgca_last_error(), "q"), "short q: %s", hgca_last_error());
    hgca_outputs shortl = o;
    shortl.lse_len = 1;
    CHECK(hgca_decode_batch(cpu, &shape, q, B * QH * D, &c, &t, NULL, 0, &shortl) == HGCA_LENGTH && has(hgca_last_error(), "lse"), "short lse");
    hgca_paged_cache sc = c;
    sc.k_len -= 1;
    CHECK(hgca_decode_batch(cpu, &shape, q, B * QH * D, &sc, &t, NULL, 0, &o) == HGCA_LENGTH && has(hgca_last_error(), "kv_cache"), "short cache");
    /* block index out of range */
    uint32_t saved = table[1];
    table[1] = NB;
    CHECK(hgca_decode_batch(cpu, &shape, q, B * QH * D, &c, &t, NULL, 0, &o) == HGCA_INDEX && has(hgca_last_error(), "block_table page"), "block index out of range: %s", hgca_last_error());
    table[1] = saved;
    /* seq_len beyond the table row */
    uint32_t saved_len = seq_lens[1];
    seq_lens[1] = 8 * BS + 1;
    CHECK(hgca_decode_batch(cpu, &shape, q, B * QH * D, &c, &t, NULL, 0, &o) == HGCA_CAPACITY, "seq_len beyond the table");
    seq_lens[1] = saved_len;
    /* a selected token past its sequence */
    uint32_t bad_idx[1] = {5};
    size_t bad_off[HK + 1] = {0, 1, 1};
    uint32_t none[1] = {0};
    size_t none_off[HK + 1] = {0, 0, 0};
    hgca_selection bs[B] = {{none, 0, none_off, HK + 1}, {bad_idx, 1, bad_off, HK + 1}, {none, 0, none_off, HK + 1}};
    CHECK(hgca_decode_batch(cpu, &shape, q, B * QH * D, &c, &t, bs, B, &o) == HGCA_INDEX && has(hgca_last_error(), "selected token"), "selection past seq_len");
    /* NaN beta */
    hgca_hybrid_config cfg;
    OK(hgca_hybrid_config_default(&cfg));
    cfg.beta = NAN;
    hgca_hybrid *h = NULL;
    CHECK(hgca_hybrid_new(&shape, &cfg, &h) == HGCA_PARAM && h == NULL && has(hgca_last_error(), "beta"), "NaN beta: %s", hgca_last_error());
    OK(hgca_hybrid_config_default(&cfg));
    cfg.recovery = HGCA_RECOVERY_MASS;
    cfg.mass_target = 1.5f;
    CHECK(hgca_hybrid_new(&shape, &cfg, &h) == HGCA_PARAM && h == NULL && has(hgca_last_error(), "mass target"),
          "mass target 1.5: %s", hgca_last_error());
    OK(hgca_hybrid_config_default(&cfg));
    float betas[HK] = {NAN, 1.0f}, maw[HK] = {0};
    uint32_t sel[4];
    size_t offs[HK + 1];
    hgca_selection_out so = {sel, 4, offs, HK + 1, 0};
    CHECK(hgca_select_threshold(maw, HK, HK, 1, betas, 1, &so) == HGCA_PARAM, "NaN beta in the threshold rule");
    /* a struct of an older, smaller size; unknown enum values */
    hgca_shape small = shape;
    small.size = 4;
    CHECK(hgca_decode_batch(cpu, &small, q, B * QH * D, &c, &t, NULL, 0, &o) == HGCA_ABI && has(hgca_last_error(), "sizeof"), "size field");
    /* A truly smaller (older) struct: only its size is read (ASan sees any read past it). */
    uint32_t *older = malloc(sizeof *older);
    *older = sizeof *older;
    CHECK(hgca_decode_batch(cpu, (const hgca_shape *)(const void *)older, q, B * QH * D, &c, &t, NULL, 0, &o) == HGCA_ABI,
          "an older, smaller struct is refused without reading past it");
    free(older);
    hgca_paged_cache bad_layout = c;
    bad_layout.layout = 99;
    CHECK(hgca_decode_batch(cpu, &shape, q, B * QH * D, &bad_layout, &t, NULL, 0, &o) == HGCA_PARAM, "unknown layout");
    hgca_outputs bad_base = o;
    bad_base.lse_base = 7;
    CHECK(hgca_decode_batch(cpu, &shape, q, B * QH * D, &c, &t, NULL, 0, &bad_base) == HGCA_PARAM, "unknown lse base");
    /* a shard with a [heads, tokens] lse, shard index past nth */
    hgca_outputs vl = o;
    vl.lse_layout = HGCA_LSE_HEADS_TOKENS;
    CHECK(hgca_decode_batch_shard(cpu, 0, 1, &shape, q, B * QH * D, &c, &t, NULL, 0, &vl) == HGCA_PARAM, "shard lse layout");
    size_t first, count;
    CHECK(hgca_shard_rows(&shape, B, 2, 2, &first, &count) == HGCA_INDEX, "ith >= nth");
    /* null layer; free of null is a no-op */
    size_t len;
    CHECK(hgca_hybrid_len(NULL, &len) == HGCA_NULL_POINTER, "null layer");
    hgca_hybrid_free(NULL);
    hgca_cpu_free(NULL);
    hgca_page_bounds_free(NULL);
    /* after a success the message is empty */
    OK(hgca_decode_batch(cpu, &shape, q, B * QH * D, &c, &t, NULL, 0, &o));
    CHECK(hgca_last_error()[0] == '\0', "message cleared");
}

int main(void) {
    build_cache();
    hgca_cpu *cpu = NULL;
    OK(hgca_cpu_new(0, &cpu));
    printf("hgca %s, ISA %s\n", hgca_version_string(), hgca_cpu_isa(cpu));
    test_version();
    test_merge();
    test_decode(cpu);
    test_append(cpu);
    test_selection(cpu);
    test_hybrid();
    test_bad_input(cpu);
    hgca_cpu_free(cpu);
    printf("capi: %d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
