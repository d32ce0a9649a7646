/* The native copy engine (included by kvcopy.c): a job queue and a C thread per direction, so that a job needs
 * no Python between its submission and its completion.
 *
 * kvcopy_engine_submit checks a job (counts and id ranges, as the copy engine's Python planner does), lays out
 * its blocks (group, engine block, host sub-block, chunk, integrity entry, key tag: the sub-block rule of
 * kvoffload.offload.worker.copy._runs), invalidates a store's entries and queues it; the direction's thread runs
 * it with kvcopy_job_blocks (copy, hash, seal or verify) and files the outcome, which kvcopy_engine_poll hands
 * over in submission order, stores first. kvcopy_engine_wait blocks (without the GIL) until given jobs are done.
 */

KV_EXPORT void kvcopy_engine_free(void *handle);

enum { KV_PACK_GROUP, KV_PACK_ENGINE, KV_PACK_HOST, KV_PACK_CHUNK, KV_PACK_ENTRY, KV_PACK_TAG, KV_PACK_DIGEST,
       KV_PACK_BAD, KV_PACK_ROWS };

/* kvcopy_engine_new's config, in this order. */
enum {
    KV_CFG_KV_BASE,
    KV_CFG_HOST_BASE,
    KV_CFG_TABLE_SLOTS,  /* slots per chunk row in the integrity table (a shared pool: the world size) */
    KV_CFG_TABLE_SLOT,   /* this rank's slot */
    KV_CFG_BPC,          /* blocks per chunk */
    KV_CFG_NUM_BLOCKS,   /* engine blocks (block ids below it) */
    KV_CFG_NUM_CHUNKS,   /* host chunks (chunk ids below it) */
    KV_CFG_ROW_BYTES,    /* bytes per chunk row */
    KV_CFG_SLOT_OFFSET,  /* this rank's offset in a row */
    KV_CFG_WKB,          /* bytes per sub-block */
    KV_CFG_CHECKSUMS,    /* hash (stores seal the digests, loads verify them) */
    KV_CFG_STATE,        /* the state a store writes and a load needs (SEALED, or TAGGED without checksums) */
    KV_CFG_GRANULE,      /* bytes per granule when the helpers share a job */
    KV_CFG_PARALLEL_MIN, /* jobs of at least this many bytes are shared with the pool's helpers */
    KV_CFG_STREAM_MIN,   /* jobs of at least this many bytes stream (non-temporal stores) */
    KV_CFG_COUNT
};

/* A record of kvcopy_engine_poll, in this order (int64 each). */
enum { KV_REC_ID, KV_REC_IS_STORE, KV_REC_STATUS, KV_REC_BYTES, KV_REC_QUEUED_NS, KV_REC_START_NS, KV_REC_END_NS,
       KV_REC_BAD, KV_REC_STATS };
#define KV_REC_COUNT (KV_REC_STATS + KV_STAT_COUNT)

/* Record statuses besides the number of sub-blocks that failed verification. */
enum { KV_FAILED_MEMORY = -2, KV_FAILED_OUTSIDE = -3 };

typedef struct kv_qjob {
    struct kv_qjob *next;
    int64_t id, n, num_bytes, status, t_queued, t_start, t_end, nbad;
    int outside; /* failed before it started (the caller knows why) */
    int64_t *pack;
    int64_t *bad; /* chunk ids that failed verification, sorted, unique */
    int64_t stats[KV_STAT_COUNT];
} kv_qjob;

typedef struct kv_engine kv_engine;

typedef struct {
    kv_engine *engine;
    int is_store;
    kv_qjob *head, *tail;         /* queued */
    kv_qjob *fin_head, *fin_tail; /* done, not polled yet */
    int64_t submitted, completed;
    int busy; /* a job of this direction is running (jobs of one direction run one at a time, in order) */
    pthread_t thread;
    int running;
} kv_dir;

struct kv_engine {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    int stop, held, closed;
    pid_t pid;
    kv_pool *pool;
    int64_t cfg[KV_CFG_COUNT];
    int64_t *table;
    int64_t ngroups;
    int64_t *seg_start, *segs, *group_bytes; /* copies */
    kv_dir dirs[2];                          /* 0: stores, 1: loads */
};

