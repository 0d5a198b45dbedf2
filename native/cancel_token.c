/*
 * cancelbench native cancel token. The exported interface, with the threads
 * each function may be called from and the token-reset contract, is declared
 * and documented in cancel_token.h.
 *
 * The token's first byte is the cancel flag, so a plain `uint8_t *` reader
 * (the shape llamadart and other bindings use) can read the same memory.
 * `cb_token_reader` is the exact `bool (*)(void *)` llama_set_abort_callback
 * and mtmd's cb_eval-style hooks need: no Python runs on the compute thread.
 *
 * Every agent-side timestamp comes from cb_now_ns(), so the time a reader
 * first saw the flag and the Python-side timestamps share one clock domain.
 */
#include "cancel_token.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <errno.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <pthread.h>
#include <unistd.h>
#if defined(__linux__)
#include <fcntl.h>
#include <stdio.h>
#include <sys/syscall.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

#define CB_OP_CLASSES 128  /* ggml_op values (GGML_OP_COUNT is ~95 in this ggml) */
/* A cost key is an op and a shape class: the log2 bucket of the node's work
 * (buckets 0..CB_WORK_BUCKETS-1 = work below 2^11, [2^11, 2^12), ...). One
 * op at two sizes can cost very differently per unit of work (an im2col or a
 * GELU over a small vs a large activation, cache-resident or not). */
#define CB_WORK_BUCKETS 32
#define CB_KEYS (CB_OP_CLASSES * CB_WORK_BUCKETS)
#ifndef CB_RANGE_KEYS
#define CB_RANGE_KEYS 64   /* distinct keys of one range followed for the per-key update */
#endif

struct cb_token {
    _Atomic uint8_t flag;      /* offset 0: non-zero means abort */
    _Atomic int64_t set_ns;    /* when cb_token_set stored the flag */
    _Atomic int64_t seen_ns;   /* first time a reader saw the flag set; 0 = never */
    _Atomic int64_t seen_cpu_ns; /* the eval reader's thread CPU clock when it stamped seen_ns; 0 = not stamped there */
    _Atomic int seen_where;      /* where the eval reader stamped it: 0 not there, 1 a range's sync, 2 a node's ask */
    _Atomic uint64_t polls;    /* reader calls since the last reset (eval reader: one per node asked) */
    /* the shared cancel word (cb_token_watch): the token counts as set once *word == word_seq */
    const _Atomic uint64_t *_Atomic word;
    _Atomic uint64_t word_seq;
    _Atomic int set_by_word;   /* the flag was latched from the word, before any cb_token_set */
    _Atomic int64_t word_cpu_ns;   /* the latching reader's thread CPU clock at the latch; 0 = not latched */
    _Atomic uint64_t word_thread;  /* that thread's cb_thread_id */
    _Atomic int64_t word_wait_ns;  /* that thread's run delay at the latch (schedstat); -1 = not read */
    /* eval reader (cb_token_eval_reader), see there */
    _Atomic int64_t slice_ns;      /* configuration: target time between syncs; 0 = every node */
    _Atomic uint64_t syncs;        /* node ranges the reader asked to see (each one computed + synchronized) */
    _Atomic int64_t max_range_ns;  /* longest such range: first node asked -> range synchronized */
    _Atomic double ns_per_work;    /* learned cost of one unit of node work incl. sync share (EMA) */
    /* eval reader state, touched only by the thread running the graph (and by
     * reset / forget_costs / set_slice_ns, between graphs) */
    int64_t range_start_ns;    /* when the first node of the current range was asked */
    uint64_t last_ask_ticks;   /* when the last node was asked (cb_ticks) */
    uint32_t range_nodes;      /* nodes asked in the current range */
    double range_work;         /* their estimated work (cb_node_work x the key's learned scale) */
    uint32_t key_synced[CB_KEYS]; /* lifetime_syncs when the key was last measured (probed or corrected) */
    uint32_t lifetime_syncs;   /* ranges synced since the costs were forgotten (not reset per trial) */
    float key_scale[CB_KEYS];  /* learned cost of a key (op x work bucket) per unit of work, relative;
                                  0 = not seen, -1 = to be learned again (re-probe) */
    int32_t probe_key;         /* key of a first-seen node that ended the current range; -1 none */
    bool probe_again;          /* that key was learned before (a re-probe) */
    double probe_work;         /* that node's work */
    uint32_t range_nkeys;      /* distinct keys followed in the current range (at most CB_RANGE_KEYS) */
    uint16_t range_key[CB_RANGE_KEYS];
    uint8_t key_slot[CB_KEYS]; /* a key's index in range_key if range_key[key_slot[key]] == key (a sparse
                                  set: O(1) per node, never cleared) */
    float range_key_work[CB_RANGE_KEYS]; /* their scaled work in the range */
    _Atomic uint64_t probes;        /* ranges ended by a first-seen key (debug counter, reset per trial) */
    _Atomic uint64_t reprobes;      /* ranges ended to learn a key again (debug counter, reset per trial) */
    _Atomic int64_t max_range_est_ns; /* the estimate of the longest range (debug counter) */
    _Atomic int64_t max_range_cpu_ns; /* the most graph-thread CPU time of any range (debug counter) */
    int64_t range_cpu_ns;      /* the graph thread's CPU clock when the current range started */
    double cpu_per_work;       /* learned graph-thread CPU ns per unit of work (EMA; 0 = not learned) */
    /* profiling log (cb_token_log_enable): NULL = off; rows of doubles, see cancel_token.h */
    double *log_nodes, *log_ranges;
    int64_t log_nodes_cap, log_nodes_n, log_ranges_cap, log_ranges_n;
    int64_t range_seq;         /* ranges started since the log was enabled */
};

/* A constant added to the agent clock. Zero in production; tests set it to
 * inject a known skew between agent and driver clocks (clock-offset check). */
static _Atomic int64_t cb_clock_skew_ns = 0;

CB_EXPORT int cb_abi_version(void) {
    return CANCELBENCH_ABI_VERSION;
}

CB_EXPORT void cb_set_clock_skew_ns(int64_t skew) {
    atomic_store_explicit(&cb_clock_skew_ns, skew, memory_order_relaxed);
}

