/* kvcopy: the CPU copy engine's inner loop in C (loaded with ctypes, so every call runs without the GIL).
 *
 * A job share is a list of byte runs (dst[i] <- src[i], len[i] bytes) and, with checksums, the sub-blocks
 * ("slots") whose host bytes are hashed (xxh3_64) right after they were copied, while still in cache.
 *
 * Built twice by setup.py: the baseline build and, on x86-64, one with AVX2 (xxh3 is about twice as fast);
 * Python picks the AVX2 build when kvcopy_cpu_has_avx2() of the baseline build says the CPU has it.
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

KV_EXPORT int kvcopy_abi_version(void) { return 2; }

KV_EXPORT int kvcopy_cpu_has_avx2(void) {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
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

/* Copy runs in host order and hash every slot right after the runs that write (store) or read (load) its
 * bytes, in stretches of at most `stretch` bytes so that what is hashed is still in cache.
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
    XXH3_state_t state;
    int64_t r = 0;    /* the run being copied */
    int64_t done = 0; /* bytes of run r already copied */
    for (int64_t j = 0; j < nslots; j++) {
        int64_t end = first[j] + size[j];
        int whole = size[j] <= stretch;
        if (!whole) {
            XXH3_64bits_reset(&state);
        }
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
            if (whole) {
                out[id[j]] = XXH3_64bits(base + a, (size_t)(b - a));
            } else {
                XXH3_64bits_update(&state, base + a, (size_t)(b - a));
            }
            a = b;
        } while (a < end);
        if (!whole) {
            out[id[j]] = XXH3_64bits_digest(&state);
        }
    }
    for (; r < nruns; r++, done = 0) {
        memmove((void *)(uintptr_t)(dst[r] + done), (const void *)(uintptr_t)(src[r] + done), (size_t)(len[r] - done));
    }
    return 0;
}