static int kv_cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Run one queued job on the calling thread and fill in its outcome (frees its pack). */
static void kv_engine_run(kv_engine *e, kv_qjob *job, int is_store) {
    job->t_start = kv_now();
    const int64_t *cfg = e->cfg;
    if (job->outside) {
        job->status = KV_FAILED_OUTSIDE;
    } else if (job->n > 0) {
        int64_t n = job->n, *pack = job->pack;
        int64_t flags = KV_FUSED | (is_store ? KV_SEAL : KV_VERIFY);
        if (job->num_bytes >= cfg[KV_CFG_STREAM_MIN]) {
            flags |= KV_STREAM;
        }
        int shared = job->num_bytes >= cfg[KV_CFG_PARALLEL_MIN];
        uint64_t *digests = cfg[KV_CFG_CHECKSUMS] ? (uint64_t *)(pack + KV_PACK_DIGEST * n) : NULL;
        uint8_t *bad = (uint8_t *)(pack + KV_PACK_BAD * n);
        job->status = kvcopy_job_blocks(shared ? e->pool : NULL, n, pack + KV_PACK_GROUP * n, pack + KV_PACK_ENGINE * n,
                                        pack + KV_PACK_HOST * n, e->ngroups, e->seg_start, e->segs, e->group_bytes,
                                        is_store, cfg[KV_CFG_KV_BASE], cfg[KV_CFG_HOST_BASE], digests, flags,
                                        shared ? cfg[KV_CFG_GRANULE] : 0, e->table, pack + KV_PACK_ENTRY * n,
                                        pack + KV_PACK_TAG * n, cfg[KV_CFG_STATE], bad, job->stats);
        if (job->status == -2) {
            job->status = KV_FAILED_MEMORY;
        }
        if (job->status > 0) { /* the chunks whose sub-blocks did not verify */
            int64_t *chunks = malloc((size_t)job->status * sizeof(int64_t));
            if (chunks == NULL) {
                job->status = KV_FAILED_MEMORY;
            } else {
                int64_t k = 0;
                for (int64_t j = 0; j < n; j++) {
                    if (bad[j]) {
                        chunks[k++] = pack[KV_PACK_CHUNK * n + j];
                    }
                }
                qsort(chunks, (size_t)k, sizeof(int64_t), kv_cmp_i64);
                int64_t u = 0;
                for (int64_t j = 0; j < k; j++) {
                    if (u == 0 || chunks[u - 1] != chunks[j]) {
                        chunks[u++] = chunks[j];
                    }
                }
                job->bad = chunks;
                job->nbad = u;
            }
        }
    } else {
        job->status = 0;
    }
    free(job->pack);
    job->pack = NULL;
    job->t_end = kv_now();
}

/* Under the lock: file a finished job. */
static void kv_engine_file(kv_engine *e, kv_dir *d, kv_qjob *job) {
    job->next = NULL;
    if (d->fin_tail != NULL) {
        d->fin_tail->next = job;
    } else {
        d->fin_head = job;
    }
    d->fin_tail = job;
    d->completed++;
    pthread_cond_broadcast(&e->done);
}

/* Under the lock: take the next job of `d` and run it on this thread (unlocked meanwhile), then file it. */
static void kv_engine_take(kv_engine *e, kv_dir *d) {
    kv_qjob *job = d->head;
    d->head = job->next;
    if (d->head == NULL) {
        d->tail = NULL;
    }
    d->busy = 1;
    pthread_mutex_unlock(&e->mu);
    kv_engine_run(e, job, d->is_store);
    pthread_mutex_lock(&e->mu);
    d->busy = 0;
    kv_engine_file(e, d, job);
    pthread_cond_broadcast(&e->work); /* the direction may have more */
}

static void *kv_engine_thread(void *arg) {
    kv_dir *d = arg;
    kv_engine *e = d->engine;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        while (!e->stop && (d->head == NULL || e->held || d->busy)) {
            pthread_cond_wait(&e->work, &e->mu);
        }
        if (d->head == NULL && !d->busy) { /* stopping, and every submitted job is done */
            break;
        }
        if (d->head != NULL && !d->busy && !e->held) {
            kv_engine_take(e, d);
        } else {
            pthread_cond_wait(&e->work, &e->mu);
        }
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* Queue a job (or, in a forked child, whose engine has no threads, run it here). Returns its number in its
 * direction (1, 2, ...: kvcopy_engine_wait takes it). */
static int64_t kv_engine_queue(kv_engine *e, int is_store, kv_qjob *job) {
    kv_dir *d = &e->dirs[is_store ? 0 : 1];
    job->t_queued = kv_now();
    job->next = NULL;
    if (e->pid != getpid()) {
        kv_engine_run(e, job, is_store);
        pthread_mutex_lock(&e->mu);
        int64_t seq = ++d->submitted;
        kv_engine_file(e, d, job);
        pthread_mutex_unlock(&e->mu);
        return seq;
    }
    pthread_mutex_lock(&e->mu);
    int64_t seq = ++d->submitted;
    if (d->tail != NULL) {
        d->tail->next = job;
    } else {
        d->head = job;
    }
    d->tail = job;
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->mu);
    return seq;
}