CB_EXPORT int64_t cb_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + (int64_t)ts.tv_nsec
           + atomic_load_explicit(&cb_clock_skew_ns, memory_order_relaxed);
}

/* The calling thread's CPU time (ns): a range's wall time minus this is time the
 * graph thread waited (for a CPU, or on compute threads of its own). */
static int64_t cb_thread_cpu_ns(void) {
    struct timespec ts;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0;
    return (int64_t)ts.tv_sec * 1000000000LL + (int64_t)ts.tv_nsec;
}

/* The calling thread's id (cancel_token.h). */
CB_EXPORT uint64_t cb_thread_id(void) {
#if defined(__linux__)
    return (uint64_t)syscall(SYS_gettid);
#elif defined(__APPLE__)
    uint64_t id = 0;
    return pthread_threadid_np(NULL, &id) == 0 ? id : 0;
#else
    return 0;
#endif
}

#if defined(__linux__)
/* The calling thread's schedstat, opened once per thread by cb_token_watch (between graphs) and
 * closed when the thread exits, so a latch reads its run delay with one pread (about 2 us here)
 * instead of an open, read and close (about 8). */
static pthread_key_t cb_sched_key;
static pthread_once_t cb_sched_once = PTHREAD_ONCE_INIT;
static _Atomic int cb_sched_ready = 0;

static void cb_sched_close(void *fd_plus_one) { close((int)(intptr_t)fd_plus_one - 1); }

static void cb_sched_make_key(void) {
    if (pthread_key_create(&cb_sched_key, cb_sched_close) == 0)
        atomic_store_explicit(&cb_sched_ready, 1, memory_order_release);
}

static void cb_sched_open(void) {
    pthread_once(&cb_sched_once, cb_sched_make_key);
    if (!atomic_load_explicit(&cb_sched_ready, memory_order_acquire) || pthread_getspecific(cb_sched_key)) return;
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%llu/schedstat", (unsigned long long)cb_thread_id());
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd >= 0 && pthread_setspecific(cb_sched_key, (void *)(intptr_t)(fd + 1)) != 0) close(fd);
}

/* The calling thread's run delay (schedstat's second field: ns runnable but not on a CPU);
 * -1 where this thread has no schedstat open (it never called cb_token_watch) or the read fails. */
static int64_t cb_sched_wait_ns(void) {
    if (!atomic_load_explicit(&cb_sched_ready, memory_order_acquire)) return -1;
    intptr_t fd = (intptr_t)pthread_getspecific(cb_sched_key) - 1;
    if (fd < 0) return -1;
    char buf[96];
    ssize_t n = pread((int)fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return -1;
    buf[n] = 0;
    const char *c = buf;
    while (*c >= '0' && *c <= '9') c++; /* the first field: time on a CPU */
    if (*c != ' ') return -1;
    c++;
    if (*c < '0' || *c > '9') return -1;
    int64_t wait = 0;
    for (; *c >= '0' && *c <= '9'; c++) wait = wait * 10 + (*c - '0');
    return wait;
}
#else
static void cb_sched_open(void) {}
static int64_t cb_sched_wait_ns(void) { return -1; }
#endif

CB_EXPORT cb_token *cb_token_new(void) {
    cb_token *t = (cb_token *)calloc(1, sizeof(cb_token));
    if (t) {
        t->probe_key = -1;
        atomic_store_explicit(&t->word_wait_ns, -1, memory_order_relaxed);
    }
    return t;
}

CB_EXPORT void cb_token_free(cb_token *t) {
    if (t) {
        free(t->log_nodes);
        free(t->log_ranges);
    }
    free(t);
}

/* Token reset contract (full text in cancel_token.h): the trial thread calls it
 * between trials, never while a native call polls the token, serialized with
 * cb_token_set. Clears the flag, set/seen stamps, polls, syncs, max_range_ns and
 * the current eval-reader range; keeps the slice and the learned costs
 * (ns_per_work, key_scale), which cb_token_forget_costs clears. */
CB_EXPORT void cb_token_reset(cb_token *t) {
    atomic_store_explicit(&t->flag, 0, memory_order_relaxed);
    atomic_store_explicit(&t->word, NULL, memory_order_relaxed);
    atomic_store_explicit(&t->word_seq, 0, memory_order_relaxed);
    atomic_store_explicit(&t->set_by_word, 0, memory_order_relaxed);
    atomic_store_explicit(&t->word_cpu_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&t->word_thread, 0, memory_order_relaxed);
    atomic_store_explicit(&t->word_wait_ns, -1, memory_order_relaxed);
    atomic_store_explicit(&t->set_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&t->seen_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&t->seen_cpu_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&t->seen_where, 0, memory_order_relaxed);
    atomic_store_explicit(&t->polls, 0, memory_order_relaxed);
    atomic_store_explicit(&t->syncs, 0, memory_order_relaxed);
    atomic_store_explicit(&t->max_range_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&t->probes, 0, memory_order_relaxed);
    atomic_store_explicit(&t->reprobes, 0, memory_order_relaxed);
    atomic_store_explicit(&t->max_range_est_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&t->max_range_cpu_ns, 0, memory_order_relaxed);
    t->range_start_ns = 0;
    t->last_ask_ticks = 0;
    t->range_nodes = 0;
    t->range_work = 0.0;
    t->range_nkeys = 0;
    t->probe_key = -1;
    atomic_thread_fence(memory_order_seq_cst);
}

/* Returns the set time; a second set keeps the first time. */
CB_EXPORT int64_t cb_token_set(cb_token *t) {
    int64_t now = cb_now_ns();
    int64_t zero = 0;
    atomic_compare_exchange_strong(&t->set_ns, &zero, now);
    atomic_store_explicit(&t->flag, 1, memory_order_release);
    return atomic_load_explicit(&t->set_ns, memory_order_relaxed);
}

/* The shared cancel word (cancel_token.h, ABI 1.1). The agent's store of a trial's
 * sequence number is read here, by every reader, instead of waiting for a thread to
 * wake and read the cancel line: one more load per poll while a word is watched. */
CB_EXPORT const void *cb_word_map(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0) return NULL;
    if (st.st_size < CB_WORD_REGION_BYTES) { errno = EINVAL; return NULL; }
    void *p = mmap(NULL, CB_WORD_REGION_BYTES, PROT_READ, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

CB_EXPORT uint64_t cb_word_load(const void *word) {
    return atomic_load_explicit((const _Atomic uint64_t *)word, memory_order_acquire);
}

CB_EXPORT void cb_word_store(void *word, uint64_t seq) {
    atomic_store_explicit((_Atomic uint64_t *)word, seq, memory_order_release);
}

CB_EXPORT void cb_token_watch(cb_token *t, const void *word, uint64_t seq) {
    if (word && seq) cb_sched_open(); /* the watching thread's run delay, for a latch on it (ABI 1.3) */
    atomic_store_explicit(&t->word_seq, word ? seq : 0, memory_order_relaxed);
    atomic_store_explicit(&t->word, (word && seq) ? (const _Atomic uint64_t *)word : NULL, memory_order_release);
}

CB_EXPORT int cb_token_set_by_word(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->set_by_word, memory_order_relaxed);
}

/* The flag, or the watched word at the trial's sequence number (then latched into the
 * flag, as cb_token_set would: the first to store set_ns decides whether the word did). */
static bool cb_flag(cb_token *t, memory_order order) {
    if (atomic_load_explicit(&t->flag, order) != 0) return true;
    const _Atomic uint64_t *w = atomic_load_explicit(&t->word, memory_order_acquire);
    if (w == NULL) return false;
    if (atomic_load_explicit(w, memory_order_acquire) != atomic_load_explicit(&t->word_seq, memory_order_relaxed))
        return false;
    int64_t zero = 0;
    if (atomic_compare_exchange_strong(&t->set_ns, &zero, cb_now_ns())) {
        atomic_store_explicit(&t->set_by_word, 1, memory_order_relaxed);
        /* once per trial, at the latch (after set_ns, so the stop's clock starts first) */
        atomic_store_explicit(&t->word_cpu_ns, cb_thread_cpu_ns(), memory_order_relaxed);
        atomic_store_explicit(&t->word_thread, cb_thread_id(), memory_order_relaxed);
        atomic_store_explicit(&t->word_wait_ns, cb_sched_wait_ns(), memory_order_relaxed);
    }
    atomic_store_explicit(&t->flag, 1, memory_order_release);
    return true;
}

CB_EXPORT int64_t cb_token_word_cpu_ns(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->word_cpu_ns, memory_order_relaxed);
}

