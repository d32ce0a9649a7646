/* kvcopy: the CPU copy engine's inner loop in C (loaded with ctypes, so every call runs without the GIL).
 *
 * A job is a list of byte runs (engine bytes <-> host bytes) and, with checksums, the sub-blocks ("slots") of
 * host memory whose xxh3_64 digests the store records or the load verifies. kvcopy_job runs a whole job in one
 * call: it orders the runs and slots by host offset, cuts the job into granules at slot boundaries and copies
 * them on the calling thread and the helper threads of a kvcopy_pool (each takes the next granules when it is
 * free, so a thread slowed by other work on the machine takes fewer), hashing every slot while its bytes pass
 * through the registers (see kv_blocks): the hash needs no second pass over the bytes.
 *
 * Built up to three times by setup.py: the baseline build and, on x86-64, one with AVX2 and one with AVX-512F
 * (the copy-and-hash loop in vector registers, non-temporal stores for long jobs); Python picks the widest build
 * that kvcopy_cpu_has_avx2() / kvcopy_cpu_has_avx512() of the baseline build say the CPU (and OS) can run.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "third_party/xxhash/xxhash.h"

#if defined(__GNUC__)
#define KV_EXPORT __attribute__((visibility("default")))
#define KV_INLINE static inline __attribute__((always_inline))
#else
#define KV_EXPORT
#define KV_INLINE static inline
#endif

KV_EXPORT int kvcopy_abi_version(void) { return 4; }

KV_EXPORT int kvcopy_cpu_has_avx2(void) {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

/* libgcc's check includes the OS side (XCR0 saves the ZMM state). */
KV_EXPORT int kvcopy_cpu_has_avx512(void) {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 1 : 0;
#else
    return 0;
#endif
}

/* Which copy-and-hash loop this build has: 2 AVX-512F, 1 AVX2 (both hash in registers, can stream), 0 the
 * portable one (copies 1 KB, hashes it from L1). */
KV_EXPORT int kvcopy_vector_width(void) {
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

KV_EXPORT uint64_t kvcopy_xxh3_64(const void *data, int64_t size) { return XXH3_64bits(data, (size_t)size); }

static void copy_runs(int64_t lo, int64_t hi, const int64_t *dst, const int64_t *src, const int64_t *len) {
    for (int64_t i = lo; i < hi; i++) {
        memmove((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], (size_t)len[i]);
    }
}

KV_EXPORT void kvcopy_copy(int64_t nruns, const int64_t *dst, const int64_t *src, const int64_t *len) {
    copy_runs(0, nruns, dst, src, len);
}

static int64_t kv_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t); /* the clock of Python's time.perf_counter_ns on Linux */
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Non-temporal stores are weakly ordered: every thread that streamed fences before it reports its work done. */
static void kv_fence(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_sfence();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

/* ---- xxh3_64 of one slot, fed block by block --------------------------------------------------------------
 *
 * The 1 KB blocks of a long input (more than 240 bytes) are accumulated as soon as they are final, and the tail
 * and the merge run at the end: the same steps as XXH3_hashLong_64b with the default secret (xxhash.h 0.8.2),
 * so the digest is XXH3_64bits's (tests/offload/test_copy_hash.py checks every build against the xxhash
 * package). Unlike XXH3_64bits_update it keeps no input buffer. */
#define KV_BLOCK ((XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE * XXH_STRIPE_LEN)
#define KV_STRIPES (KV_BLOCK / XXH_STRIPE_LEN)
#define KV_SCRAMBLE_KEY (XXH3_kSecret + XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN)

typedef struct {
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB];
    const uint8_t *data;
    size_t size;
    size_t blocks; /* blocks accumulated and scrambled before the tail */
    size_t done;   /* blocks accumulated so far */
} kv_hasher;

static void kv_hash_start(kv_hasher *h, const uint8_t *data, size_t size) {
    static const xxh_u64 init[XXH_ACC_NB] = XXH3_INIT_ACC;
    memcpy(h->acc, init, sizeof(init));
    h->data = data;
    h->size = size;
    h->blocks = size > XXH3_MIDSIZE_MAX ? (size - 1) / KV_BLOCK : 0;
    h->done = 0;
}

/* Accumulate, from memory, every block that lies in the first `ready` bytes (those are final); returns the
 * bytes read. The accumulators are copied to a local array for the loop: the compiler keeps that one in
 * registers (3x faster than through `h`). */
static size_t kv_hash_advance(kv_hasher *h, size_t ready) {
    size_t last = ready / KV_BLOCK < h->blocks ? ready / KV_BLOCK : h->blocks;
    if (h->done >= last) {
        return 0;
    }
    size_t first = h->done;
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB];
    memcpy(acc, h->acc, sizeof(acc));
    for (; h->done < last; h->done++) {
        XXH3_accumulate(acc, h->data + h->done * KV_BLOCK, XXH3_kSecret, KV_STRIPES);
        XXH3_scrambleAcc(acc, KV_SCRAMBLE_KEY);
    }
    memcpy(h->acc, acc, sizeof(acc));
    return (last - first) * KV_BLOCK;
}

/* The digest, once every byte is final. */
static uint64_t kv_hash_finish(kv_hasher *h) {
    if (h->size <= XXH3_MIDSIZE_MAX) {
        return XXH3_64bits(h->data, h->size);
    }
    kv_hash_advance(h, h->size);
    size_t tail = h->blocks * KV_BLOCK;
    XXH3_accumulate(h->acc, h->data + tail, XXH3_kSecret, (h->size - 1 - tail) / XXH_STRIPE_LEN);
    XXH3_accumulate_512(h->acc, h->data + h->size - XXH_STRIPE_LEN,
                        XXH3_kSecret + XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);
    return XXH3_mergeAccs(h->acc, XXH3_kSecret + XXH_SECRET_MERGEACCS_START, (xxh_u64)h->size * XXH_PRIME64_1);
}

/* ---- the copy loop -----------------------------------------------------------------------------------------
 *
 * kv_blocks copies whole 1 KB blocks and, with `hash`, accumulates each one into the xxh3 state as it passes:
 * with AVX-512F (AVX2) each 64-byte stripe is one (two) vector loads, stored to the destination and hashed from
 * the register, so the hash reads nothing twice and costs a few vector instructions per stripe while the loop
 * waits on memory. With `stream` the stores are non-temporal (dst 64-byte aligned): a long copy then neither
 * reads its destination lines first nor evicts the cache (measured here: 15-25% faster than libc's memcpy for
 * jobs far larger than the cache, which uses ordinary stores below a threshold of hundreds of MB). The source
 * is prefetched KV_PREFETCH bytes ahead, into `next` (where reading continues) near the end: pages scattered in
 * engine memory start each page cold otherwise; streaming, with the non-temporal hint, so that the source of a
 * long copy does not push everything else out of the caches either (measured here: the Python that reports the
 * job ran 30-40% faster right after it). The portable build copies a block with memcpy and hashes it from L1
 * (`hashed`: the block's host side, what a store wrote or a load read). */