/* An engine for one copy engine's memory: `config` (KV_CFG_COUNT values), the layout's segments as
 * kvcopy_job_blocks takes them (copied), the integrity table (rows of tag, checksum, state) and the pool whose
 * helpers share long jobs (or NULL). Starts the two direction threads; NULL when they cannot start. */
KV_EXPORT void *kvcopy_engine_new(void *pool, const int64_t *config, int64_t ngroups, const int64_t *seg_start,
                                  const int64_t *segs, const int64_t *group_bytes, int64_t *table) {
    if (ngroups < 0) {
        return NULL;
    }
    kv_engine *e = calloc(1, sizeof(kv_engine));
    if (e == NULL) {
        return NULL;
    }
    int64_t nsegs = seg_start[ngroups];
    e->seg_start = malloc((size_t)(ngroups + 1) * sizeof(int64_t));
    e->segs = malloc((size_t)(4 * nsegs + 1) * sizeof(int64_t));
    e->group_bytes = malloc((size_t)(ngroups + 1) * sizeof(int64_t));
    if (e->seg_start == NULL || e->segs == NULL || e->group_bytes == NULL ||
        pthread_mutex_init(&e->mu, NULL) != 0) {
        free(e->seg_start);
        free(e->segs);
        free(e->group_bytes);
        free(e);
        return NULL;
    }
    pthread_cond_init(&e->work, NULL);
    pthread_cond_init(&e->done, NULL);
    memcpy(e->seg_start, seg_start, (size_t)(ngroups + 1) * sizeof(int64_t));
    memcpy(e->segs, segs, (size_t)(4 * nsegs) * sizeof(int64_t));
    memcpy(e->group_bytes, group_bytes, (size_t)ngroups * sizeof(int64_t));
    memcpy(e->cfg, config, sizeof(e->cfg));
    e->ngroups = ngroups;
    e->table = table;
    e->pool = pool;
    e->pid = getpid();
    for (int k = 0; k < 2; k++) {
        kv_dir *d = &e->dirs[k];
        d->engine = e;
        d->is_store = k == 0;
        d->running = pthread_create(&d->thread, NULL, kv_engine_thread, d) == 0;
    }
    if (!e->dirs[0].running || !e->dirs[1].running) {
        kvcopy_engine_free(e);
        return NULL;
    }
    return e;
}

/* Check and queue a job; see kvcopy_engine_new and the file's head. group_sizes / block_indices: one value per
 * group of the layout; chunk_tags (ntags values) may be NULL or empty (untagged: 0). A store of a rank that
 * does not write (writes == 0) completes with 0 bytes. Returns the job's number in its direction (> 0), or -1
 * (a negative count, or the counts do not consume the ids exactly), -2 (a block id outside [0, num_blocks)),
 * -3 (a chunk id outside [0, num_chunks)), -4 (ntags is neither 0 nor nchunk_ids), -5 (out of memory): then
 * nothing was queued or changed. */