CB_EXPORT uint64_t cb_token_word_thread(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->word_thread, memory_order_relaxed);
}

CB_EXPORT int64_t cb_token_word_wait_ns(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->word_wait_ns, memory_order_relaxed);
}

CB_EXPORT bool cb_token_is_set(const cb_token *t) {
    return cb_flag((cb_token *)t, memory_order_acquire);
}

CB_EXPORT int64_t cb_token_set_ns(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->set_ns, memory_order_relaxed);
}

CB_EXPORT int64_t cb_token_seen_ns(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->seen_ns, memory_order_relaxed);
}

CB_EXPORT int64_t cb_token_seen_cpu_ns(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->seen_cpu_ns, memory_order_relaxed);
}

CB_EXPORT int cb_token_seen_where(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->seen_where, memory_order_relaxed);
}

CB_EXPORT uint64_t cb_token_polls(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->polls, memory_order_relaxed);
}

/* The first reader to see the flag set stamps seen_ns; true for that reader. */
static bool cb_stamp_seen(cb_token *t) {
    if (atomic_load_explicit(&t->seen_ns, memory_order_relaxed) != 0) return false;
    int64_t zero = 0;
    return atomic_compare_exchange_strong(&t->seen_ns, &zero, cb_now_ns());
}

/*
 * The abort reader: llama_set_abort_callback(ctx, cb_token_reader, token).
 * Relaxed load of the flag byte; the first reader to see it set stamps seen_ns.
 */
CB_EXPORT bool cb_token_reader(void *data) {
    cb_token *t = (cb_token *)data;
    atomic_fetch_add_explicit(&t->polls, 1, memory_order_relaxed);
    if (!cb_flag(t, memory_order_relaxed)) {
        return false;
    }
    cb_stamp_seen(t);
    return true;
}

CB_EXPORT uint64_t cb_token_syncs(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->syncs, memory_order_relaxed);
}

CB_EXPORT int64_t cb_token_max_range_ns(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->max_range_ns, memory_order_relaxed);
}

CB_EXPORT int64_t cb_token_take_max_range_ns(cb_token *t) {
    atomic_store_explicit(&t->max_range_cpu_ns, 0, memory_order_relaxed);
    return atomic_exchange_explicit(&t->max_range_ns, 0, memory_order_relaxed);
}

CB_EXPORT double cb_token_ns_per_work(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->ns_per_work, memory_order_relaxed);
}

CB_EXPORT uint64_t cb_token_probes(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->probes, memory_order_relaxed);
}

CB_EXPORT int64_t cb_token_max_range_cpu_ns(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->max_range_cpu_ns, memory_order_relaxed);
}

CB_EXPORT uint64_t cb_token_reprobes(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->reprobes, memory_order_relaxed);
}

CB_EXPORT int64_t cb_token_max_range_est_ns(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->max_range_est_ns, memory_order_relaxed);
}

CB_EXPORT int64_t cb_token_slice_ns(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->slice_ns, memory_order_relaxed);
}

/* What the eval reader learned about the model it polled: the cost per unit of
 * work and the per-key scales; the current range goes with them. Between graphs. */
CB_EXPORT void cb_token_forget_costs(cb_token *t) {
    atomic_store_explicit(&t->ns_per_work, 0.0, memory_order_relaxed);
    t->cpu_per_work = 0.0;
    t->range_nodes = 0;
    t->range_work = 0.0;
    t->range_nkeys = 0;
    t->probe_key = -1;
    t->probe_work = 0.0;
    for (int i = 0; i < CB_KEYS; i++) t->key_scale[i] = 0.0f, t->key_synced[i] = 0;
    t->lifetime_syncs = 0;
    atomic_thread_fence(memory_order_seq_cst);
}

/* Sets the eval reader's slice (0 = sync after every node) and forgets the
 * learned costs: they were learned for ranges of the old slice. Between graphs. */
