/*
 * cancelbench native cancel token.
 *
 * The token's first byte is the cancel flag, so a plain `uint8_t *` reader
 * (the shape llamadart and other bindings use) can read the same memory.
 * `cb_token_reader` is the exact `bool (*)(void *)` llama_set_abort_callback
 * and mtmd's cb_eval-style hooks need: no Python runs on the compute thread.
 *
 * Every agent-side timestamp comes from cb_now_ns(), so the time a reader
 * first saw the flag and the Python-side timestamps share one clock domain.
 */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#if defined(_WIN32)
#define CB_EXPORT __declspec(dllexport)
#else
#define CB_EXPORT __attribute__((visibility("default")))
#endif

typedef struct cb_token {
    _Atomic uint8_t flag;      /* offset 0: non-zero means abort */
    _Atomic int64_t set_ns;    /* when cb_token_set stored the flag */
    _Atomic int64_t seen_ns;   /* first time a reader saw the flag set; 0 = never */
    _Atomic uint64_t polls;    /* reader calls since the last reset */
} cb_token;

/* A constant added to the agent clock. Zero in production; tests set it to
 * inject a known skew between agent and driver clocks (clock-offset check). */
static _Atomic int64_t cb_clock_skew_ns = 0;

CB_EXPORT void cb_set_clock_skew_ns(int64_t skew) {
    atomic_store_explicit(&cb_clock_skew_ns, skew, memory_order_relaxed);
}

CB_EXPORT int64_t cb_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + (int64_t)ts.tv_nsec
           + atomic_load_explicit(&cb_clock_skew_ns, memory_order_relaxed);
}

CB_EXPORT cb_token *cb_token_new(void) {
    cb_token *t = (cb_token *)calloc(1, sizeof(cb_token));
    return t;
}

CB_EXPORT void cb_token_free(cb_token *t) { free(t); }

CB_EXPORT void cb_token_reset(cb_token *t) {
    atomic_store_explicit(&t->flag, 0, memory_order_relaxed);
    atomic_store_explicit(&t->set_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&t->seen_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&t->polls, 0, memory_order_relaxed);
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

CB_EXPORT bool cb_token_is_set(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->flag, memory_order_acquire) != 0;
}

CB_EXPORT int64_t cb_token_set_ns(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->set_ns, memory_order_relaxed);
}

CB_EXPORT int64_t cb_token_seen_ns(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->seen_ns, memory_order_relaxed);
}

CB_EXPORT uint64_t cb_token_polls(const cb_token *t) {
    return atomic_load_explicit(&((cb_token *)t)->polls, memory_order_relaxed);
}

/*
 * The abort reader: llama_set_abort_callback(ctx, cb_token_reader, token).
 * Relaxed load of the flag byte; the first reader to see it set stamps seen_ns.
 */
CB_EXPORT bool cb_token_reader(void *data) {
    cb_token *t = (cb_token *)data;
    atomic_fetch_add_explicit(&t->polls, 1, memory_order_relaxed);
    if (atomic_load_explicit(&t->flag, memory_order_relaxed) == 0) {
        return false;
    }
    if (atomic_load_explicit(&t->seen_ns, memory_order_relaxed) == 0) {
        int64_t zero = 0;
        atomic_compare_exchange_strong(&t->seen_ns, &zero, cb_now_ns());
    }
    return true;
}

/*
 * ggml_backend_sched_eval_callback shape: bool (*)(struct ggml_tensor *, bool ask, void *).
 * Asked before each node (ask=true) it must return true to be shown the node;
 * after the node (ask=false) returning false stops the graph compute.
 * Used where llama's abort callback does not reach (clip / mtmd graphs).
 */
CB_EXPORT bool cb_token_eval_reader(void *tensor, bool ask, void *data) {
    (void)tensor;
    if (ask) {
        return true;
    }
    return !cb_token_reader(data);
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
