// hgca from C++17: a vLLM-layout paged cache with a shuffled block table,
// one batched sparse decode on a shared CPU backend, its shards run on
// std::threads (the caller's own pool), and a hybrid layer's decode loop.
// Handles are held by std::unique_ptr with hgca's free functions.
#include "hgca.h"

#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

void check(hgca_status s, const char* what) {
    if (s != HGCA_OK) throw std::runtime_error(std::string(what) + ": " + hgca_last_error());
}

struct CpuFree {
    void operator()(hgca_cpu* p) const { hgca_cpu_free(p); }
};
struct HybridFree {
    void operator()(hgca_hybrid* p) const { hgca_hybrid_free(p); }
};

}  // namespace

int main() {
    constexpr size_t kv_heads = 2, q_heads = 8, d = 64, block = 16, blocks = 64, batch = 4;
    const hgca_shape shape{sizeof(hgca_shape), q_heads, kv_heads, d, 0.0f};
    // vLLM CPU cache (2, blocks, kv_heads, block, d), random values.
    std::vector<float> cache(2 * blocks * kv_heads * block * d);
    unsigned x = 1;
    for (auto& c : cache) c = static_cast<float>((x = x * 1664525u + 1013904223u) >> 8) / 16777216.0f - 0.5f;
    // 4 sequences of different lengths on pages handed out in a shuffled order.
    std::vector<uint32_t> order(blocks);
    std::iota(order.begin(), order.end(), 0u);
    for (size_t i = blocks - 1; i > 0; --i) std::swap(order[i], order[(i * 7919u) % (i + 1)]);
    const uint32_t lens[batch] = {200, 17, 64, 150};
    const size_t max_blocks = 13;
    std::vector<uint32_t> table(batch * max_blocks, 0);
    size_t next = 0;
    for (size_t b = 0; b < batch; ++b)
        for (size_t p = 0; p < (lens[b] + block - 1) / block; ++p) table[b * max_blocks + p] = order[next++];

    hgca_paged_cache kv{};
    kv.size = sizeof kv;
    kv.dtype = HGCA_DTYPE_F32;
    kv.layout = HGCA_KV_VLLM_CPU;
    kv.k = cache.data();
    kv.k_len = cache.size();
    kv.num_blocks = blocks;
    kv.block_size = block;
    kv.kv_heads = kv_heads;
    kv.head_dim = d;
    hgca_block_table bt{};
    bt.size = sizeof bt;
    bt.kind = HGCA_TABLE_DENSE;
    bt.batch = batch;
    bt.table = table.data();
    bt.max_blocks = max_blocks;
    bt.seq_lens = lens;

    hgca_cpu* raw = nullptr;
    check(hgca_cpu_new(0, &raw), "hgca_cpu_new");
    std::unique_ptr<hgca_cpu, CpuFree> cpu(raw);

    std::vector<float> q(batch * q_heads * d, 0.25f), out(batch * q_heads * d), lse(batch * q_heads);
    hgca_outputs o{sizeof(hgca_outputs), out.data(), out.size(), lse.data(), lse.size(),
                   HGCA_LSE_BASE_2, HGCA_LSE_TOKENS_HEADS, nullptr, 0};
    check(hgca_decode_batch(cpu.get(), &shape, q.data(), q.size(), &kv, &bt, nullptr, 0, &o), "decode");

    // The same call as 3 shards on 3 threads, each writing its own rows.
    std::vector<float> sout(out.size()), slse(lse.size());
    std::vector<std::thread> pool;
    for (size_t ith = 0; ith < 3; ++ith) {
        pool.emplace_back([&, ith] {
            size_t first = 0, count = 0;
            check(hgca_shard_rows(&shape, batch, ith, 3, &first, &count), "shard rows");
            hgca_outputs so{sizeof(hgca_outputs), sout.data() + first * d, count * d, slse.data() + first, count,
                            HGCA_LSE_BASE_2, HGCA_LSE_TOKENS_HEADS, nullptr, 0};
            check(hgca_decode_batch_shard(cpu.get(), ith, 3, &shape, q.data(), q.size(), &kv, &bt, nullptr, 0, &so),
                  "shard");
        });
    }
    for (auto& t : pool) t.join();
    if (sout != out || slse != lse) throw std::runtime_error("shards differ from the whole call");
    std::printf("paged decode of %zu sequences on %s: lse2[0] = %.4f, shards agree\n", batch, hgca_cpu_isa(cpu.get()),
                static_cast<double>(lse[0]));

    // A hybrid layer: window 64, blocks of 16, f16 KV.
    hgca_hybrid_config cfg{};
    check(hgca_hybrid_config_default(&cfg), "config");
    cfg.window = 64;
    cfg.block = 16;
    hgca_hybrid* hraw = nullptr;
    check(hgca_hybrid_new(&shape, &cfg, &hraw), "hybrid");
    std::unique_ptr<hgca_hybrid, HybridFree> layer(hraw);
    std::vector<float> k(kv_heads * d), v(kv_heads * d), qo(q_heads * d), ho(q_heads * d);
    for (int step = 0; step < 300; ++step) {
        for (size_t i = 0; i < k.size(); ++i) {
            k[i] = std::sin(0.01f * static_cast<float>(step * 131 + static_cast<int>(i)));
            v[i] = std::cos(0.02f * static_cast<float>(step + static_cast<int>(i)));
        }
        for (size_t i = 0; i < qo.size(); ++i) qo[i] = std::sin(0.3f * static_cast<float>(i + static_cast<size_t>(step)));
        check(hgca_hybrid_forward(layer.get(), qo.data(), qo.size(), k.data(), k.size(), v.data(), v.size(), 1,
                                  ho.data(), ho.size()),
              "forward");
    }
    hgca_step_stats st{};
    st.size = sizeof st;
    check(hgca_hybrid_stats(layer.get(), &st), "stats");
    std::printf("hybrid layer: %zu tokens on the CPU, %zu in the window, %zu CPU entries attended in the last step\n",
                st.cpu_tokens, st.window_tokens, st.selected);
    return 0;
}