CB_EXPORT void cb_token_set_slice_ns(cb_token *t, int64_t slice_ns) {
    atomic_store_explicit(&t->slice_ns, slice_ns > 0 ? slice_ns : 0, memory_order_relaxed);
    cb_token_forget_costs(t);
}

/*
 * Node work. The reader weighs a node by the work its shapes imply, so a
 * range of cheap nodes (views, norms) is not sized like a range of matrix
 * products. struct ggml_tensor is read at offsets found at run time by
 * cb_eval_calibrate from real tensors of the loaded ggml (no ggml header is
 * needed to build this file); until then, or if it fails, every node weighs 1.
 */
static _Atomic int cb_layout_ready = 0;
static size_t cb_ne_off, cb_op_off, cb_flags_off, cb_src_off;
#define CB_FLAG_INPUT 1    /* GGML_TENSOR_FLAG_INPUT */
#define CB_FLAG_OUTPUT 2   /* GGML_TENSOR_FLAG_OUTPUT */
#define CB_FLAG_COMPUTE 16 /* GGML_TENSOR_FLAG_COMPUTE: unset = skipped by every backend (a non-selected branch) */
static int32_t cb_op_mul_mat;
static _Atomic int32_t cb_op_flash_attn = -1;
/* ops that move no data (ggml_op_is_empty: a reshape, view, permute, transpose), found by
 * cb_eval_calibrate_no_op from real tensors: a node of one weighs its dispatch alone */
static _Atomic uint8_t cb_op_no_op[CB_OP_CLASSES];
/* Build knobs of the cost model, for benchmarks/bench_graph_profile.py's before/after (the
 * reader before issue 26: -DCB_RANGE_KEYS=16 -DCB_RANGE_MAX_NODES=1000000000
 * -DCB_NO_OP_DISPATCH=0 -DCB_GAP_WAIT_CHECK=0 -DCB_CPU_UNIT_FIXED=0 -DCB_KEY_STALE_SYNCS=4294967295).
 * Production builds use
 * the defaults. */
#ifndef CB_NO_OP_DISPATCH
#define CB_NO_OP_DISPATCH 1
#endif
#ifndef CB_GAP_WAIT_CHECK
#define CB_GAP_WAIT_CHECK 1
#endif
#ifndef CB_CPU_UNIT_FIXED
#define CB_CPU_UNIT_FIXED 1
#endif
#define CB_NODE_WORK 1024.0  /* per-node dispatch, in element units */

static const int64_t *cb_ne(const void *t) { return (const int64_t *)((const char *)t + cb_ne_off); }

/* a: [k, m] marked input, b: [k, n], mm = ggml_mul_mat(a, b): [m, n] (ggml ne order)
 * marked output, none of them computed. Finds ne[] (int64 x4), op (after ne[4] and
 * nb[4]), flags (between op and src) and src[0], src[1].
 * Returns 1 when every field was found and checked. */
CB_EXPORT int cb_eval_calibrate(const void *a, const void *b, const void *mm, int64_t k, int64_t m, int64_t n) {
    const int64_t want_a[4] = {k, m, 1, 1}, want_mm[4] = {m, n, 1, 1};
    for (size_t ne_off = 0; ne_off <= 64; ne_off += 8) {
        const int64_t *na = (const int64_t *)((const char *)a + ne_off);
        const int64_t *nm = (const int64_t *)((const char *)mm + ne_off);
        int ok = 1;
        for (int i = 0; i < 4; i++) ok &= (na[i] == want_a[i]) & (nm[i] == want_mm[i]);
        if (!ok) continue;
        const size_t op_off = ne_off + 8 * 4 * 2;  /* ne[4], then nb[4] */
        const int32_t op_none = *(const int32_t *)((const char *)a + op_off);
        const int32_t op_mm = *(const int32_t *)((const char *)mm + op_off);
        if (op_none != 0 || op_mm <= 0) return 0;
        for (size_t src_off = op_off + 8; src_off <= 512; src_off += 8) {
            const void *const *src = (const void *const *)((const char *)mm + src_off);
            if (src[0] == a && src[1] == b) {
                size_t flags_off = 0;
                for (size_t f = op_off + 4; f + 4 <= src_off; f += 4) {
                    if (*(const int32_t *)((const char *)a + f) == CB_FLAG_INPUT &&
                        *(const int32_t *)((const char *)b + f) == 0 &&
                        *(const int32_t *)((const char *)mm + f) == CB_FLAG_OUTPUT) {
                        flags_off = f;
                        break;
                    }
                }
                if (flags_off == 0) return 0;
                cb_flags_off = flags_off;
                cb_ne_off = ne_off;
                cb_op_off = op_off;
                cb_src_off = src_off;
                cb_op_mul_mat = op_mm;
                atomic_store_explicit(&cb_layout_ready, 1, memory_order_release);
                return 1;
            }
        }
        return 0;
    }
    return 0;
}

/* After cb_eval_calibrate: fa = ggml_flash_attn_ext(q, k, v, ...) (not computed). Records
 * its op so attention weighs n_kv multiply-adds per output element. Returns 1 if checked. */
CB_EXPORT int cb_eval_calibrate_flash_attn(const void *q, const void *k, const void *fa) {
    if (!atomic_load_explicit(&cb_layout_ready, memory_order_acquire)) return 0;
    const void *const *src = (const void *const *)((const char *)fa + cb_src_off);
    const int32_t op = *(const int32_t *)((const char *)fa + cb_op_off);
    if (src[0] != q || src[1] != k || op <= 0 || op == cb_op_mul_mat) return 0;
    atomic_store_explicit(&cb_op_flash_attn, op, memory_order_release);
    return 1;
}

/* After cb_eval_calibrate: v = a view-type op of src (ggml_reshape_*, ggml_view_*, ggml_permute,
 * ggml_transpose; not computed). Records v's op as one that moves no data. Returns 1 if checked. */