KV_EXPORT int64_t kvcopy_engine_submit(void *handle, int64_t is_store, int64_t job_id, int64_t writes,
                                       const int64_t *group_sizes, const int64_t *block_indices,
                                       const int64_t *block_ids, int64_t nblock_ids, const int64_t *chunk_ids,
                                       int64_t nchunk_ids, const int64_t *chunk_tags, int64_t ntags) {
    kv_engine *e = handle;
    const int64_t *cfg = e->cfg;
    const int64_t bpc = cfg[KV_CFG_BPC];
    int64_t need_blocks = 0, need_chunks = 0;
    for (int64_t g = 0; g < e->ngroups; g++) {
        int64_t n = group_sizes[g], b = block_indices[g];
        if (n < 0 || b < 0) {
            return -1;
        }
        need_blocks += n;
        need_chunks += n ? (n + b % bpc + bpc - 1) / bpc : 0;
    }
    if (nblock_ids != need_blocks || nchunk_ids != need_chunks) {
        return -1;
    }
    for (int64_t i = 0; i < nblock_ids; i++) {
        if ((uint64_t)block_ids[i] >= (uint64_t)cfg[KV_CFG_NUM_BLOCKS]) {
            return -2;
        }
    }
    for (int64_t i = 0; i < nchunk_ids; i++) {
        if ((uint64_t)chunk_ids[i] >= (uint64_t)cfg[KV_CFG_NUM_CHUNKS]) {
            return -3;
        }
    }
    if (ntags != 0 && ntags != nchunk_ids) {
        return -4;
    }
    kv_qjob *job = calloc(1, sizeof(kv_qjob));
    if (job == NULL) {
        return -5;
    }
    job->id = job_id;
    const int64_t n = writes || !is_store ? need_blocks : 0;
    if (n > 0) {
        job->pack = malloc((size_t)(KV_PACK_ROWS * n) * sizeof(int64_t));
        if (job->pack == NULL) {
            free(job);
            return -5;
        }
        int64_t *pack = job->pack, i = 0, chunk_pos = 0, num_bytes = 0;
        for (int64_t g = 0; g < e->ngroups; g++) {
            int64_t count = group_sizes[g], skip = block_indices[g] % bpc;
            for (int64_t k = 0; k < count; k++, i++) {
                int64_t c = chunk_pos + (skip + k) / bpc, sub = (skip + k) % bpc, chunk = chunk_ids[c];
                pack[KV_PACK_GROUP * n + i] = g;
                pack[KV_PACK_ENGINE * n + i] = block_ids[i];
                pack[KV_PACK_HOST * n + i] =
                    chunk * cfg[KV_CFG_ROW_BYTES] + cfg[KV_CFG_SLOT_OFFSET] + sub * cfg[KV_CFG_WKB];
                pack[KV_PACK_CHUNK * n + i] = chunk;
                pack[KV_PACK_ENTRY * n + i] = (chunk * cfg[KV_CFG_TABLE_SLOTS] + cfg[KV_CFG_TABLE_SLOT]) * bpc + sub;
                pack[KV_PACK_TAG * n + i] = ntags ? chunk_tags[c] : 0;
            }
            chunk_pos += count ? (count + skip + bpc - 1) / bpc : 0;
            num_bytes += count * e->group_bytes[g];
        }
        job->n = n;
        job->num_bytes = num_bytes;
        if (is_store) { /* unusable until this store's copy has completed */
            for (int64_t j = 0; j < n; j++) {
                __atomic_store_n(&e->table[pack[KV_PACK_ENTRY * n + j] * KV_FIELDS + KV_STATE], 0, __ATOMIC_RELEASE);
            }
        }
    }
    return kv_engine_queue(e, is_store != 0, job);
}

/* Queue a job that failed before it started (the caller keeps the reason): it is reported in its place. */
KV_EXPORT int64_t kvcopy_engine_fail(void *handle, int64_t is_store, int64_t job_id) {
    kv_qjob *job = calloc(1, sizeof(kv_qjob));
    if (job == NULL) {
        return -5;
    }
    job->id = job_id;
    job->outside = 1;
    return kv_engine_queue(handle, is_store != 0, job);
}

/* Wait until the stores numbered up to store_seq and the loads up to load_seq are done (0: none), at most
 * timeout_ns (< 0: no limit). A job waited for that its direction's thread has not started yet runs on the
 * waiting thread (which would only sleep: one thread hand-over less, and one thread less wanting a core).
 * Returns 1, or 0 on timeout (a job it took runs to its end first). */
KV_EXPORT int64_t kvcopy_engine_wait(void *handle, int64_t store_seq, int64_t load_seq, int64_t timeout_ns) {
    kv_engine *e = handle;
    struct timespec until;
    if (timeout_ns >= 0) {
        clock_gettime(CLOCK_REALTIME, &until);
        int64_t ns = until.tv_nsec + timeout_ns % 1000000000LL;
        until.tv_sec += (time_t)(timeout_ns / 1000000000LL + ns / 1000000000LL);
        until.tv_nsec = (long)(ns % 1000000000LL);
    }
    pthread_mutex_lock(&e->mu);
    int ok = 1;
    while (e->dirs[0].completed < store_seq || e->dirs[1].completed < load_seq) {
        int took = 0;
        for (int k = 0; k < 2 && !e->held && e->pid == getpid(); k++) {
            kv_dir *d = &e->dirs[k];
            if (d->completed < (k == 0 ? store_seq : load_seq) && d->head != NULL && !d->busy) {
                kv_engine_take(e, d);
                took = 1;
            }
        }
        if (took) {
            continue;
        }
        if (timeout_ns < 0) {
            pthread_cond_wait(&e->done, &e->mu);
        } else if (pthread_cond_timedwait(&e->done, &e->mu, &until) == ETIMEDOUT) {
            ok = e->dirs[0].completed >= store_seq && e->dirs[1].completed >= load_seq;
            break;
        }
    }
    pthread_mutex_unlock(&e->mu);
    return ok;
}