#define KV_PREFETCH 4096
#define KV_LINE 64

KV_INLINE void kv_prefetch_block(const uint8_t *src, size_t b, size_t nblocks, const uint8_t *next, int stream) {
    size_t ahead = b * KV_BLOCK + KV_PREFETCH;
    const uint8_t *p;
    if (ahead < nblocks * KV_BLOCK) {
        p = src + ahead;
    } else if (next != NULL) {
        p = next + (ahead - nblocks * KV_BLOCK);
    } else {
        return;
    }
    for (size_t i = 0; i < KV_BLOCK; i += KV_LINE) {
        if (stream) {
            __builtin_prefetch(p + i, 0, 0);
        } else {
            __builtin_prefetch(p + i, 0, 3);
        }
    }
}

#if defined(__AVX512F__)
KV_INLINE __m512i kv_acc512(__m512i acc, __m512i data, const uint8_t *key) {
    __m512i const data_key = _mm512_xor_si512(data, _mm512_loadu_si512((const void *)key));
    __m512i const product = _mm512_mul_epu32(data_key, _mm512_srli_epi64(data_key, 32));
    __m512i const swapped = _mm512_shuffle_epi32(data, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2));
    return _mm512_add_epi64(acc, _mm512_add_epi64(product, swapped)); /* one add on the chain through acc */
}

KV_INLINE __m512i kv_scramble512(__m512i acc) {
    __m512i const prime32 = _mm512_set1_epi32((int)XXH_PRIME32_1);
    __m512i const key = _mm512_loadu_si512((const void *)KV_SCRAMBLE_KEY);
    __m512i const data_key = _mm512_ternarylogic_epi32(key, acc, _mm512_srli_epi64(acc, 47), 0x96);
    __m512i const lo = _mm512_mul_epu32(data_key, prime32);
    __m512i const hi = _mm512_mul_epu32(_mm512_srli_epi64(data_key, 32), prime32);
    return _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
}

KV_INLINE void kv_blocks(xxh_u64 *accp, uint8_t *dst, const uint8_t *src, const uint8_t *hashed, size_t nblocks,
                         int hash, int stream, const uint8_t *next) {
    (void)hashed;
    __m512i acc = hash ? _mm512_load_si512((const void *)accp) : _mm512_setzero_si512();
    for (size_t b = 0; b < nblocks; b++) {
        kv_prefetch_block(src, b, nblocks, next, stream);
        const uint8_t *s = src + b * KV_BLOCK;
        uint8_t *d = dst + b * KV_BLOCK;
        for (size_t i = 0; i < KV_STRIPES; i++) {
            __m512i const v = _mm512_loadu_si512((const void *)(s + i * XXH_STRIPE_LEN));
            if (stream) {
                _mm512_stream_si512((void *)(d + i * XXH_STRIPE_LEN), v);
            } else {
                _mm512_storeu_si512((void *)(d + i * XXH_STRIPE_LEN), v);
            }
            if (hash) {
                acc = kv_acc512(acc, v, XXH3_kSecret + i * XXH_SECRET_CONSUME_RATE);
            }
        }
        if (hash) {
            acc = kv_scramble512(acc);
        }
    }
    if (hash) {
        _mm512_store_si512((void *)accp, acc);
    }
}
#define KV_CAN_STREAM 1
#elif defined(__AVX2__)
KV_INLINE __m256i kv_acc256(__m256i acc, __m256i data, const uint8_t *key) {
    __m256i const data_key = _mm256_xor_si256(data, _mm256_loadu_si256((const __m256i *)key));
    __m256i const product = _mm256_mul_epu32(data_key, _mm256_srli_epi64(data_key, 32));
    __m256i const swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
    return _mm256_add_epi64(acc, _mm256_add_epi64(product, swapped)); /* one add on the chain through acc */
}

KV_INLINE __m256i kv_scramble256(__m256i acc, const uint8_t *key) {
    __m256i const prime32 = _mm256_set1_epi32((int)XXH_PRIME32_1);
    __m256i const data_vec = _mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47));
    __m256i const data_key = _mm256_xor_si256(data_vec, _mm256_loadu_si256((const __m256i *)key));
    __m256i const lo = _mm256_mul_epu32(data_key, prime32);
    __m256i const hi = _mm256_mul_epu32(_mm256_srli_epi64(data_key, 32), prime32);
    return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

KV_INLINE void kv_blocks(xxh_u64 *accp, uint8_t *dst, const uint8_t *src, const uint8_t *hashed, size_t nblocks,
                         int hash, int stream, const uint8_t *next) {
    (void)hashed;
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    if (hash) {
        acc0 = _mm256_load_si256((const __m256i *)accp);
        acc1 = _mm256_load_si256((const __m256i *)(accp + 4));
    }
    for (size_t b = 0; b < nblocks; b++) {
        kv_prefetch_block(src, b, nblocks, next, stream);
        const uint8_t *s = src + b * KV_BLOCK;
        uint8_t *d = dst + b * KV_BLOCK;
        for (size_t i = 0; i < KV_STRIPES; i++) {
            __m256i const v0 = _mm256_loadu_si256((const __m256i *)(s + i * XXH_STRIPE_LEN));
            __m256i const v1 = _mm256_loadu_si256((const __m256i *)(s + i * XXH_STRIPE_LEN + 32));
            if (stream) {
                _mm256_stream_si256((__m256i *)(d + i * XXH_STRIPE_LEN), v0);
                _mm256_stream_si256((__m256i *)(d + i * XXH_STRIPE_LEN + 32), v1);
            } else {
                _mm256_storeu_si256((__m256i *)(d + i * XXH_STRIPE_LEN), v0);
                _mm256_storeu_si256((__m256i *)(d + i * XXH_STRIPE_LEN + 32), v1);
            }
            if (hash) {
                const uint8_t *key = XXH3_kSecret + i * XXH_SECRET_CONSUME_RATE;
                acc0 = kv_acc256(acc0, v0, key);
                acc1 = kv_acc256(acc1, v1, key + 32);
            }
        }
        if (hash) {
            acc0 = kv_scramble256(acc0, KV_SCRAMBLE_KEY);
            acc1 = kv_scramble256(acc1, KV_SCRAMBLE_KEY + 32);
        }
    }
    if (hash) {
        _mm256_store_si256((__m256i *)accp, acc0);
        _mm256_store_si256((__m256i *)(accp + 4), acc1);
    }
}
#define KV_CAN_STREAM 1
#else
KV_INLINE void kv_blocks(xxh_u64 *accp, uint8_t *dst, const uint8_t *src, const uint8_t *hashed, size_t nblocks,
                         int hash, int stream, const uint8_t *next) {
    (void)stream;
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB];
    if (hash) {
        memcpy(acc, accp, sizeof(acc));
    }
    for (size_t b = 0; b < nblocks; b++) {
        kv_prefetch_block(src, b, nblocks, next, stream);
        memcpy(dst + b * KV_BLOCK, src + b * KV_BLOCK, KV_BLOCK);
        if (hash) {
            XXH3_accumulate(acc, hashed + b * KV_BLOCK, XXH3_kSecret, KV_STRIPES);
            XXH3_scrambleAcc(acc, KV_SCRAMBLE_KEY);
        }
    }
    if (hash) {
        memcpy(accp, acc, sizeof(acc));
    }
}
#define KV_CAN_STREAM 0
#endif