CB_EXPORT int cb_eval_calibrate_no_op(const void *src, const void *v) {
    if (!atomic_load_explicit(&cb_layout_ready, memory_order_acquire)) return 0;
    const void *const *s = (const void *const *)((const char *)v + cb_src_off);
    const int32_t op = *(const int32_t *)((const char *)v + cb_op_off);
    if (s[0] != src || op <= 0 || op >= CB_OP_CLASSES || op == cb_op_mul_mat ||
        op == atomic_load_explicit(&cb_op_flash_attn, memory_order_relaxed)) return 0;
    atomic_store_explicit(&cb_op_no_op[op], 1, memory_order_release);
    return 1;
}

static double cb_node_work_class(const void *t, int *cls) {
    *cls = 0;
    if (!t || !atomic_load_explicit(&cb_layout_ready, memory_order_acquire)) {
        return 1.0;
    }
    if ((*(const int32_t *)((const char *)t + cb_flags_off) & CB_FLAG_COMPUTE) == 0) {
        /* not computed (a branch ggml_build_forward_select did not pick): still asked and
         * skipped, its dispatch alone. Weighed 1, the code predictor's 800-1100 skipped nodes
         * per range were a sliver of its estimate that the per-key update hardly moved while
         * they cost ~0.2 ms (docs/mechanisms.md) */
        return CB_NO_OP_DISPATCH ? CB_NODE_WORK : 1.0;
    }
    const int32_t op = *(const int32_t *)((const char *)t + cb_op_off);
    *cls = (op >= 0 && op < CB_OP_CLASSES) ? op : 0;
    if (CB_NO_OP_DISPATCH && atomic_load_explicit(&cb_op_no_op[*cls], memory_order_relaxed)) {
        /* a view of any size costs its dispatch alone (backends skip it): weighed by its
         * elements, a view of a large weight sat in a high work bucket whose learned scale
         * held the cost of the nodes around it (see docs/mechanisms.md) */
        return CB_NODE_WORK;
    }
    const int64_t *ne = cb_ne(t);
    double w = (double)ne[0] * (double)ne[1] * (double)ne[2] * (double)ne[3];
    const void *const *src = (const void *const *)((const char *)t + cb_src_off);
    if (op == cb_op_mul_mat && src[0]) {
        const int64_t *k = cb_ne(src[0]);  /* the weights: k x m, read once, k MACs per output */
        w = w * (double)k[0] + (double)k[0] * (double)k[1] * (double)k[2] * (double)k[3];
    } else if (op == atomic_load_explicit(&cb_op_flash_attn, memory_order_relaxed) && src[1]) {
        w = w * 2.0 * (double)cb_ne(src[1])[1];  /* q.k and p.v over n_kv keys per output element */
    }
    return w + CB_NODE_WORK;
}

CB_EXPORT double cb_node_work(const void *tensor) {
    int cls;
    return cb_node_work_class(tensor, &cls);
}

/* Asks of one range come back to back (the scheduler asks node after node
 * before computing any of them); a longer gap means the graph ran or the
 * caller was away without the reader being asked to see a node (a split or a
 * graph ended). The range then starts afresh. The gap is read from the CPU's
 * counter (a few ns; clock_gettime costs 20-80 ns on a VM and is asked once
 * per graph node): 100k ticks = 25-100 us on x86 TSCs, longer on slower counters,
 * where a missed split end only makes the next range end early. */
#define CB_ASK_GAP_TICKS 100000ULL

/* A range also ends after this many nodes, whatever their estimate. The scheduler calls back
 * only for a range the reader asked to see: a graph's tail, and a whole graph estimated under
 * one slice, run without a sync and are never measured, so an underestimate of a graph of
 * many small nodes could not correct itself (the TTS code predictor: 6501 nodes, estimated
 * under 2 ms while it cost ~5 ms, ran whole; docs/mechanisms.md). The cap bounds what runs
 * unmeasured and mixes each range's ops differently, which lets the per-key update tell them
 * apart; a sync costs ~1 us on the CPU backend, ~0.1% per 1024 nodes. */
#ifndef CB_RANGE_MAX_NODES
#define CB_RANGE_MAX_NODES 1024
#endif

/* A key no synced range has measured for this many syncs lives only where no range is
 * measured: a graph's tail, which the scheduler computes without a callback. Its next node
 * ends a range to learn it again (a re-probe). The TTS talker's output head is such a key:
 * the last nodes of a 150-node graph, never in a synced range, it cost 3 ms of CPU where the
 * scale from its one probe said 0.9 (docs/mechanisms.md). */
#ifndef CB_KEY_STALE_SYNCS
#define CB_KEY_STALE_SYNCS 256
#endif


/* The eval reader's stamp: seen_ns, the graph thread's CPU clock with it, and where. The eval
 * reader runs on the thread that computes the graph (the caller's: ggml's scheduler calls back
 * there), so the agent can set that clock against its receipt read of the same thread: the
 * engine work done before the cancel was seen. Where: at a range's sync (1), the cancel came
 * while a range the reader asked to see was computed; at a node's ask (2), it came where no
 * sync was due: a graph's unsynced tail, or the caller's own work between or before graphs
 * (building the next graph), which no reader can poll. */
static void cb_stamp_seen_eval(cb_token *t, int where) {
    if (cb_stamp_seen(t)) {
        atomic_store_explicit(&t->seen_cpu_ns, cb_thread_cpu_ns(), memory_order_relaxed);
        atomic_store_explicit(&t->seen_where, where, memory_order_relaxed);
    }
}

static inline uint64_t cb_ticks(void) {
#if defined(__x86_64__) || defined(__i386__)
    return __rdtsc();
#elif defined(__aarch64__)
    uint64_t v;
    __asm__ volatile("mrs %0, cntvct_el0" : "=r"(v));
    return v;
#else
    return (uint64_t)cb_now_ns() / 4;  /* ~ticks of a 250 MHz counter */
#endif
}

/* A gap between two asks of a range is a split or graph that ended (its tail computed, the
 * caller's own work) or the thread waiting for a CPU between two asks. A wait is not an end:
 * the nodes asked before it are computed with the ones after it, so forgetting them made that
 * range longer than its estimate (seen under load: a range of 419 + 1024 nodes estimated as
 * 1024). The thread's CPU time since the range began tells them apart: asks alone cost well
 * under CB_ASK_CPU_NS each and a wait charges the thread ~30 us (a VM's context switch), while
 * a computed tail and the caller's work between graphs (building the next one) cost more.
 * Taking a short tail for a wait only merges it into the next range, estimate and cost
 * alike. Read once per gap. */
