/* kvcopy: the CPU copy engine's inner loop in C (loaded with ctypes, so every call runs without the GIL).
 *
 * A job share is a list of byte runs (dst[i] <- src[i], len[i] bytes) and, with checksums, the sub-blocks
 * ("slots") whose host bytes are hashed (xxh3_64) right after they were copied, while still in cache.
 *
 * Built up to three times by setup.py: the baseline build and, on x86-64, one with AVX2 (xxh3 is about twice
 * as fast) and one with AVX-512F (xxh3 about 1.5x faster again); Python picks the widest build that
 * kvcopy_cpu_has_avx2() / kvcopy_cpu_has_avx512() of the baseline build say the CPU (and OS) can run.
 */

#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "third_party/xxhash/xxhash.h"

#if defined(__GNUC__)
#define KV_EXPORT __attribute__((visibility("default")))
#else
#define KV_EXPORT
#endif

KV_EXPORT int kvcopy_abi_version(void) { return 3; }

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

KV_EXPORT uint64_t kvcopy_xxh3_64(const void *data, int64_t size) { return XXH3_64bits(data, (size_t)size); }

static void copy_runs(int64_t lo, int64_t hi, const int64_t *dst, const int64_t *src, const int64_t *len) {
    for (int64_t i = lo; i < hi; i++) {
        memmove((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], (size_t)len[i]);
    }
}

KV_EXPORT void kvcopy_copy(int64_t nruns, const int64_t *dst, const int64_t *src, const int64_t *len) {
    copy_runs(0, nruns, dst, src, len);
}

/* xxh3_64 of one slot, fed while its bytes are copied: the 1 KB blocks of a long input (more than 240 bytes)
 * are accumulated as soon as they are final, while they are still in cache, and the tail and the merge run at
 * the end. The same steps as XXH3_hashLong_64b with the default secret (xxhash.h 0.8.2), so the digest is
 * XXH3_64bits's (tests/offload/test_copy_hash.py checks every build against the xxhash package). Unlike
 * XXH3_64bits_update it keeps no input buffer, and with AVX-512 it is about 20% faster. */
#define KV_BLOCK ((XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE * XXH_STRIPE_LEN)

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

/* Accumulate every block that lies in the first `ready` bytes (those are final). The accumulators are copied
 * to a local array for the loop: the compiler keeps that one in registers (3x faster than through `h`). */
static void kv_hash_advance(kv_hasher *h, size_t ready) {
    size_t last = ready / KV_BLOCK < h->blocks ? ready / KV_BLOCK : h->blocks;
    if (h->done >= last) {
        return;
    }
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB];
    memcpy(acc, h->acc, sizeof(acc));
    for (; h->done < last; h->done++) {
        XXH3_accumulate(acc, h->data + h->done * KV_BLOCK, XXH3_kSecret, KV_BLOCK / XXH_STRIPE_LEN);
        XXH3_scrambleAcc(acc, XXH3_kSecret + XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN);
    }
    memcpy(h->acc, acc, sizeof(acc));
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

/* Copy runs in host order and hash every slot while the runs write (store) or read (load) its bytes, in
 * stretches of at most `stretch` bytes: each stretch's bytes are hashed right after they were copied, while
 * they are still in cache. The copies stay memmove calls (libc's, `rep movsb` for these sizes on x86-64):
 * measured here, a copy loop that hashes what passes through its registers runs no faster than memmove and
 * then the hash of the bytes in cache.
 *
 * Runs: dst[i] <- src[i], len[i] bytes; host[i] is the run's offset in the host memory at `base` (the side that
 * is hashed), and runs are sorted by it. Slots: [first[j], first[j] + size[j]) of that memory, sorted by
 * first[j]; digest j goes to out[id[j]]. Before a stretch [a, b) is hashed, every run byte at a host offset
 * below b has been copied (a run may be copied in several pieces, at stretch ends). Returns 0, or -1 when the
 * runs or the slots are not sorted or `stretch` is not positive (nothing is copied then).
 */
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
    kv_hasher h;
    int64_t r = 0;    /* the run being copied */
    int64_t done = 0; /* bytes of run r already copied */
    for (int64_t j = 0; j < nslots; j++) {
        int64_t end = first[j] + size[j];
        kv_hash_start(&h, base + first[j], (size_t)size[j]);
        int64_t a = first[j];
        do {
            int64_t b = a + stretch < end ? a + stretch : end;
            /* copy every run byte at a host offset below b */
            while (r < nruns && host[r] + done < b) {
                int64_t n = len[r] - done;
                if (host[r] + done + n > b) {
                    n = b - (host[r] + done);
                }
                memmove((void *)(uintptr_t)(dst[r] + done), (const void *)(uintptr_t)(src[r] + done), (size_t)n);
                done += n;
                if (done >= len[r]) {
                    r++;
                    done = 0;
                }
            }
            kv_hash_advance(&h, (size_t)(b - first[j]));
            a = b;
        } while (a < end);
        out[id[j]] = kv_hash_finish(&h);
    }
    for (; r < nruns; r++, done = 0) {
        memmove((void *)(uintptr_t)(dst[r] + done), (const void *)(uintptr_t)(src[r] + done), (size_t)(len[r] - done));
    }
    return 0;
}