/* What one thread did (kvcopy_job's stats add these up). */
typedef struct {
    int64_t fused;    /* bytes copied and hashed in one pass */
    int64_t plain;    /* bytes copied without hashing them on the way (outside slots, heads and tails) */
    int64_t memhash;  /* bytes hashed from memory (partial blocks, slot bytes no run writes) */
    int64_t busy_ns;  /* time in granules */
    int64_t granules; /* granules run */
    int64_t takes;    /* times it took granules */
} kv_counts;

/* Copy n bytes without hashing them on the way: memmove, or (stream, long) a streaming vector loop. */
static void kv_copy(uint8_t *dst, const uint8_t *src, size_t n, int stream, const uint8_t *next, kv_counts *c) {
    c->plain += (int64_t)n;
#if KV_CAN_STREAM
    if (stream && n >= 4 * KV_BLOCK) {
        size_t head = (KV_LINE - ((uintptr_t)dst & (KV_LINE - 1))) & (KV_LINE - 1);
        memmove(dst, src, head);
        size_t nb = (n - head) / KV_BLOCK;
        kv_blocks(NULL, dst + head, src + head, NULL, nb, 0, 1, next);
        size_t done = head + nb * KV_BLOCK;
        memmove(dst + done, src + done, n - done);
        return;
    }
#else
    (void)stream;
    (void)next;
#endif
    memmove(dst, src, n);
}

/* Copy n bytes (dst <- src) that are bytes [rel, rel + n) of the slot `h` hashes, every slot byte before rel
 * being final: the whole blocks they cover are hashed on the way (kv_blocks), a block they complete or leave
 * partial from memory right after (`host`: the host side of the copy, what the hash reads). */
static void kv_feed(kv_hasher *h, size_t rel, uint8_t *dst, const uint8_t *src, const uint8_t *host, size_t n,
                    int stream, const uint8_t *next, kv_counts *c) {
    size_t end = rel + n, a = rel;
    size_t hashed_end = h->blocks * KV_BLOCK; /* what the block walk hashes; the rest at the finish */
    if (a % KV_BLOCK != 0 && a < hashed_end) {
        size_t b = (a / KV_BLOCK + 1) * KV_BLOCK;
        b = b < end ? b : end;
        memmove(dst, src, b - a);
        c->plain += (int64_t)(b - a);
        a = b;
        c->memhash += (int64_t)kv_hash_advance(h, a);
    }
    if (a < hashed_end && a % KV_BLOCK == 0 && h->done == a / KV_BLOCK) {
        size_t k = ((end < hashed_end ? end : hashed_end) - a) / KV_BLOCK;
        if (k != 0) {
            uint8_t *d = dst + (a - rel);
            int aligned = ((uintptr_t)d & (KV_LINE - 1)) == 0;
            kv_blocks(h->acc, d, src + (a - rel), host + (a - rel), k, 1, stream && aligned, next);
            h->done += k;
            a += k * KV_BLOCK;
            c->fused += (int64_t)(k * KV_BLOCK);
        }
    }
    if (a < end) { /* a partial block or the tail: cached stores, the hash reads them back */
        memmove(dst + (a - rel), src + (a - rel), end - a);
        c->plain += (int64_t)(end - a);
        c->memhash += (int64_t)kv_hash_advance(h, end);
    }
}

/* ---- one job: runs and slots in host order --------------------------------------------------------------- */

typedef struct {
    int64_t nruns;
    const int64_t *dst, *src, *len, *host; /* absolute addresses; host: offset from base; sorted by host */
    int64_t nslots;
    const int64_t *first, *size, *id; /* sorted by first; digest j goes to out[id[j]] */
    const uint8_t *base;              /* the host memory (what is hashed) */
    uint64_t *out;
    int is_store, stream;
} kv_plan;

/* Where a granule starts: run `run` from byte `off`, slot `slot` (the first slot at or after that host byte). */
typedef struct {
    int64_t run, off, slot;
} kv_cut;

/* Copy run bytes from cut `from` up to cut `to` and hash the slots in between, each while its bytes pass.
 * Runs must not overlap in host memory, except in a load (the host is only read). Slot bytes that no run
 * left to copy writes (gaps, or a slot seen twice) are final and hashed from memory. */
static void kv_walk(const kv_plan *p, kv_cut from, kv_cut to, kv_counts *c) {
    int64_t r = from.run, done = from.off;
    const int64_t r_end = to.run, off_end = to.off;
#define KV_LIMIT(i) ((i) == r_end ? off_end : p->len[i])
#define KV_AVAILABLE() (r < r_end || (r == r_end && done < off_end))
    /* where reading continues after n more bytes of run r: further on in it, or the next run of the granule */
#define KV_NEXT_SRC(n)                                                                                                 \
    (done + (n) < KV_LIMIT(r)                            ? s + (n)                                                     \
     : r + 1 < p->nruns && (r + 1 < r_end || off_end > 0) ? (const uint8_t *)(uintptr_t)p->src[r + 1]                   \
                                                          : NULL)
#define KV_STEP(n)                                                                                                     \
    do {                                                                                                               \
        done += (n);                                                                                                   \
        if (done >= p->len[r]) {                                                                                       \
            r++;                                                                                                       \
            done = 0;                                                                                                  \
        }                                                                                                              \
    } while (0)
    kv_hasher h;
    for (int64_t j = from.slot; j < to.slot; j++) {
        const int64_t first = p->first[j], end = first + p->size[j];
        const uint8_t *slot = p->base + first;
        kv_hash_start(&h, slot, (size_t)p->size[j]);
        int64_t pos = first;
        while (KV_AVAILABLE()) {
            int64_t at = p->host[r] + done;
            if (at >= end) {
                break;
            }
            int64_t stop = p->host[r] + KV_LIMIT(r);
            uint8_t *d = (uint8_t *)(uintptr_t)(p->dst[r] + done);
            const uint8_t *s = (const uint8_t *)(uintptr_t)(p->src[r] + done);
            if (at < pos) { /* bytes before this slot, or (a load) read again */
                int64_t n = (stop < pos ? stop : pos) - at;
                kv_copy(d, s, (size_t)n, p->stream, KV_NEXT_SRC(n), c);
                KV_STEP(n);
                continue;
            }
            if (at > pos) { /* slot bytes no run writes: final */
                c->memhash += (int64_t)kv_hash_advance(&h, (size_t)(at - first));
                pos = at;
            }
            int64_t n = (stop < end ? stop : end) - at;
            const uint8_t *hs = p->is_store ? d : s;
            kv_feed(&h, (size_t)(at - first), d, s, hs, (size_t)n, p->stream, KV_NEXT_SRC(n), c);
            pos += n;
            KV_STEP(n);
        }
        c->memhash += (int64_t)kv_hash_advance(&h, (size_t)p->size[j]);
        p->out[p->id[j]] = kv_hash_finish(&h);
    }
    while (KV_AVAILABLE()) { /* runs past the last slot */
        int64_t n = KV_LIMIT(r) - done;
        const uint8_t *s = (const uint8_t *)(uintptr_t)(p->src[r] + done);
        kv_copy((uint8_t *)(uintptr_t)(p->dst[r] + done), s, (size_t)n, p->stream, KV_NEXT_SRC(n), c);
        KV_STEP(n);
    }
#undef KV_LIMIT
#undef KV_AVAILABLE
#undef KV_NEXT_SRC
#undef KV_STEP
}