#define CB_ASK_CPU_NS 200
#define CB_GAP_WORK_NS 100000
static bool cb_gap_was_wait(const cb_token *t) {
    if (!CB_GAP_WAIT_CHECK) return false;
    const int64_t cpu = cb_thread_cpu_ns() - t->range_cpu_ns;
    return cpu < (int64_t)t->range_nodes * CB_ASK_CPU_NS + CB_GAP_WORK_NS;
}

/* The cost key of a node: its op and the log2 bucket of its work. */
static int cb_cost_key(int cls, double w) {
    const uint64_t iw = w >= 1.0 ? (uint64_t)w : 1;
    int b = 63 - __builtin_clzll(iw) - 10;  /* work >= CB_NODE_WORK = 2^10 for computed nodes */
    if (b < 0) b = 0;
    if (b >= CB_WORK_BUCKETS) b = CB_WORK_BUCKETS - 1;
    return cls * CB_WORK_BUCKETS + b;
}

/* Follows a key's scaled work in the current range (for the per-key update). */
static void cb_range_note(cb_token *t, int key, double sw) {
    const uint32_t i = t->key_slot[key];
    if (i < t->range_nkeys && t->range_key[i] == key) {
        t->range_key_work[i] += (float)sw;
        return;
    }
    if (t->range_nkeys < CB_RANGE_KEYS) {
        t->key_slot[key] = (uint8_t)t->range_nkeys;
        t->range_key[t->range_nkeys] = (uint16_t)key;
        t->range_key_work[t->range_nkeys++] = (float)sw;
    }
}

/* Profiling log (off unless cb_token_log_enable gave it room): one row per node asked and
 * one per range, so a profile can set each range's estimate against what it cost and
 * see which nodes (op, work bucket) it held. A full log stops logging; it never wraps. */
#define CB_LOG_NODE_FIELDS 6
#define CB_LOG_RANGE_FIELDS 8

static void cb_log_node(cb_token *t, int cls, double w, double sw, int kind) {
    if (!t->log_nodes || t->log_nodes_n >= t->log_nodes_cap) return;
    double *r = t->log_nodes + CB_LOG_NODE_FIELDS * t->log_nodes_n++;
    const uint64_t iw = w >= 1.0 ? (uint64_t)w : 1;
    r[0] = (double)t->range_seq; r[1] = cls; r[2] = 63 - __builtin_clzll(iw);
    r[3] = w; r[4] = sw; r[5] = kind;
}

static void cb_log_range(cb_token *t, double est_cpu_ns, double cpu_ns, double wall_ns, int kind, double est_wall_ns) {
    if (!t->log_ranges || t->log_ranges_n >= t->log_ranges_cap) return;
    double *r = t->log_ranges + CB_LOG_RANGE_FIELDS * t->log_ranges_n++;
    r[0] = (double)t->range_seq; r[1] = t->range_nodes; r[2] = est_cpu_ns; r[3] = cpu_ns;
    r[4] = wall_ns; r[5] = kind; r[6] = est_wall_ns;
    r[7] = (double)atomic_load_explicit(&t->polls, memory_order_relaxed);
}

CB_EXPORT int cb_token_log_enable(cb_token *t, int64_t max_nodes, int64_t max_ranges) {
    free(t->log_nodes);
    free(t->log_ranges);
    t->log_nodes = t->log_ranges = NULL;
    t->log_nodes_cap = t->log_nodes_n = t->log_ranges_cap = t->log_ranges_n = 0;
    t->range_seq = 0;
    if (max_nodes <= 0 || max_ranges <= 0) return 1;
    t->log_nodes = (double *)malloc(sizeof(double) * CB_LOG_NODE_FIELDS * (size_t)max_nodes);
    t->log_ranges = (double *)malloc(sizeof(double) * CB_LOG_RANGE_FIELDS * (size_t)max_ranges);
    if (!t->log_nodes || !t->log_ranges) {
        cb_token_log_enable(t, 0, 0);
        return 0;
    }
    t->log_nodes_cap = max_nodes;
    t->log_ranges_cap = max_ranges;
    return 1;
}

static int64_t cb_log_copy(const double *src, int64_t n, int fields, void *out, int64_t max_rows) {
    if (out && src) {
        const int64_t k = n < max_rows ? n : max_rows;
        for (int64_t i = 0; i < k * fields; i++) ((double *)out)[i] = src[i];
    }
    return n;
}

CB_EXPORT int64_t cb_token_log_nodes(const cb_token *t, void *out, int64_t max_rows) {
    return cb_log_copy(t->log_nodes, t->log_nodes_n, CB_LOG_NODE_FIELDS, out, max_rows);
}

CB_EXPORT int64_t cb_token_log_ranges(const cb_token *t, void *out, int64_t max_rows) {
    return cb_log_copy(t->log_ranges, t->log_ranges_n, CB_LOG_RANGE_FIELDS, out, max_rows);
}