/* Hand over finished jobs, stores then loads, each in submission order: up to `max` records (KV_REC_COUNT
 * int64 each) and their bad chunk ids, back to back, into `chunks` (up to `chunk_cap`; a job whose ids do not
 * fit waits for the next call). Returns the number of records, or -n when nothing was handed over because the
 * next job has n > chunk_cap bad chunk ids (call again with room for them). */
KV_EXPORT int64_t kvcopy_engine_poll(void *handle, int64_t *records, int64_t max, int64_t *chunks,
                                     int64_t chunk_cap) {
    kv_engine *e = handle;
    int64_t count = 0, used = 0;
    pthread_mutex_lock(&e->mu);
    for (int k = 0; k < 2; k++) {
        kv_dir *d = &e->dirs[k];
        while (d->fin_head != NULL && count < max && used + d->fin_head->nbad <= chunk_cap) {
            kv_qjob *job = d->fin_head;
            d->fin_head = job->next;
            if (d->fin_head == NULL) {
                d->fin_tail = NULL;
            }
            int64_t *r = records + count * KV_REC_COUNT;
            r[KV_REC_ID] = job->id;
            r[KV_REC_IS_STORE] = d->is_store;
            r[KV_REC_STATUS] = job->status;
            r[KV_REC_BYTES] = job->status >= 0 ? job->num_bytes : 0;
            r[KV_REC_QUEUED_NS] = job->t_queued;
            r[KV_REC_START_NS] = job->t_start;
            r[KV_REC_END_NS] = job->t_end;
            r[KV_REC_BAD] = job->nbad;
            memcpy(r + KV_REC_STATS, job->stats, sizeof(job->stats));
            if (job->nbad) {
                memcpy(chunks + used, job->bad, (size_t)job->nbad * sizeof(int64_t));
                used += job->nbad;
            }
            free(job->bad);
            free(job);
            count++;
        }
        if (count == 0 && d->fin_head != NULL && d->fin_head->nbad > chunk_cap) {
            count = -d->fin_head->nbad;
            break;
        }
    }
    pthread_mutex_unlock(&e->mu);
    return count;
}

/* Hold back (held != 0) or let go the start of queued jobs (tests and tools). */
KV_EXPORT void kvcopy_engine_hold(void *handle, int64_t held) {
    kv_engine *e = handle;
    pthread_mutex_lock(&e->mu);
    e->held = held != 0;
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->mu);
}

/* Finish every queued job, then stop the threads (results stay for kvcopy_engine_poll; idempotent). */
KV_EXPORT void kvcopy_engine_close(void *handle) {
    kv_engine *e = handle;
    if (e->closed) {
        return;
    }
    e->closed = 1;
    if (e->pid != getpid()) {
        return; /* a forked child: its engine has no threads */
    }
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    e->held = 0;
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->mu);
    for (int k = 0; k < 2; k++) {
        if (e->dirs[k].running) {
            pthread_join(e->dirs[k].thread, NULL);
            e->dirs[k].running = 0;
        }
    }
}

KV_EXPORT void kvcopy_engine_free(void *handle) {
    kv_engine *e = handle;
    if (e == NULL) {
        return;
    }
    kvcopy_engine_close(e);
    for (int k = 0; k < 2; k++) {
        for (kv_qjob *lists[2] = {e->dirs[k].head, e->dirs[k].fin_head}, **l = lists; l < lists + 2; l++) {
            for (kv_qjob *job = *l, *next; job != NULL; job = next) {
                next = job->next;
                free(job->pack);
                free(job->bad);
                free(job);
            }
        }
    }
    if (e->pid == getpid()) {
        pthread_cond_destroy(&e->work);
        pthread_cond_destroy(&e->done);
        pthread_mutex_destroy(&e->mu);
    }
    free(e->seg_start);
    free(e->segs);
    free(e->group_bytes);
    free(e);
}

KV_EXPORT int kvcopy_engine_layout(int64_t *out) {
    out[0] = KV_CFG_COUNT;
    out[1] = KV_REC_COUNT;
    out[2] = KV_PACK_ROWS;
    return 3;
}