/* The previous loop (kvcopy_copy_hash): runs, which must not overlap in host memory, are copied in host order in
 * stretches of at most `stretch` bytes, and each stretch of a slot is hashed from memory once every run byte
 * below its end was copied. */
static void kv_walk_stretches(const kv_plan *p, int64_t stretch, kv_counts *c) {
    kv_hasher h;
    int64_t r = 0, done = 0;
    for (int64_t j = 0; j < p->nslots; j++) {
        int64_t end = p->first[j] + p->size[j];
        kv_hash_start(&h, p->base + p->first[j], (size_t)p->size[j]);
        int64_t a = p->first[j];
        do {
            int64_t b = a + stretch < end ? a + stretch : end;
            while (r < p->nruns && p->host[r] + done < b) {
                int64_t n = p->len[r] - done;
                if (p->host[r] + done + n > b) {
                    n = b - (p->host[r] + done);
                }
                memmove((void *)(uintptr_t)(p->dst[r] + done), (const void *)(uintptr_t)(p->src[r] + done), (size_t)n);
                c->plain += n;
                done += n;
                if (done >= p->len[r]) {
                    r++;
                    done = 0;
                }
            }
            c->memhash += (int64_t)kv_hash_advance(&h, (size_t)(b - p->first[j]));
            a = b;
        } while (a < end);
        p->out[p->id[j]] = kv_hash_finish(&h);
    }
    for (; r < p->nruns; r++, done = 0) {
        memmove((void *)(uintptr_t)(p->dst[r] + done), (const void *)(uintptr_t)(p->src[r] + done),
                (size_t)(p->len[r] - done));
        c->plain += p->len[r] - done;
    }
}

/* A store whose runs overlap in host memory (two engine blocks into one sub-block), or a job hashed without the
 * copy loop: every run is copied (in host order: the last one wins), then every slot is hashed from memory, so
 * each digest is that of the final bytes. */
static void kv_copy_then_hash(const kv_plan *p, kv_counts *c) {
    for (int64_t r = 0; r < p->nruns; r++) {
        memmove((void *)(uintptr_t)p->dst[r], (const void *)(uintptr_t)p->src[r], (size_t)p->len[r]);
        c->plain += p->len[r];
    }
    for (int64_t j = 0; j < p->nslots; j++) {
        p->out[p->id[j]] = XXH3_64bits(p->base + p->first[j], (size_t)p->size[j]);
        c->memhash += p->size[j];
    }
}

/* Copy runs in host order and hash every slot while the runs write (store) or read (load) its bytes, in
 * stretches of at most `stretch` bytes (kv_walk_stretches, on this thread). Runs: dst[i] <- src[i], len[i]
 * bytes; host[i] is the run's offset in the host memory at `base` (the side that is hashed), and runs are sorted
 * by it. Slots: [first[j], first[j] + size[j]) of that memory, sorted by first[j]; digest j goes to out[id[j]].
 * Returns 0, or -1 when the runs or the slots are not sorted or `stretch` is not positive (nothing is copied). */
KV_EXPORT int kvcopy_copy_hash(int64_t nruns, const int64_t *dst, const int64_t *src, const int64_t *len,
                               const int64_t *host, int64_t nslots, const int64_t *first, const int64_t *size,
                               const int64_t *id, int64_t stretch, const uint8_t *base, uint64_t *out) {
    if (stretch <= 0) {
        return -1;
    }
    for (int64_t i = 1; i < nruns; i++) {
        if (host[i] < host[i - 1]) {
            return -1;
        }
    }
    for (int64_t j = 1; j < nslots; j++) {
        if (first[j] < first[j - 1]) {
            return -1;
        }
    }
    kv_plan p = {nruns, dst, src, len, host, nslots, first, size, id, base, out, 1, 0};
    kv_counts c = {0};
    kv_walk_stretches(&p, stretch, &c);
    return 0;
}

/* ---- the helper pool --------------------------------------------------------------------------------------
 *
 * Helper threads wait on one queue of jobs that still have granules to hand out. The thread that called
 * kvcopy_job takes granules of its own job too and waits for the helpers' last ones: the job's memory lives on
 * its stack until every granule is done. Granules are taken in guided portions (a share of what is left), so a
 * helper that wakes late or runs slowly simply takes fewer. */
#define KV_MAX_HELPERS 64

typedef struct kv_job kv_job;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work;
    kv_job *head, *tail; /* jobs with granules left */
    int helpers, stop;
    pid_t pid; /* a forked child has no helpers: its jobs run on the calling thread */
    pthread_t threads[KV_MAX_HELPERS];
} kv_pool;

struct kv_job {
    const kv_plan *plan;
    const kv_cut *cuts; /* granule g: cuts[g] .. cuts[g + 1] */
    int64_t granules, next, finished;
    int participants;
    int queued;
    kv_job *qnext;
    pthread_cond_t done;
    kv_counts caller, helpers;
    int64_t helper_first_ns, helper_last_ns;
};

static void kv_unqueue(kv_pool *pool, kv_job *job) {
    kv_job **at = &pool->head, *prev = NULL;
    while (*at != NULL && *at != job) {
        prev = *at;
        at = &(*at)->qnext;
    }
    if (*at == job) {
        *at = job->qnext;
        if (pool->tail == job) {
            pool->tail = prev;
        }
    }
    job->queued = 0;
}

/* Under the pool's lock: the next portion of granules [*lo, *hi) of `job`, or 0 when none is left. */
static int kv_take(kv_pool *pool, kv_job *job, int64_t *lo, int64_t *hi) {
    int64_t left = job->granules - job->next;
    if (left <= 0) {
        return 0;
    }
    int64_t n = left / (2 * job->participants);
    n = n < 1 ? 1 : n;
    *lo = job->next;
    *hi = job->next + n;
    job->next = *hi;
    if (job->next >= job->granules && job->queued && pool != NULL) {
        kv_unqueue(pool, job);
    }
    return 1;
}