/* ask=true: count the node; "show me" once the range's work fills the slice. */
static bool cb_eval_ask(cb_token *t, const void *tensor) {
    atomic_fetch_add_explicit(&t->polls, 1, memory_order_relaxed);
    const uint64_t ticks = cb_ticks();
    const bool flagged = cb_flag(t, memory_order_relaxed);
    /* the range bookkeeping before the flag: a cancel seen at the first ask after a graph's
     * unsynced tail must not make that tail, and the caller's work since (building the next
     * graph), one "range" (a 1-node range of 4.2 ms in TTS cancels) */
    if (t->range_nodes == 0 || (ticks - t->last_ask_ticks > CB_ASK_GAP_TICKS && !cb_gap_was_wait(t))) {
        if (t->range_nodes > 0) cb_log_range(t, 0.0, -1.0, -1.0, -1, 0.0);  /* computed without a sync callback */
        t->range_seq++;
        t->range_start_ns = cb_now_ns();
        t->range_cpu_ns = cb_thread_cpu_ns();
        t->range_nodes = 0;
        t->range_work = 0.0;
        t->range_nkeys = 0;
        t->probe_key = -1;
    }
    t->last_ask_ticks = ticks;
    if (flagged) {
        cb_stamp_seen_eval(t, 2);
        return true;  /* stop as soon as the nodes asked so far are computed */
    }
    t->range_nodes++;
    int cls;
    const double w = cb_node_work_class(tensor, &cls);
    const int key = cb_cost_key(cls, w);
    const int64_t slice = atomic_load_explicit(&t->slice_ns, memory_order_relaxed);
    const double ns_per_work = atomic_load_explicit(&t->ns_per_work, memory_order_relaxed);
    if (ns_per_work <= 0.0) {  /* nothing learned: this node alone sets the scale */
        t->key_scale[key] = 1.0f;
        t->key_synced[key] = t->lifetime_syncs;
        t->range_work += w;
        cb_range_note(t, key, w);
        cb_log_node(t, cls, w, w, 2);
        return true;
    }
    if (slice > 0 && t->key_scale[key] > 0.0f && t->lifetime_syncs - t->key_synced[key] > CB_KEY_STALE_SYNCS) {
        t->key_scale[key] = -1.0f;  /* only ever in unmeasured stretches lately: learn it again */
    }
    if (t->key_scale[key] <= 0.0f && slice > 0) {  /* a key not seen yet (or to learn again): end the range here, learn it */
        t->probe_key = key;
        t->probe_again = t->key_scale[key] < 0.0f;
        t->probe_work = w;
        cb_log_node(t, cls, w, 0.0, 1);
        return true;
    }
    const double sw = w * (t->key_scale[key] > 0.0f ? t->key_scale[key] : 1.0f);
    t->range_work += sw;
    cb_range_note(t, key, sw);
    cb_log_node(t, cls, w, sw, 0);
    return slice == 0 || t->range_work * ns_per_work >= (double)slice || t->range_nodes >= CB_RANGE_MAX_NODES;
}

/* ask=false: the range up to this node is computed and synchronized. */
static bool cb_eval_seen(cb_token *t) {
    const int64_t now = cb_now_ns();
    atomic_fetch_add_explicit(&t->syncs, 1, memory_order_relaxed);
    t->lifetime_syncs++;
    if (t->range_nodes > 0) {
        const int64_t range_ns = now - t->range_start_ns;
        const int64_t cpu_ns = cb_thread_cpu_ns() - t->range_cpu_ns;
        const double est = atomic_load_explicit(&t->ns_per_work, memory_order_relaxed);
        if (range_ns > atomic_load_explicit(&t->max_range_ns, memory_order_relaxed)) {
            atomic_store_explicit(&t->max_range_ns, range_ns, memory_order_relaxed);
            atomic_store_explicit(&t->max_range_est_ns, (int64_t)(t->range_work * est), memory_order_relaxed);
        }
        if (cpu_ns > atomic_load_explicit(&t->max_range_cpu_ns, memory_order_relaxed)) {
            atomic_store_explicit(&t->max_range_cpu_ns, cpu_ns, memory_order_relaxed);
        }
        const double took = (double)(range_ns > 0 ? range_ns : 1);
        const double cpu = (double)(cpu_ns > 0 ? cpu_ns : 1);
        /* What the work cost, for the key scales (relative costs of ops and shapes): the
         * graph thread's CPU time when it computed the range (a CPU backend: at least a
         * twentieth of the wall time), so time spent waiting for a CPU under load is not
         * charged to the keys of the range it fell in; else (a device backend whose
         * thread sleeps through the sync) the wall time. */
        const bool cpu_live = cpu * 20.0 >= took;
        const double kt = cpu_live ? cpu : took;
        const double kest = cpu_live && t->cpu_per_work > 0.0 ? t->cpu_per_work : est;
        cb_log_range(t, t->range_work * kest, cpu, took,
                     t->probe_key >= 0 ? (t->probe_again ? 2 : 1) : (est <= 0.0 ? 3 : 0), t->range_work * est);
        if (t->probe_key >= 0 && est > 0.0) {
            /* what the known nodes should have cost; the rest is the new key's (at least a quarter) */
            double rest = kt - t->range_work * kest;
            if (rest < 0.25 * kt) rest = 0.25 * kt;
            const double sc = rest / (t->probe_work * kest);
            t->key_scale[t->probe_key] = (float)(sc < 1e-6 ? 1e-6 : (sc <= 1e9 ? sc : 1e9));
            t->key_synced[t->probe_key] = t->lifetime_syncs;
            atomic_fetch_add_explicit(t->probe_again ? &t->reprobes : &t->probes, 1, memory_order_relaxed);
        } else if (est <= 0.0) {
            const double work = t->range_work > 1.0 ? t->range_work : 1.0;
            atomic_store_explicit(&t->ns_per_work, took / work, memory_order_relaxed);
            t->cpu_per_work = cpu_live ? cpu / work : 0.0;
        } else if (t->range_work > 0.0) {
            /* r: what the range took (wall) over its estimate. The cost per unit of work
             * follows it (fast up: load arrives at once; slower down): it sizes ranges in
             * wall time, load included. */
            double r = took / (t->range_work * est);
            if (r > 8.0) r = 8.0;
            if (r < 0.125) r = 0.125;
            const double g = r > 1.0 ? 0.5 : 0.25;
            atomic_store_explicit(&t->ns_per_work, est * (1.0 + g * (r - 1.0)), memory_order_relaxed);
            /* rk: the same in cost (CPU time where live). Each key of the range moves by
             * its share of the estimate: a key that holds the range is corrected there,
             * one that is a sliver of it hardly moves. */
            double rk = kt / (t->range_work * kest);
            if (rk > 8.0) rk = 8.0;
            if (rk < 0.125) rk = 0.125;
            /* cpu_per_work is the unit the key scales are counted in: set once, then the keys
             * alone follow the cost. Moved by every range too, it and the scales drifted
             * apart along the one direction that leaves estimates unchanged until a clamp
             * broke the balance: under load the CPU unit fell toward 0 and every estimate
             * with it (ranges then ended only at the node cap; docs/mechanisms.md). */
            if (cpu_live && (t->cpu_per_work <= 0.0 || !CB_CPU_UNIT_FIXED)) {
                t->cpu_per_work = t->cpu_per_work > 0.0 ? t->cpu_per_work * (1.0 + 0.25 * (rk - 1.0))
                                                        : cpu / t->range_work;
            }
            uint32_t worst = 0;
            for (uint32_t i = 0; i < t->range_nkeys; i++) {
                const double share = t->range_key_work[i] / t->range_work;
                float *sc = &t->key_scale[t->range_key[i]];
                t->key_synced[t->range_key[i]] = t->lifetime_syncs;
                *sc = (float)(*sc * (1.0 + 0.5 * share * (rk - 1.0)));
                if (*sc < 1e-6f) *sc = 1e-6f;  /* stays learned (0 = not seen) */
                if (!(*sc <= 1e9f)) *sc = 1e9f;  /* finite (a NaN fails the test too) */
                if (t->range_key_work[i] > t->range_key_work[worst]) worst = i;
            }
            /* A range that cost over twice its estimate (in CPU time: not a wait for a
             * CPU) holds a key the shares cannot find: its biggest key is learned again
             * by a probe at its next node. */
            if (cpu_live && rk >= 2.0 && t->range_nkeys > 1) t->key_scale[t->range_key[worst]] = -1.0f;
        }
    }
    t->probe_key = -1;
    t->range_nodes = 0;
    t->range_work = 0.0;
    t->range_nkeys = 0;
    if (cb_flag(t, memory_order_relaxed)) {
        cb_stamp_seen_eval(t, 1);
        return false;
    }
    return true;
}