static void kv_run(kv_job *job, int64_t lo, int64_t hi, kv_counts *c) {
    int64_t t0 = kv_now();
    kv_walk(job->plan, job->cuts[lo], job->cuts[hi], c);
    if (job->plan->stream) {
        kv_fence();
    }
    c->busy_ns += kv_now() - t0;
    c->granules += hi - lo;
    c->takes += 1;
}

static void kv_add(kv_counts *into, const kv_counts *c) {
    into->fused += c->fused;
    into->plain += c->plain;
    into->memhash += c->memhash;
    into->busy_ns += c->busy_ns;
    into->granules += c->granules;
    into->takes += c->takes;
}

static void *kv_helper(void *arg) {
    kv_pool *pool = arg;
    pthread_mutex_lock(&pool->mu);
    for (;;) {
        while (!pool->stop && pool->head == NULL) {
            pthread_cond_wait(&pool->work, &pool->mu);
        }
        if (pool->stop) {
            break;
        }
        kv_job *job = pool->head;
        int64_t lo, hi;
        if (!kv_take(pool, job, &lo, &hi)) {
            kv_unqueue(pool, job);
            continue;
        }
        pthread_mutex_unlock(&pool->mu);
        kv_counts c = {0};
        int64_t t0 = kv_now();
        kv_run(job, lo, hi, &c);
        int64_t t1 = kv_now();
        pthread_mutex_lock(&pool->mu);
        if (job->helper_first_ns == 0) {
            job->helper_first_ns = t0;
        }
        job->helper_last_ns = t1 > job->helper_last_ns ? t1 : job->helper_last_ns;
        kv_add(&job->helpers, &c);
        job->finished += hi - lo;
        if (job->finished == job->granules) {
            pthread_cond_signal(&job->done);
        }
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

KV_EXPORT void kvcopy_pool_free(void *handle) {
    kv_pool *pool = handle;
    if (pool == NULL) {
        return;
    }
    if (pool->pid == getpid()) {
        pthread_mutex_lock(&pool->mu);
        pool->stop = 1;
        pthread_cond_broadcast(&pool->work);
        pthread_mutex_unlock(&pool->mu);
        for (int i = 0; i < pool->helpers; i++) {
            pthread_join(pool->threads[i], NULL);
        }
        pthread_cond_destroy(&pool->work);
        pthread_mutex_destroy(&pool->mu);
    }
    free(pool);
}

/* A pool of `helpers` threads (at most KV_MAX_HELPERS), or NULL when none could be started. */
KV_EXPORT void *kvcopy_pool_new(int helpers) {
    if (helpers < 1 || helpers > KV_MAX_HELPERS) {
        return NULL;
    }
    kv_pool *pool = calloc(1, sizeof(kv_pool));
    if (pool == NULL) {
        return NULL;
    }
    pool->pid = getpid();
    if (pthread_mutex_init(&pool->mu, NULL) != 0 || pthread_cond_init(&pool->work, NULL) != 0) {
        free(pool);
        return NULL;
    }
    for (int i = 0; i < helpers; i++) {
        if (pthread_create(&pool->threads[i], NULL, kv_helper, pool) != 0) {
            break;
        }
        pool->helpers++;
    }
    if (pool->helpers == 0) {
        kvcopy_pool_free(pool);
        return NULL;
    }
    return pool;
}

KV_EXPORT int kvcopy_pool_helpers(void *handle) { return handle == NULL ? 0 : ((kv_pool *)handle)->helpers; }

/* ---- kvcopy_job ------------------------------------------------------------------------------------------- */

/* Per calling thread, reused from job to job (a fresh malloc of this size would be an mmap per job). */
static pthread_key_t kv_scratch_key;
static pthread_once_t kv_scratch_once = PTHREAD_ONCE_INIT;
typedef struct {
    size_t size;
    int64_t data[];
} kv_scratch;

static void kv_scratch_init(void) { (void)pthread_key_create(&kv_scratch_key, free); }

static int64_t *kv_scratch_get(size_t words) {
    pthread_once(&kv_scratch_once, kv_scratch_init);
    kv_scratch *s = pthread_getspecific(kv_scratch_key);
    if (s == NULL || s->size < words) {
        size_t size = words + words / 4 + 1024;
        kv_scratch *grown = malloc(sizeof(kv_scratch) + size * sizeof(int64_t));
        if (grown == NULL) {
            return NULL;
        }
        grown->size = size;
        free(s);
        s = grown;
        pthread_setspecific(kv_scratch_key, s);
    }
    return s->data;
}

/* order[i] <- indices 0..n-1 sorted by key (stable LSD radix sort; keys >= 0); tmp: n words. */
static void kv_sort(int64_t n, const int64_t *key, int64_t *order, int64_t *tmp) {
    int sorted = 1;
    int64_t low = n ? key[0] : 0, high = low;
    for (int64_t i = 0; i < n; i++) {
        order[i] = i;
        if (i && key[i] < key[i - 1]) {
            sorted = 0;
        }
        low = key[i] < low ? key[i] : low;
        high = key[i] > high ? key[i] : high;
    }
    if (sorted) {
        return;
    }
    uint64_t span = (uint64_t)(high - low);
    enum { BITS = 11, BUCKETS = 1 << BITS };
    int64_t count[BUCKETS];
    for (int shift = 0; shift < 64 && (span >> shift) != 0; shift += BITS) {
        memset(count, 0, sizeof(count));
        for (int64_t i = 0; i < n; i++) {
            count[((uint64_t)(key[order[i]] - low) >> shift) & (BUCKETS - 1)]++;
        }
        int64_t at = 0;
        for (int b = 0; b < BUCKETS; b++) {
            int64_t c = count[b];
            count[b] = at;
            at += c;
        }
        for (int64_t i = 0; i < n; i++) {
            tmp[count[((uint64_t)(key[order[i]] - low) >> shift) & (BUCKETS - 1)]++] = order[i];
        }
        memcpy(order, tmp, (size_t)n * sizeof(int64_t));
    }
}

enum {
    KV_FUSED = 1,  /* hash in the copy loop (else: copy, then hash from memory, as for overlapping runs) */
    KV_STREAM = 2, /* non-temporal stores (builds with vectors) */
    KV_SEAL = 4,   /* a store: record each slot's tag (and digest) in the integrity table, then its state */
    KV_VERIFY = 8, /* a load: check each slot's state, tag (and digest) in the integrity table */
};

/* The pool's integrity table (kvoffload.offload.pool.IntegrityTable): per entry three int64, the key tag, the
 * checksum (the digest's bits) and the state. */
enum { KV_TAG, KV_SUM, KV_STATE, KV_FIELDS };

/* Seal (store) or verify (load) slots 0..n-1 in the table once the job's copies are done: a store writes the
 * tag and the digest before the state (release order: a reader that sees the state sees both), a load marks
 * bad[j] = 1 when the state is below `state`, the tag differs or (with digests) the checksum differs. Returns the
 * number of bad slots. */
static int64_t kv_table(int64_t *table, int64_t n, const int64_t *entries, const int64_t *tags, const uint64_t *sums,
                        int64_t state, int seal, uint8_t *bad) {
    int64_t nbad = 0;
    for (int64_t j = 0; j < n; j++) {
        int64_t *row = table + entries[j] * KV_FIELDS;
        if (seal) {
            row[KV_TAG] = tags[j];
            if (sums != NULL) {
                row[KV_SUM] = (int64_t)sums[j];
            }
            __atomic_store_n(&row[KV_STATE], state, __ATOMIC_RELEASE);
        } else {
            int ok = __atomic_load_n(&row[KV_STATE], __ATOMIC_ACQUIRE) >= state && row[KV_TAG] == tags[j];
            if (sums != NULL) {
                ok = ok && row[KV_SUM] == (int64_t)sums[j];
            }
            bad[j] = (uint8_t)!ok;
            nbad += !ok;
        }
    }
    return nbad;
}

/* kvcopy_job's stats: what it returns in `stats` (KV_STAT_COUNT int64 values) when not NULL. */
enum {
    KV_STAT_ENTER_NS,     /* CLOCK_MONOTONIC at entry */
    KV_STAT_PLANNED_NS,   /* ordered and cut */
    KV_STAT_CALLER_DONE_NS, /* the calling thread found no granule left */
    KV_STAT_EXIT_NS,      /* every granule done */
    KV_STAT_GRANULES,
    KV_STAT_MODE,         /* 0 no slots, 1 fused, 2 copy then hash (overlapping store runs) */
    KV_STAT_STREAM,
    KV_STAT_PARTICIPANTS, /* threads that may take granules (caller + helpers) */
    KV_STAT_CALLER_FUSED,
    KV_STAT_CALLER_PLAIN,
    KV_STAT_CALLER_MEMHASH,
    KV_STAT_CALLER_BUSY_NS,
    KV_STAT_CALLER_GRANULES,
    KV_STAT_CALLER_TAKES,
    KV_STAT_HELPER_FUSED,
    KV_STAT_HELPER_PLAIN,
    KV_STAT_HELPER_MEMHASH,
    KV_STAT_HELPER_BUSY_NS,
    KV_STAT_HELPER_GRANULES,
    KV_STAT_HELPER_TAKES,
    KV_STAT_HELPER_FIRST_NS, /* a helper started its first granule (0: none did) */
    KV_STAT_HELPER_LAST_NS,  /* a helper finished its last granule */
    KV_STAT_COUNT
};

KV_EXPORT int kvcopy_stat_count(void) { return KV_STAT_COUNT; }

/* Cut points for granules of about `target` bytes: at slot starts that no slot before straddles (a granule
 * hashes whole slots), anywhere without slots (in a run, at a multiple of 4 KB into it). Runs do not overlap.
 * Returns the number of granules; cuts[0] and cuts[granules] are the job's ends. */
static int64_t kv_cuts(const kv_plan *p, const int64_t *ends, int64_t total, int64_t target, kv_cut *cuts) {
    int64_t g = 0, last = 0;
    cuts[g++] = (kv_cut){0, 0, 0};
    if (p->nslots > 0) {
        int64_t r = 0, reach = p->first[0] + p->size[0];
        for (int64_t j = 1; j < p->nslots; j++) {
            int64_t at = p->first[j];
            if (reach <= at) {
                while (r < p->nruns && p->host[r] + p->len[r] <= at) {
                    r++;
                }
                int64_t off = r < p->nruns && p->host[r] < at ? at - p->host[r] : 0;
                int64_t bytes = (r ? ends[r - 1] : 0) + off;
                if (bytes - last >= target) {
                    cuts[g++] = (kv_cut){r, off, j};
                    last = bytes;
                }
            }
            int64_t e = p->first[j] + p->size[j];
            reach = e > reach ? e : reach;
        }
    } else {
        int64_t r = 0;
        for (int64_t want = target; want < total; want += target) {
            while (r < p->nruns && ends[r] <= want) {
                r++;
            }
            if (r >= p->nruns) {
                break;
            }
            int64_t start = r ? ends[r - 1] : 0;
            int64_t off = (want - start) / 4096 * 4096;
            int64_t bytes = start + off;
            if (bytes > last) {
                cuts[g++] = (kv_cut){r, off, 0};
                last = bytes;
            }
        }
    }
    cuts[g] = (kv_cut){p->nruns, 0, p->nslots};
    return g;
}

/* Scratch for a job of up to `nruns` runs and `nslots` slots: the ordered runs and slots and the cut points. */
typedef struct {
    int64_t *dst, *src, *len, *host, *ends, *order, *tmp;
    int64_t *first, *size, *id, *s_order, *s_tmp;
    kv_cut *cuts;
} kv_space;

static int kv_space_get(kv_space *sp, int64_t nruns, int64_t nslots, int64_t max_cuts) {
    size_t words = (size_t)(7 * nruns + 5 * nslots) + 3 * (size_t)max_cuts + 16;
    int64_t *w = kv_scratch_get(words);
    if (w == NULL) {
        return -1;
    }
    sp->dst = w, sp->src = sp->dst + nruns, sp->len = sp->src + nruns, sp->host = sp->len + nruns;
    sp->ends = sp->host + nruns, sp->order = sp->ends + nruns, sp->tmp = sp->order + nruns;
    sp->first = sp->tmp + nruns, sp->size = sp->first + nslots, sp->id = sp->size + nslots;
    sp->s_order = sp->id + nslots, sp->s_tmp = sp->s_order + nslots;
    sp->cuts = (kv_cut *)(sp->s_tmp + nslots);
    return 0;
}

/* The job once its runs (sorted by host offset, `ends`: running byte totals, `overlap`: some overlap in host
 * memory) and slots (sorted by first) are in `sp`: copy and hash (alone or with the pool's helpers), then seal or
 * verify. `table_slots`: slots the table update covers (in the caller's slot order). */
static int64_t kv_job_run(kv_pool *pool, const kv_space *sp, int64_t nruns, int64_t nslots, int64_t total,
                          int overlap, int64_t table_slots, int64_t is_store, int64_t host_base, uint64_t *out,
                          int64_t flags, int64_t granule, int64_t *table, const int64_t *entries, const int64_t *tags,
                          int64_t state, uint8_t *bad, int64_t *stats, int64_t t_enter) {
    const int64_t *r_dst = sp->dst, *r_src = sp->src, *r_len = sp->len, *r_host = sp->host, *ends = sp->ends;
    kv_cut *cuts = sp->cuts;
    kv_plan plan = {nruns,  r_dst, r_src, r_len, r_host, nslots, sp->first, sp->size, sp->id,
                    (const uint8_t *)(uintptr_t)host_base, out, is_store != 0, 0};
    if (pool != NULL && (pool->pid != getpid() || pool->helpers < 1)) {
        pool = NULL; /* a forked child: its pool has no threads */
    }
    plan.stream = KV_CAN_STREAM && (flags & KV_STREAM) != 0;
    int mode = nslots == 0 ? 0 : ((flags & KV_FUSED) && !(is_store && overlap) ? 1 : 2);

    kv_job job;
    memset(&job, 0, sizeof(job));
    job.plan = &plan;
    job.cuts = cuts;
    job.participants = 1 + (pool != NULL ? pool->helpers : 0);
    int64_t t_planned, t_caller_done;
    if (mode == 2) { /* copy, then hash from memory: whole job on this thread */
        plan.stream = 0;
        t_planned = kv_now();
        int64_t t0 = t_planned;
        kv_copy_then_hash(&plan, &job.caller);
        job.caller.busy_ns = kv_now() - t0;
        job.caller.granules = job.caller.takes = 1;
        job.participants = 1;
        t_caller_done = kv_now();
    } else {
        int split = pool != NULL && granule > 0 && !overlap && total > granule;
        job.granules = split ? kv_cuts(&plan, ends, total, granule, cuts) : 1;
        if (!split) {
            cuts[0] = (kv_cut){0, 0, 0};
            cuts[1] = (kv_cut){nruns, 0, nslots};
            job.participants = 1;
        }
        t_planned = kv_now();
        if (job.granules > 1) {
            pthread_cond_init(&job.done, NULL);
            pthread_mutex_lock(&pool->mu);
            job.queued = 1;
            if (pool->tail != NULL) {
                pool->tail->qnext = &job;
            } else {
                pool->head = &job;
            }
            pool->tail = &job;
            pthread_cond_broadcast(&pool->work);
            pthread_mutex_unlock(&pool->mu);
            for (;;) {
                int64_t lo, hi;
                pthread_mutex_lock(&pool->mu);
                int got = kv_take(pool, &job, &lo, &hi);
                pthread_mutex_unlock(&pool->mu);
                if (!got) {
                    break;
                }
                kv_run(&job, lo, hi, &job.caller);
                pthread_mutex_lock(&pool->mu);
                job.finished += hi - lo;
                pthread_mutex_unlock(&pool->mu);
            }
            t_caller_done = kv_now();
            pthread_mutex_lock(&pool->mu);
            while (job.finished < job.granules) {
                pthread_cond_wait(&job.done, &pool->mu);
            }
            pthread_mutex_unlock(&pool->mu);
            pthread_cond_destroy(&job.done);
        } else {
            job.participants = 1;
            kv_run(&job, 0, 1, &job.caller);
            t_caller_done = kv_now();
        }
    }
    int64_t nbad = 0;
    if (table != NULL && (flags & (KV_SEAL | KV_VERIFY)) != 0) {
        nbad = kv_table(table, table_slots, entries, tags, out, state, (flags & KV_SEAL) != 0, bad);
    }
    if (stats != NULL) {
        int64_t s[KV_STAT_COUNT] = {0};
        s[KV_STAT_ENTER_NS] = t_enter;
        s[KV_STAT_PLANNED_NS] = t_planned;
        s[KV_STAT_CALLER_DONE_NS] = t_caller_done;
        s[KV_STAT_EXIT_NS] = kv_now();
        s[KV_STAT_GRANULES] = mode == 2 ? 1 : job.granules;
        s[KV_STAT_MODE] = mode;
        s[KV_STAT_STREAM] = plan.stream;
        s[KV_STAT_PARTICIPANTS] = job.participants;
        const kv_counts *c = &job.caller, *hc = &job.helpers;
        s[KV_STAT_CALLER_FUSED] = c->fused;
        s[KV_STAT_CALLER_PLAIN] = c->plain;
        s[KV_STAT_CALLER_MEMHASH] = c->memhash;
        s[KV_STAT_CALLER_BUSY_NS] = c->busy_ns;
        s[KV_STAT_CALLER_GRANULES] = c->granules;
        s[KV_STAT_CALLER_TAKES] = c->takes;
        s[KV_STAT_HELPER_FUSED] = hc->fused;
        s[KV_STAT_HELPER_PLAIN] = hc->plain;
        s[KV_STAT_HELPER_MEMHASH] = hc->memhash;
        s[KV_STAT_HELPER_BUSY_NS] = hc->busy_ns;
        s[KV_STAT_HELPER_GRANULES] = hc->granules;
        s[KV_STAT_HELPER_TAKES] = hc->takes;
        s[KV_STAT_HELPER_FIRST_NS] = job.helper_first_ns;
        s[KV_STAT_HELPER_LAST_NS] = job.helper_last_ns;
        memcpy(stats, s, sizeof(s));
    }
    return nbad;
}

/* One whole job. Runs: engine[i] <-> host[i] (offsets from kv_base / host_base), len[i] bytes, in any order; a
 * store copies engine -> host, a load host -> engine. Slots: [slot_first[j], slot_first[j] + slot_size[j]) of
 * the host memory, in any order; with `out` (nslots uint64) digest j is the xxh3_64 of slot j's bytes once the
 * job's copies are done (what a store wrote, what a load read); without it nothing is hashed. Runs that overlap
 * in host memory are copied in host order (the last one wins in a store); a load should write each engine byte
 * once (two runs into the same bytes may land in either order when threads share the job). `pool` (or NULL)
 * lends helper threads when the job has more than one granule (`granule` bytes each, at least; 0: no split).
 * With KV_SEAL or
 * KV_VERIFY and `table`, slot j's entry entries[j] is then sealed with tags[j] (and digest j) and `state`, or
 * verified against them (bad[j] = 1 when it does not match, `state` being the least state that does). Returns
 * the number of slots that failed verification (0 otherwise), -1 for a negative length or offset (nothing
 * copied), -2 when out of memory (nothing copied). */
KV_EXPORT int64_t kvcopy_job(void *handle, int64_t nruns, const int64_t *engine, const int64_t *host,
                             const int64_t *len, int64_t nslots, const int64_t *slot_first, const int64_t *slot_size,
                             int64_t is_store, int64_t kv_base, int64_t host_base, uint64_t *out, int64_t flags,
                             int64_t granule, int64_t *table, const int64_t *entries, const int64_t *tags,
                             int64_t state, uint8_t *bad, int64_t *stats) {
    int64_t t_enter = kv_now();
    if (nruns < 0 || nslots < 0) {
        return -1;
    }
    const int64_t table_slots = nslots;
    if (out == NULL) {
        nslots = 0;
    }
    int64_t total = 0;
    for (int64_t i = 0; i < nruns; i++) {
        if (len[i] < 0 || host[i] < 0 || engine[i] < 0) {
            return -1;
        }
        total += len[i];
    }
    granule = granule > 0 && granule < 4096 ? 4096 : granule;
    for (int64_t j = 0; j < nslots; j++) {
        if (slot_size[j] < 0 || slot_first[j] < 0) {
            return -1;
        }
    }
    kv_space sp;
    if (kv_space_get(&sp, nruns, nslots, nslots + 2 + (granule > 0 ? total / granule + 2 : 0)) != 0) {
        return -2;
    }
    kv_sort(nruns, host, sp.order, sp.tmp);
    int overlap = 0;
    int64_t reach = 0; /* the furthest host byte a run so far reaches */
    total = 0;
    for (int64_t i = 0; i < nruns; i++) {
        int64_t k = sp.order[i];
        int64_t e = kv_base + engine[k], h = host_base + host[k];
        sp.dst[i] = is_store ? h : e;
        sp.src[i] = is_store ? e : h;
        sp.len[i] = len[k];
        sp.host[i] = host[k];
        total += len[k];
        sp.ends[i] = total;
        overlap |= i > 0 && host[k] < reach;
        reach = host[k] + len[k] > reach ? host[k] + len[k] : reach;
    }
    kv_sort(nslots, slot_first, sp.s_order, sp.s_tmp);
    for (int64_t j = 0; j < nslots; j++) {
        int64_t k = sp.s_order[j];
        sp.first[j] = slot_first[k];
        sp.size[j] = slot_size[k];
        sp.id[j] = k;
    }
    return kv_job_run(handle, &sp, nruns, nslots, total, overlap, table_slots, is_store, host_base, out, flags, granule,
                      table, entries, tags, state, bad, stats, t_enter);
}

/* kvcopy_job for a job given as blocks (what the copy engine plans): block i of group groups[i] moves between
 * engine block engine_blocks[i] and the host sub-block at host_blocks[i], along its group's segments: segs holds
 * (engine offset, engine block stride, length, offset in the sub-block) rows, group g's from seg_start[g] to
 * seg_start[g + 1], ordered by offset in the sub-block (nothing longer than group_bytes[g]). Slot i is the
 * block's sub-block, [host_blocks[i], host_blocks[i] + group_bytes[g]); runs are built here, in host order,
 * neighbours that continue each other in both memories merged. A store naming a sub-block twice keeps the
 * later block's bytes. Returns like kvcopy_job. */
KV_EXPORT int64_t kvcopy_job_blocks(void *handle, int64_t nblocks, const int64_t *groups, const int64_t *engine_blocks,
                                    const int64_t *host_blocks, int64_t ngroups, const int64_t *seg_start,
                                    const int64_t *segs, const int64_t *group_bytes, int64_t is_store,
                                    int64_t kv_base, int64_t host_base, uint64_t *out, int64_t flags,
                                    int64_t granule, int64_t *table, const int64_t *entries, const int64_t *tags,
                                    int64_t state, uint8_t *bad, int64_t *stats) {
    int64_t t_enter = kv_now();
    if (nblocks < 0 || ngroups < 0) {
        return -1;
    }
    int64_t nruns = 0, total = 0;
    for (int64_t i = 0; i < nblocks; i++) {
        int64_t g = groups[i];
        if (g < 0 || g >= ngroups || engine_blocks[i] < 0 || host_blocks[i] < 0) {
            return -1;
        }
        nruns += seg_start[g + 1] - seg_start[g];
        for (int64_t k = seg_start[g]; k < seg_start[g + 1]; k++) {
            total += segs[4 * k + 2];
        }
    }
    const int64_t nslots = out != NULL ? nblocks : 0;
    granule = granule > 0 && granule < 4096 ? 4096 : granule;
    kv_space sp;
    if (kv_space_get(&sp, nruns, nblocks, nblocks + 2 + (granule > 0 ? total / granule + 2 : 0)) != 0) {
        return -2;
    }
    kv_sort(nblocks, host_blocks, sp.s_order, sp.s_tmp); /* blocks (and their slots) in host order */
    int64_t n = 0, reach = 0;
    int overlap = 0, sorted = 1;
    for (int64_t j = 0; j < nblocks; j++) {
        int64_t b = sp.s_order[j], g = groups[b];
        sp.first[j] = host_blocks[b];
        sp.size[j] = group_bytes[g];
        sp.id[j] = b;
        for (int64_t k = seg_start[g]; k < seg_start[g + 1]; k++) {
            const int64_t *seg = segs + 4 * k;
            int64_t e = seg[0] + seg[1] * engine_blocks[b], h = host_blocks[b] + seg[3], l = seg[2];
            if (l <= 0 || e < 0 || h < 0) {
                if (l < 0 || e < 0 || h < 0) {
                    return -1;
                }
                continue;
            }
            if (n > 0) {
                int64_t pe = sp.tmp[n - 1], ph = sp.host[n - 1], pl = sp.len[n - 1];
                sorted &= h >= ph;
                overlap |= h < reach;
                reach = h + l > reach ? h + l : reach;
                if (pe + pl == e && ph + pl == h) { /* continues the previous run in both memories */
                    sp.len[n - 1] += l;
                    continue;
                }
            }
            reach = h + l > reach ? h + l : reach;
            sp.tmp[n] = e; /* engine offsets, for now */
            sp.host[n] = h;
            sp.len[n] = l;
            n++;
        }
    }
    /* Sub-blocks named twice: a store copies block after block (the later block wins, as in job order), a load
     * reads in host order (the copy loop hashes each sub-block as its bytes pass). */
    if (!sorted && !(is_store && overlap)) {
        kv_sort(n, sp.host, sp.order, sp.ends);
        for (int64_t i = 0; i < n; i++) {
            int64_t k = sp.order[i];
            sp.dst[i] = sp.tmp[k];
            sp.src[i] = sp.host[k];
            sp.ends[i] = sp.len[k];
        }
        for (int64_t i = 0; i < n; i++) {
            sp.tmp[i] = sp.dst[i];
            sp.host[i] = sp.src[i];
            sp.len[i] = sp.ends[i];
        }
        overlap = 0;
        reach = 0;
        for (int64_t i = 0; i < n; i++) {
            overlap |= i > 0 && sp.host[i] < reach;
            reach = sp.host[i] + sp.len[i] > reach ? sp.host[i] + sp.len[i] : reach;
        }
    }
    total = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t e = kv_base + sp.tmp[i], h = host_base + sp.host[i];
        sp.dst[i] = is_store ? h : e;
        sp.src[i] = is_store ? e : h;
        total += sp.len[i];
        sp.ends[i] = total;
    }
    return kv_job_run(handle, &sp, n, nslots, total, overlap, nblocks, is_store, host_base, out, flags, granule, table,
                      entries, tags, state, bad, stats, t_enter);
}

#include "kvcopy_engine.c"