/*
 * ggml_backend_sched_eval_callback shape: bool (*)(struct ggml_tensor *, bool ask, void *).
 * ggml_backend_sched_compute_splits (ggml-backend.cpp) asks node after node
 * (ask=true) until the callback wants to see one, computes that whole range of
 * nodes as one graph view, synchronizes the backend, then calls again with
 * ask=false and stops the split when the callback returns false (any backend).
 *
 * The asks of a range come *before* its compute, so "has the slice passed?"
 * cannot be answered by the clock at ask time. The reader instead answers
 * "show me" once the range's nodes hold as much work as fits in the slice at
 * the learned cost per unit of work (measured over each range, its first ask
 * to its sync, an exponential average; the first range after set_slice is one
 * node). A node's work is cb_node_work (its shapes) times the learned scale
 * of its cost key, its op and the log2 bucket of its work: the first node of
 * a key not seen yet ends its range, and what that range cost beyond the known
 * nodes' share sets the key's scale (an im2col or an erf costs far more per
 * element than an add, and one op at two sizes differs too); later ranges
 * move each key by its share of the estimate, and a range that cost over twice
 * its estimate re-probes its biggest key. "Cost" for the keys is the graph
 * thread's CPU time when it computed the range (waits for a CPU are not a
 * key's cost); ns_per_work is wall time, load included. Ranges therefore last
 * about one slice, sync cost included; slice 0 syncs after every node (the
 * scheduler then runs the graph node by node). A set token is answered "show me" at once and "stop"
 * after the range, stamping seen_ns. polls counts nodes asked, syncs the
 * ranges computed.
 */
CB_EXPORT bool cb_token_eval_reader(void *tensor, bool ask, void *data) {
    cb_token *t = (cb_token *)data;
    return ask ? cb_eval_ask(t, tensor) : cb_eval_seen(t);
}

/*
 * Known-answer probe: busy-works for duration_us and checks the token at
 * start + k * period_us (k = 1, 2, ...). Returns 1 if it stopped on the token,
 * 0 if it ran to the end. *out_start_ns and *out_end_ns are on cb_now_ns().
 * Given the set time, the expected return is the first check at or after it,
 * so the harness's measured latency has a known answer.
 */
CB_EXPORT int cb_probe_busy(cb_token *t, int64_t duration_us, int64_t period_us,
                            int64_t *out_start_ns, int64_t *out_end_ns) {
    const int64_t start = cb_now_ns();
    const int64_t period_ns = (period_us > 0 ? period_us : 1) * 1000LL;
    const int64_t end = start + duration_us * 1000LL;
    volatile uint64_t sink = 0;
    int aborted = 0;
    int64_t next_check = start + period_ns;
    for (;;) {
        int64_t now = cb_now_ns();
        if (now >= next_check || now >= end) {
            if (cb_token_reader(t)) {
                aborted = 1;
                break;
            }
            if (now >= end) {
                break;
            }
            next_check += period_ns;
            continue;
        }
        for (int i = 0; i < 64; i++) {
            sink += (uint64_t)i * 2654435761u;
        }
    }
    if (out_start_ns) *out_start_ns = start;
    if (out_end_ns) *out_end_ns = cb_now_ns();
    (void)sink;
    return aborted;
}

/*
 * Simulated engine: a timed wait instead of compute. Sleeps to start +
 * k * granularity_us (k = 1, 2, ...) and checks the token there with
 * cb_token_reader (stamping seen_ns), until duration_us has passed. With no
 * token or granularity_us <= 0 it sleeps the whole duration unchecked (a native
 * call no reader reaches). Returns k, the index of the check that stopped it
 * (>= 1), or 0 if it ran to the end.
 */
static void cb_sleep_until(int64_t target_ns) {
    for (;;) {
        int64_t left = target_ns - cb_now_ns();
        if (left <= 0) return;
        struct timespec ts = {(time_t)(left / 1000000000LL), (long)(left % 1000000000LL)};
        nanosleep(&ts, NULL);
    }
}

CB_EXPORT int64_t cb_sim_wait(cb_token *t, int64_t duration_us, int64_t granularity_us,
                              int64_t *out_start_ns, int64_t *out_end_ns) {
    const int64_t start = cb_now_ns();
    const int64_t end = start + (duration_us > 0 ? duration_us : 0) * 1000LL;
    int64_t stopped_at = 0;
    if (!t || granularity_us <= 0) {
        cb_sleep_until(end);
    } else {
        const int64_t step = granularity_us * 1000LL;
        for (int64_t k = 1;; k++) {
            int64_t check = start + k * step;
            cb_sleep_until(check < end ? check : end);
            if (cb_token_reader(t)) {
                stopped_at = k;
                break;
            }
            if (check >= end) break;
        }
    }
    if (out_start_ns) *out_start_ns = start;
    if (out_end_ns) *out_end_ns = cb_now_ns();
    return stopped_at;
}
