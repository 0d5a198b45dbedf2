/*
 * cancelbench-text-engine: a C engine for the cancelbench engine protocol,
 * version 1 (docs/sut-protocol.md), written from that document alone.
 *
 * llama.cpp text decoding through the llama-cpp-python wheel's own libllama:
 * a prompt of `prompt_tokens` tokens (the input text's tokens, repeated or
 * trimmed) is prefilled in `n_batch` batches, then `max_tokens` tokens are
 * generated greedily. Every llama_decode is a step.
 *
 * Mechanisms:
 *   between_calls   the cancel flag is checked before every llama_decode call.
 *   abort_callback  libcancelbench's abort reader (cb_token_reader, the one
 *                   copy the Python package uses too), registered with
 *                   llama_set_abort_callback on the engine's cancel token,
 *                   reads its flag byte inside llama_decode (after every graph
 *                   node on CPU); an aborted llama_decode returns 2. The first
 *                   time the reader saw the flag (cb_token_seen_ns) is reported
 *                   as `cancel_seen`, its poll count as `abort_polls`.
 *   graph_eval      libcancelbench's eval reader (cb_token_eval_reader) as the
 *                   scheduler's eval callback (cb_eval) of a second llama
 *                   context, created at the first graph_eval run (cb_eval_user_data
 *                   is fixed for a context's life). ggml computes each graph in
 *                   node ranges of about `graph_slice_us` of work, syncs after
 *                   each, and stops the graph at a range's sync once the flag is
 *                   set. That stop is silent (llama_decode returns 0 with
 *                   half-computed outputs), so a decode after which the flag is
 *                   set counts as stopped and its outputs are never read (the
 *                   Python text engine's rule, device_agents/engines/text.py).
 *                   The eval reader is calibrated once per process with real,
 *                   unallocated ggml tensors (as llama_runtime.calibrate_eval_reader
 *                   does), so it weighs nodes by their shapes.
 *
 * The shared cancel word (libcancelbench ABI 1.1, docs/sut-protocol.md): when the
 * agent hands over a read-only region (CANCELBENCH_CANCEL_WORD_FD) and a run carries
 * `cancel_seq` N, the token watches the word for N, so every reader above sees the
 * cancel once the agent stores N, before the stdin thread reads the `cancel` line.
 * The receipt is the earlier of the two (`done.cancel_via` says which).
 *
 * Threads: a stdin reader thread answers `ping` at once, handles `cancel`
 * (sets the flag of the running trial, latches a cancel for a trial not yet
 * started in a bounded list, ignores one for a finished trial) and answers
 * malformed lines with `error`; it hands `load`, `run` and `shutdown` (and
 * end of input) to the main thread through a queue. Every stdout line is
 * written and flushed under one mutex. Logs go to stderr only.
 *
 * Build: native/build_sut_engine.sh (C11, pthreads, cJSON, libllama, libcancelbench
 * through pkg-config).
 */
#define _GNU_SOURCE
#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <unistd.h>

#include "ggml-backend.h"
#include "llama.h"

#include <cancelbench/cancel_token.h>

#ifndef SUT_ENGINE_VERSION
#define SUT_ENGINE_VERSION "0.1.0"
#endif
#ifndef SUT_LLAMA_CPP_PYTHON_VERSION
#define SUT_LLAMA_CPP_PYTHON_VERSION "unknown"
#endif
#ifndef SUT_LLAMA_LIB_DIR
#define SUT_LLAMA_LIB_DIR ""
#endif

#define MAX_LINE (1024 * 1024) /* the protocol's line limit, newline included */
#define MAX_TRIAL_ID 200
#define LATCH_CAP 256 /* bounded list of cancels latched for trials not yet run */
#define DONE_CAP 256  /* bounded list of finished trials whose cancels are ignored */
#define FALLBACK_TEXT "The quick brown fox jumps over the lazy dog."

/* ------------------------------------------------------------------ clock */

/* libcancelbench's clock (CLOCK_MONOTONIC, no skew in this process), so the reader's
 * seen stamp and every time this engine reports share one clock. */
static int64_t now_ns(void) {
    return cb_now_ns();
}

/* ------------------------------------------------------------------ logging */

static int g_verbose = 0;

static void logf_(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("c-text: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static void llama_log_cb(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (g_verbose || level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) fputs(text, stderr);
}

/* ------------------------------------------------------------------ output */

static pthread_mutex_t g_out_mu = PTHREAD_MUTEX_INITIALIZER;

/* Print obj as one line (cJSON's unformatted print has no newline), flush. Frees obj. */
static void emit(cJSON *obj) {
    char *s = cJSON_PrintUnformatted(obj);
    cJSON_Delete(obj);
    if (!s) {
        logf_("out of memory printing a message");
        return;
    }
    pthread_mutex_lock(&g_out_mu);
    fputs(s, stdout);
    fputc('\n', stdout);
    fflush(stdout);
    pthread_mutex_unlock(&g_out_mu);
    free(s);
}

/* Integers go in as raw JSON text: cJSON keeps numbers as doubles, which lose
 * nanosecond timestamps above 2^53 and print them in exponent form. */
static void add_i64(cJSON *obj, const char *key, int64_t v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%" PRId64, v);
    cJSON_AddRawToObject(obj, key, buf);
}

static cJSON *msg(const char *type) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", type);
    return o;
}

static void emit_error(const char *of, const char *fmt, ...) {
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    cJSON *o = msg("error");
    if (of)
        cJSON_AddStringToObject(o, "of", of);
    else
        cJSON_AddNullToObject(o, "of");
    cJSON_AddStringToObject(o, "message", buf);
    emit(o);
}

/* ------------------------------------------------------------------ sha256 */

typedef struct {
    uint32_t h[8];
    uint64_t len;
    uint8_t buf[64];
    size_t n;
} sha256_ctx;

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(sha256_ctx *c, const uint8_t *p) {
    uint32_t w[64], a, b, d, e, f, g, h, cc, t1, t2;
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = c->h[0], b = c->h[1], cc = c->h[2], d = c->h[3], e = c->h[4], f = c->h[5], g = c->h[6], h = c->h[7];
    for (int i = 0; i < 64; i++) {
        t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
        t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & cc) ^ (b & cc));
        h = g, g = f, f = e, e = d + t1, d = cc, cc = b, b = a, a = t1 + t2;
    }
    c->h[0] += a, c->h[1] += b, c->h[2] += cc, c->h[3] += d;
    c->h[4] += e, c->h[5] += f, c->h[6] += g, c->h[7] += h;
}

static void sha256_init(sha256_ctx *c) {
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(c->h, iv, sizeof iv);
    c->len = 0;
    c->n = 0;
}

static void sha256_update(sha256_ctx *c, const void *data, size_t len) {
    const uint8_t *p = data;
    c->len += len;
    while (len) {
        size_t take = 64 - c->n < len ? 64 - c->n : len;
        memcpy(c->buf + c->n, p, take);
        c->n += take, p += take, len -= take;
        if (c->n == 64) sha256_block(c, c->buf), c->n = 0;
    }
}

static void sha256_hex(sha256_ctx *c, char out[65]) {
    uint64_t bits = c->len * 8;
    uint8_t pad = 0x80, zero = 0, lenb[8];
    sha256_update(c, &pad, 1);
    while (c->n != 56) sha256_update(c, &zero, 1);
    for (int i = 0; i < 8; i++) lenb[i] = (uint8_t)(bits >> (56 - 8 * i));
    sha256_update(c, lenb, 8);
    for (int i = 0; i < 8; i++) sprintf(out + 8 * i, "%08x", c->h[i]);
    out[64] = 0;
}

/* ------------------------------------------------------------------ shared trial state */

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* guards the fields below */
static bool g_running = false;                             /* a trial is between run and its terminal state */
static char g_trial[MAX_TRIAL_ID + 1];                     /* the running trial's id */
static int64_t g_cancel_received_t = 0;                    /* when the cancel line of the running trial was read */
static struct { char id[MAX_TRIAL_ID + 1]; int64_t t; bool used; } g_latched[LATCH_CAP];
static size_t g_latch_next = 0;
static char g_done_ids[DONE_CAP][MAX_TRIAL_ID + 1];
static size_t g_done_next = 0;

/* The cancel token (libcancelbench), created in main: its flag is read by
 * cb_token_reader inside llama_decode and by the main thread between calls; it
 * stamps the first time a reader saw the flag (cb_token_seen_ns) and counts the
 * polls. Set under g_mu, and reset only by trial_begin under g_mu (the token's
 * reset contract: between trials, serialized with every set). */
static cb_token *g_tok = NULL;

/* The shared cancel word (NULL: none handed over, or it could not be mapped); mapped
 * read-only in main, before any thread starts. */
static const void *g_word = NULL;

/* The main thread's CPU clock. It calls llama_decode: the graph thread under graph_eval (with
 * n_threads 1 the only compute thread). A thread's CPU clock is brought up to date when read, also
 * from another thread of its process; a process's clock, which the agent reads from outside, lags
 * a thread running on another CPU by up to a scheduler tick. So the stop's work is read here. */
static clockid_t g_trial_clock;

static int64_t trial_cpu_ns(void) {
    struct timespec ts;
    if (clock_gettime(g_trial_clock, &ts) != 0) return 0;
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The main thread's id (cb_thread_id) and its schedstat, opened in main: its run delay, read from
 * any thread (protocol 1.3, done.cpu). */
static uint64_t g_trial_tid = 0;
static int g_sched_fd = -1;

/* The main thread's run delay (schedstat's second field, ns); -1 where none (not Linux). */
static int64_t trial_wait_ns(void) {
    if (g_sched_fd < 0) return -1;
    char buf[128];
    ssize_t n = pread(g_sched_fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return -1;
    buf[n] = 0;
    unsigned long long run, wait;
    return sscanf(buf, "%llu %llu", &run, &wait) == 2 ? (int64_t)wait : -1;
}

/* One reading of the main thread (done.cpu): when (the engine's clock), its CPU clock, its run delay
 * (-1: none); set: taken. The clock first: a CPU difference then never exceeds its wall difference
 * by more than a read's own cost. */
typedef struct { int64_t t, cpu, wait; bool set; } reading;

static reading read_trial_thread(void) {
    reading r = {now_ns(), 0, 0, true};
    r.cpu = trial_cpu_ns();
    r.wait = trial_wait_ns();
    return r;
}

static reading g_rd_run, g_rd_receipt; /* the run's start (main thread); the line's receipt (under g_mu) */

/* The running trial's progress (protocol 1.2/1.5, done.at_receipt): prompt tokens decoded, tokens
 * generated (a sampled token counts once its decode returned), whether a llama_decode is in flight.
 * Written by the main thread and snapshotted at the receipt, both under g_mu, so a receipt sees the
 * progress of the moment it was taken (the engine library's Progress.snapshot). */
typedef struct { int64_t input_done, generated; bool in_call, set; } progress;
static progress g_prog, g_prog_receipt;

/* under g_mu: the progress now, as the receipt's, once per trial */
static void note_receipt_progress_locked(void) {
    if (g_prog_receipt.set) return;
    g_prog_receipt = g_prog;
    g_prog_receipt.set = true;
}

/* any thread: set the flag (a cancel, a shutdown, end of input) */
static void token_set(void) {
    pthread_mutex_lock(&g_mu);
    cb_token_set(g_tok);
    pthread_mutex_unlock(&g_mu);
}

static bool done_contains(const char *id) {
    for (size_t i = 0; i < DONE_CAP; i++)
        if (g_done_ids[i][0] && strcmp(g_done_ids[i], id) == 0) return true;
    return false;
}

static int64_t word_received_t(void);

/* reader thread: a cancel read at t */
static void handle_cancel(const char *trial, int64_t t) {
    pthread_mutex_lock(&g_mu);
    if (g_running && strcmp(g_trial, trial) == 0) {
        if (!g_cancel_received_t) {
            g_cancel_received_t = t;
            cb_token_set(g_tok);
            g_rd_receipt = read_trial_thread(); /* right after the set, as the agent reads its trial thread */
            if (!word_received_t()) note_receipt_progress_locked(); /* a word's receipt came first: its own */
        }
    } else if (!done_contains(trial)) {
        bool present = false;
        for (size_t i = 0; i < LATCH_CAP; i++)
            if (g_latched[i].used && strcmp(g_latched[i].id, trial) == 0) present = true;
        if (!present) { /* ring: the oldest latched cancel is forgotten first */
            g_latched[g_latch_next].used = true;
            g_latched[g_latch_next].t = t;
            snprintf(g_latched[g_latch_next].id, sizeof g_latched[0].id, "%s", trial);
            g_latch_next = (g_latch_next + 1) % LATCH_CAP;
        }
    } /* else: after the trial's done: ignored */
    pthread_mutex_unlock(&g_mu);
}

/* When the token latched the word (a reader found it at the trial's cancel_seq): that
 * reader's set stamp; 0 = the word did not come first (or never came). Any thread. */
static int64_t word_received_t(void) {
    return cb_token_set_by_word(g_tok) ? cb_token_set_ns(g_tok) : 0;
}

/* The receipt: the earlier of the line's read and the word's latch (0 = none). Under g_mu. */
static int64_t receipt_locked(void) {
    int64_t w = word_received_t();
    return (w && (!g_cancel_received_t || w < g_cancel_received_t)) ? w : g_cancel_received_t;
}

/* main thread: the trial starts; returns its receipt so far (a latched cancel line, or the
 * word already at cancel_seq; 0 = none). cancel_seq 0: the run carried none. */
static int64_t trial_begin(const char *trial, uint64_t cancel_seq) {
    pthread_mutex_lock(&g_mu);
    snprintf(g_trial, sizeof g_trial, "%s", trial);
    g_cancel_received_t = 0;
    g_rd_receipt.set = false;
    g_prog = (progress){0, 0, false, false};
    g_prog_receipt = g_prog;
    g_rd_run = read_trial_thread();
    cb_token_reset(g_tok); /* flag, stamps, polls, the watch: the trial state */
    /* only this trial's number cancels it: a word left at an older trial's is not it */
    if (g_word && cancel_seq) cb_token_watch(g_tok, g_word, cancel_seq);
    for (size_t i = 0; i < LATCH_CAP; i++) {
        if (g_latched[i].used && strcmp(g_latched[i].id, trial) == 0) {
            g_latched[i].used = false;
            g_cancel_received_t = g_latched[i].t;
            cb_token_set(g_tok);
            g_rd_receipt = read_trial_thread();
        }
    }
    (void)cb_token_is_set(g_tok); /* latches the word if it already holds cancel_seq */
    g_running = true;
    int64_t r = receipt_locked();
    if (r) note_receipt_progress_locked(); /* latched before the run: no progress yet */
    pthread_mutex_unlock(&g_mu);
    return r;
}

/* What trial_end decided about a trial's cancel. */
typedef struct {
    int64_t t_terminal; /* the terminal decision */
    int64_t received_t; /* the receipt (0 = none): the earlier of line and word */
    bool via_word;      /* the word came first */
    int64_t cpu_after_ns; /* the trial thread's CPU from a line receipt to t_terminal; -1: no line receipt */
    reading receipt, terminal; /* the main thread at the receipt (a word's: its latch stamp) and at the decision */
    progress at_receipt;       /* the trial's progress at the receipt (set: there was one) */
} trial_outcome;

/* main thread: the terminal decision. After it, cancels for the trial are ignored. The word is
 * checked (cb_token_is_set latches it) before the terminal stamp, so a store seen here is a
 * receipt before the decision, and one after it is not. */
static void trial_end(trial_outcome *o) {
    pthread_mutex_lock(&g_mu);
    (void)cb_token_is_set(g_tok); /* latches the word if it holds cancel_seq: before the stamp */
    o->t_terminal = now_ns();
    o->received_t = receipt_locked();
    if (o->received_t) note_receipt_progress_locked(); /* a word latched between calls, seen only now */
    o->at_receipt = g_prog_receipt;
    o->via_word = o->received_t && o->received_t != g_cancel_received_t;
    /* a word receipt has no such reading: the engine cannot read its CPU at the agent's store */
    o->terminal = read_trial_thread();
    o->cpu_after_ns = o->received_t && !o->via_word ? o->terminal.cpu - g_rd_receipt.cpu : -1;
    o->receipt = g_rd_receipt;
    if (o->via_word) { /* the latching reader's CPU stamp and run delay, if it ran on this thread */
        reading latch = {cb_token_set_ns(g_tok), cb_token_word_cpu_ns(g_tok), cb_token_word_wait_ns(g_tok),
                         cb_token_word_cpu_ns(g_tok) != 0};
        o->receipt = latch;
        o->receipt.set = latch.set && cb_token_word_thread(g_tok) == g_trial_tid;
    }
    if (!o->received_t) o->receipt.set = false;
    g_running = false;
    snprintf(g_done_ids[g_done_next], sizeof g_done_ids[0], "%s", g_trial);
    g_done_next = (g_done_next + 1) % DONE_CAP;
    pthread_mutex_unlock(&g_mu);
}

static int64_t cancel_received_now(void) {
    pthread_mutex_lock(&g_mu);
    int64_t r = receipt_locked();
    pthread_mutex_unlock(&g_mu);
    return r;
}

/* main thread: a llama_decode starts (in_call) or returned. A word a reader latched inside the call
 * is a receipt with the call in flight: its progress is taken on the return, before the call is
 * shown as over (a line's was taken when it was read). */
static void progress_call(bool in_call) {
    pthread_mutex_lock(&g_mu);
    if (!in_call && receipt_locked()) note_receipt_progress_locked();
    g_prog.in_call = in_call;
    pthread_mutex_unlock(&g_mu);
}

/* main thread: a step's work done (prompt tokens decoded so far, tokens generated so far) */
static void progress_done(int64_t input_done, int64_t generated) {
    pthread_mutex_lock(&g_mu);
    g_prog.input_done = input_done;
    g_prog.generated = generated;
    pthread_mutex_unlock(&g_mu);
}

/* ------------------------------------------------------------------ queue to the main thread */

typedef struct job {
    cJSON *msg; /* NULL = end of input */
    struct job *next;
} job;

static pthread_mutex_t g_q_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_q_cv = PTHREAD_COND_INITIALIZER;
static job *g_q_head = NULL, *g_q_tail = NULL;

static void enqueue(cJSON *m) {
    job *j = calloc(1, sizeof *j);
    if (!j) abort();
    j->msg = m;
    pthread_mutex_lock(&g_q_mu);
    if (g_q_tail)
        g_q_tail->next = j;
    else
        g_q_head = j;
    g_q_tail = j;
    pthread_cond_signal(&g_q_cv);
    pthread_mutex_unlock(&g_q_mu);
}

static cJSON *dequeue(bool *eof) {
    pthread_mutex_lock(&g_q_mu);
    while (!g_q_head) pthread_cond_wait(&g_q_cv, &g_q_mu);
    job *j = g_q_head;
    g_q_head = j->next;
    if (!g_q_head) g_q_tail = NULL;
    pthread_mutex_unlock(&g_q_mu);
    cJSON *m = j->msg;
    *eof = (m == NULL);
    free(j);
    return m;
}

/* ------------------------------------------------------------------ validation helpers */

static bool is_int(const cJSON *v) {
    return cJSON_IsNumber(v) && isfinite(v->valuedouble) && v->valuedouble == floor(v->valuedouble) &&
           v->valuedouble >= -9223372036854775808.0 && v->valuedouble < 9223372036854775808.0;
}

static bool is_trial_id(const cJSON *v) {
    return cJSON_IsString(v) && v->valuestring[0] && strlen(v->valuestring) <= MAX_TRIAL_ID;
}

/* run.cancel_seq: absent, or an integer the agent's JSON and cJSON's doubles both hold exactly */
static bool is_cancel_seq(const cJSON *v) {
    return !v || (is_int(v) && v->valuedouble >= 1.0 && v->valuedouble <= 9007199254740991.0);
}

/* ------------------------------------------------------------------ stdin reader thread */

static void *reader_main(void *arg) {
    (void)arg;
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, stdin)) != -1) {
        int64_t t_read = now_ns();
        if (n > MAX_LINE) {
            emit_error(NULL, "line of %zd bytes exceeds the 1 MiB limit", n);
            continue;
        }
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = 0;
        if (n == 0) continue; /* blank line: nothing to answer */
        cJSON *m = cJSON_ParseWithLength(line, (size_t)n);
        if (!m || !cJSON_IsObject(m)) {
            cJSON_Delete(m);
            emit_error(NULL, "not a JSON object: %.200s", line);
            continue;
        }
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(m, "type");
        if (!cJSON_IsString(type)) {
            cJSON_Delete(m);
            emit_error(NULL, "message without a string 'type'");
            continue;
        }
        const char *ty = type->valuestring;
        if (strcmp(ty, "ping") == 0) {
            const cJSON *id = cJSON_GetObjectItemCaseSensitive(m, "id");
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(m, "t");
            if (!is_int(id) || !is_int(t)) {
                emit_error("ping", "ping needs integer 'id' and 't'");
            } else {
                cJSON *o = msg("pong");
                add_i64(o, "id", (int64_t)id->valuedouble);
                add_i64(o, "t", t_read);
                emit(o);
            }
            cJSON_Delete(m);
        } else if (strcmp(ty, "cancel") == 0) {
            const cJSON *trial = cJSON_GetObjectItemCaseSensitive(m, "trial");
            if (!is_trial_id(trial))
                emit_error("cancel", "cancel needs a 'trial' string of 1-200 characters");
            else
                handle_cancel(trial->valuestring, t_read);
            cJSON_Delete(m);
        } else if (strcmp(ty, "load") == 0) {
            if (!cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(m, "models")) ||
                !cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(m, "settings"))) {
                emit_error("load", "load needs objects 'models' and 'settings'");
                cJSON_Delete(m);
            } else {
                enqueue(m);
            }
        } else if (strcmp(ty, "run") == 0) {
            const cJSON *settings = cJSON_GetObjectItemCaseSensitive(m, "settings");
            const cJSON *out = cJSON_GetObjectItemCaseSensitive(m, "output_path");
            if (!is_trial_id(cJSON_GetObjectItemCaseSensitive(m, "trial")) ||
                !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(m, "mechanism")) ||
                !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(m, "input")) ||
                (settings && !cJSON_IsObject(settings)) || (out && !cJSON_IsString(out) && !cJSON_IsNull(out))) {
                emit_error("run", "run needs strings 'trial' (1-200 characters), 'mechanism' and 'input'");
                cJSON_Delete(m);
            } else if (!is_cancel_seq(cJSON_GetObjectItemCaseSensitive(m, "cancel_seq"))) {
                emit_error("run", "run.cancel_seq must be an integer in [1, 2^53 - 1]");
                cJSON_Delete(m);
            } else {
                enqueue(m);
            }
        } else if (strcmp(ty, "shutdown") == 0) {
            /* sent between trials; one that comes during a run cuts it short (exit within 5 s) */
            token_set();
            enqueue(m);
        } else {
            emit_error(ty, "unknown message type '%.64s'", ty);
            cJSON_Delete(m);
        }
    }
    free(line);
    /* End of input: the agent is gone. Stop the running trial, tell the main thread. */
    token_set();
    enqueue(NULL);
    return NULL;
}

/* ------------------------------------------------------------------ settings */

typedef struct {
    const char *name;
    long long def, min, max;
    const char *doc;
} int_setting;

enum { S_N_THREADS, S_N_CTX, S_N_BATCH, S_PROMPT_TOKENS, S_MAX_TOKENS, S_GRAPH_SLICE_US, S_COUNT };

static const int_setting SETTINGS[S_COUNT] = {
    [S_N_THREADS] = {"n_threads", 2, 1, 512, "compute threads of llama_decode"},
    [S_N_CTX] = {"n_ctx", 512, 16, 1 << 20, "context size (tokens); prompt_tokens + max_tokens must fit"},
    [S_N_BATCH] = {"n_batch", 64, 1, 1 << 16, "prefill batch (tokens per llama_decode step)"},
    [S_PROMPT_TOKENS] = {"prompt_tokens", 64, 1, 1 << 20, "prompt length: the input's tokens repeated or trimmed to this"},
    [S_MAX_TOKENS] = {"max_tokens", 8, 1, 1 << 20, "tokens generated greedily (one llama_decode step each)"},
    /* the built-in engines' setting (cancelbench/engine_decls.py): its default is
     * DEFAULT_GRAPH_SLICE_US there, its max its int32 record column's (2^31 - 1 us) */
    [S_GRAPH_SLICE_US] = {"graph_slice_us", 2000, 0, 2147483647LL,
                          "graph_eval: eval-reader work per synchronized node range, us (0: every node)"},
};

static long long g_set[S_COUNT];

/* ------------------------------------------------------------------ llama state */

static struct llama_model *g_model = NULL;
static struct llama_context *g_ctx = NULL;
static struct llama_context *g_ctx_eval = NULL; /* graph_eval's: the eval reader as cb_eval; made at its first run */
static struct llama_sampler *g_smpl = NULL;
static const struct llama_vocab *g_vocab = NULL;

static void unload(void) {
    if (g_smpl) llama_sampler_free(g_smpl), g_smpl = NULL;
    if (g_ctx) llama_free(g_ctx), g_ctx = NULL;
    if (g_ctx_eval) llama_free(g_ctx_eval), g_ctx_eval = NULL;
    if (g_model) llama_model_free(g_model), g_model = NULL;
    g_vocab = NULL;
}

/* A context for the loaded model. n_ubatch = n_batch: one graph per llama_decode, so a graph_eval
 * stop ends the call (llama_decode would go on to a next ubatch). hooked: the eval reader is the
 * scheduler's eval callback on the engine's token (graph_eval). */
static struct llama_context *new_context(const long long *vals, bool hooked) {
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)vals[S_N_CTX];
    cp.n_batch = (uint32_t)vals[S_N_BATCH];
    cp.n_ubatch = (uint32_t)vals[S_N_BATCH];
    cp.n_seq_max = 1;
    cp.n_threads = (int32_t)vals[S_N_THREADS];
    cp.n_threads_batch = (int32_t)vals[S_N_THREADS];
    cp.offload_kqv = false;
    cp.op_offload = false;
    cp.no_perf = true;
    if (hooked) {
        cp.cb_eval = (ggml_backend_sched_eval_callback)cb_token_eval_reader;
        cp.cb_eval_user_data = g_tok;
    }
    return llama_init_from_model(g_model, cp);
}

static void do_load(const cJSON *m) {
    const cJSON *models = cJSON_GetObjectItemCaseSensitive(m, "models");
    const cJSON *settings = cJSON_GetObjectItemCaseSensitive(m, "settings");
    long long vals[S_COUNT];
    for (int i = 0; i < S_COUNT; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(settings, SETTINGS[i].name);
        if (!v || cJSON_IsNull(v)) {
            vals[i] = SETTINGS[i].def;
            continue;
        }
        if (!is_int(v)) {
            emit_error("load", "setting %s must be an int", SETTINGS[i].name);
            return;
        }
        double d = v->valuedouble;
        if (d < (double)SETTINGS[i].min || d > (double)SETTINGS[i].max) {
            emit_error("load", "setting %s = %.0f is outside [%lld, %lld]", SETTINGS[i].name, d, SETTINGS[i].min,
                       SETTINGS[i].max);
            return;
        }
        vals[i] = (long long)d;
    }
    if (vals[S_PROMPT_TOKENS] + vals[S_MAX_TOKENS] > vals[S_N_CTX]) {
        emit_error("load", "prompt_tokens + max_tokens = %lld does not fit n_ctx = %lld",
                   vals[S_PROMPT_TOKENS] + vals[S_MAX_TOKENS], vals[S_N_CTX]);
        return;
    }
    const cJSON *path = cJSON_GetObjectItemCaseSensitive(models, "model");
    if (!cJSON_IsString(path) || !path->valuestring[0]) {
        emit_error("load", "load.models.model (the GGUF path) is required");
        return;
    }
    unload();
    struct llama_model_params mp = llama_model_default_params();
    static ggml_backend_dev_t no_devices[1] = {NULL}; /* CPU only: no offload devices */
    mp.devices = no_devices;
    mp.n_gpu_layers = 0;
    g_model = llama_model_load_from_file(path->valuestring, mp);
    if (!g_model) {
        emit_error("load", "llama_model_load_from_file failed for %s", path->valuestring);
        return;
    }
    g_ctx = new_context(vals, false);
    if (!g_ctx) {
        unload();
        emit_error("load", "llama_init_from_model failed (n_ctx %lld, n_batch %lld)", vals[S_N_CTX], vals[S_N_BATCH]);
        return;
    }
    if ((long long)llama_n_ctx(g_ctx) < vals[S_PROMPT_TOKENS] + vals[S_MAX_TOKENS]) {
        long long got = llama_n_ctx(g_ctx);
        unload();
        emit_error("load", "the context holds %lld tokens, fewer than prompt_tokens + max_tokens", got);
        return;
    }
    g_vocab = llama_model_get_vocab(g_model);
    g_smpl = llama_sampler_init_greedy();
    memcpy(g_set, vals, sizeof vals);
    /* between trials: the slice, and what the eval reader learned is forgotten (a new model) */
    cb_token_set_slice_ns(g_tok, (int64_t)vals[S_GRAPH_SLICE_US] * 1000);
    cJSON *o = msg("loaded");
    add_i64(o, "t", now_ns());
    cJSON *eff = cJSON_AddObjectToObject(o, "settings");
    add_i64(eff, "n_ctx", (int64_t)llama_n_ctx(g_ctx));
    add_i64(eff, "n_batch", (int64_t)llama_n_batch(g_ctx));
    add_i64(eff, "n_threads", (int64_t)llama_n_threads(g_ctx));
    emit(o);
}

/* ------------------------------------------------------------------ a trial */

typedef enum { MECH_UNKNOWN = -1, MECH_BETWEEN_CALLS, MECH_ABORT_CALLBACK, MECH_GRAPH_EVAL, MECH_COUNT } mechanism;

static const char *MECH_NAMES[MECH_COUNT] = {"between_calls", "abort_callback", "graph_eval"};

static mechanism mechanism_of(const char *name) {
    for (int i = 0; i < MECH_COUNT; i++)
        if (strcmp(name, MECH_NAMES[i]) == 0) return (mechanism)i;
    return MECH_UNKNOWN;
}

static const char *PHASE_PREFILL = "prefill", *PHASE_GENERATE = "generate";

static void emit_phase(const char *trial, const char *phase) {
    cJSON *o = msg("phase");
    cJSON_AddStringToObject(o, "trial", trial);
    cJSON_AddStringToObject(o, "phase", phase);
    add_i64(o, "t", now_ns());
    emit(o);
}

static void emit_step(const char *trial, const char *phase, const char *edge, int64_t t) {
    cJSON *o = msg("step");
    cJSON_AddStringToObject(o, "trial", trial);
    cJSON_AddStringToObject(o, "phase", phase);
    cJSON_AddStringToObject(o, "edge", edge);
    add_i64(o, "t", t);
    emit(o);
}

typedef struct {
    const char *trial;
    mechanism mech;
    struct llama_context *ctx; /* g_ctx; g_ctx_eval under graph_eval */
    const char *phase;
    bool seen_sent;
    int64_t native_returned_t;
    int32_t last_rc;
    int64_t decode_calls;
} run_state;

/* One step: llama_decode of `n` tokens, framed by step events; its status in rs->last_rc.
 * Returns whether a native reader stopped it: abort_callback's aborted decode returns 2;
 * graph_eval's stopped graph returns 0 (silent), so a decode after which the flag is set
 * counts as stopped whatever it returned, and its outputs are never read (text.py's rule). */
static bool step_decode(run_state *rs, llama_token *toks, int32_t n) {
    int64_t t0 = now_ns();
    emit_step(rs->trial, rs->phase, "start", t0);
    progress_call(true);
    int32_t rc = llama_decode(rs->ctx, llama_batch_get_one(toks, n));
    int64_t t1 = now_ns();
    progress_call(false);
    rs->last_rc = rc;
    rs->decode_calls++;
    bool stopped = (rs->mech == MECH_GRAPH_EVAL || rc == 2) && cb_token_is_set(g_tok);
    if (!rs->native_returned_t) {
        int64_t rcv = cancel_received_now();
        /* the call in flight when the cancel was read, or the call the cancel stopped */
        if ((rcv && rcv <= t1) || rc == 2) rs->native_returned_t = t1;
    }
    int64_t seen = cb_token_seen_ns(g_tok);
    if (seen && !rs->seen_sent) { /* before the step's end: timestamps stay in order */
        rs->seen_sent = true;
        cJSON *o = msg("cancel_seen");
        cJSON_AddStringToObject(o, "trial", rs->trial);
        add_i64(o, "t", seen);
        const char *where[] = {NULL, "range_end", "next_ask"};
        int w = cb_token_seen_where(g_tok);
        if (w == 1 || w == 2) cJSON_AddStringToObject(o, "where", where[w]); /* protocol 1.3 */
        int64_t cpu_t = cb_token_seen_cpu_ns(g_tok); /* stamped on the graph thread: this one */
        if (cpu_t > 0) add_i64(o, "cpu_t", cpu_t);
        emit(o);
    }
    emit_step(rs->trial, rs->phase, "end", t1);
    return stopped;
}

/* The trial's counters: the record's abort_polls / decode_rc / n_input_tokens columns, and under
 * graph_eval the eval reader's own counts (cancel_token.h), which the protocol has no field for:
 * where it first saw the flag (0 not the eval reader, 1 at a range's sync, 2 at a node's ask), the
 * ranges synced, the longest range in wall and in the graph thread's CPU time (at slice 0 one node:
 * the largest node's cost, the calibration of graph_eval's bound). */
static void add_counters(cJSON *o, const run_state *rs, int64_t n_gen, int64_t n_prompt, int64_t cpu_after_ns) {
    cJSON *counters = cJSON_AddObjectToObject(o, "counters");
    add_i64(counters, "tokens_generated", n_gen);
    add_i64(counters, "n_input_tokens", n_prompt);
    add_i64(counters, "decode_rc", rs->last_rc);
    add_i64(counters, "abort_polls", (int64_t)cb_token_polls(g_tok)); /* graph_eval: nodes asked */
    add_i64(counters, "decode_calls", rs->decode_calls);
    if (rs->mech == MECH_GRAPH_EVAL) {
        add_i64(counters, "eval_syncs", (int64_t)cb_token_syncs(g_tok));
        add_i64(counters, "eval_seen_where", cb_token_seen_where(g_tok));
        add_i64(counters, "eval_max_range_ns", cb_token_max_range_ns(g_tok));
        add_i64(counters, "eval_max_range_cpu_ns", cb_token_max_range_cpu_ns(g_tok));
    }
    /* the stop's engine work: the trial thread's CPU from the cancel's receipt to the terminal decision */
    if (cpu_after_ns >= 0) add_i64(counters, "trial_cpu_after_receipt_ns", cpu_after_ns);
}

/* done.at_receipt (protocol 1.2, native_call 1.5): the progress when the cancel was taken */
static void add_at_receipt(cJSON *o, const progress *p) {
    cJSON *at = cJSON_AddObjectToObject(o, "at_receipt");
    add_i64(at, "input_tokens_done", p->input_done);
    add_i64(at, "tokens_generated", p->generated);
    if (p->in_call) cJSON_AddStringToObject(at, "native_call", "llama_decode");
}

static void add_reading(cJSON *cpu, const char *moment, reading r) {
    char key[32];
    if (!r.set) return;
    snprintf(key, sizeof key, "%s_t", moment);
    add_i64(cpu, key, r.t);
    snprintf(key, sizeof key, "%s_cpu", moment);
    add_i64(cpu, key, r.cpu);
    if (r.wait >= 0) {
        snprintf(key, sizeof key, "%s_wait", moment);
        add_i64(cpu, key, r.wait);
    }
}

/* done.cpu (protocol 1.3): the main thread's readings at the run's start, the receipt, the terminal
 * decision and now, the done's sending (docs/sut-protocol.md). */
static void add_cpu(cJSON *o, const trial_outcome *to) {
    cJSON *cpu = cJSON_AddObjectToObject(o, "cpu");
    add_reading(cpu, "run", g_rd_run);
    add_reading(cpu, "receipt", to->receipt);
    add_reading(cpu, "terminal", to->terminal);
    add_reading(cpu, "end", read_trial_thread());
}

static void do_run(const cJSON *m) {
    const char *trial = cJSON_GetObjectItemCaseSensitive(m, "trial")->valuestring;
    const char *mech_name = cJSON_GetObjectItemCaseSensitive(m, "mechanism")->valuestring;
    const char *input = cJSON_GetObjectItemCaseSensitive(m, "input")->valuestring;
    const cJSON *seq = cJSON_GetObjectItemCaseSensitive(m, "cancel_seq"); /* checked by the reader thread */

    run_state rs = {.trial = trial, .mech = mechanism_of(mech_name), .phase = PHASE_PREFILL};
    const char *err = NULL;
    char errbuf[512];
    bool cancelled = false;
    llama_token *prompt = NULL, *content = NULL, *out = NULL;
    int64_t n_prompt = 0, n_gen = 0;

    int64_t latched = trial_begin(trial, seq ? (uint64_t)seq->valuedouble : 0);
    emit_phase(trial, PHASE_PREFILL);
    if (rs.mech == MECH_UNKNOWN) {
        snprintf(errbuf, sizeof errbuf,
                 "unknown mechanism '%.64s' (declared: between_calls, abort_callback, graph_eval)", mech_name);
        err = errbuf;
        goto finish;
    }
    if (latched) { /* a cancel latched before the run: end it without doing its work */
        cancelled = true;
        goto finish;
    }
    if (!g_ctx) {
        err = "run before a successful load";
        goto finish;
    }
    if (rs.mech == MECH_GRAPH_EVAL && !g_ctx_eval && !(g_ctx_eval = new_context(g_set, true))) {
        err = "llama_init_from_model failed for graph_eval's context";
        goto finish;
    }
    rs.ctx = rs.mech == MECH_GRAPH_EVAL ? g_ctx_eval : g_ctx;

    /* the prompt: BOS (if the model adds one) + the input's tokens, repeated or trimmed */
    const int64_t want = g_set[S_PROMPT_TOKENS];
    prompt = malloc(sizeof(llama_token) * (size_t)want);
    out = malloc(sizeof(llama_token) * (size_t)g_set[S_MAX_TOKENS]);
    const char *text = input[0] ? input : FALLBACK_TEXT;
    int32_t len = (int32_t)strlen(text);
    /* a token covers at least one byte; no special tokens are added here */
    int32_t cap = (len > (int32_t)strlen(FALLBACK_TEXT) ? len : (int32_t)strlen(FALLBACK_TEXT)) + 8;
    content = malloc(sizeof(llama_token) * (size_t)cap);
    if (!prompt || !out || !content) {
        err = "out of memory";
        goto finish;
    }
    int32_t nc = llama_tokenize(g_vocab, text, len, content, cap, false, false);
    if (nc <= 0) { /* the input made no tokens: fall back to a fixed text */
        nc = llama_tokenize(g_vocab, FALLBACK_TEXT, (int32_t)strlen(FALLBACK_TEXT), content, cap, false, false);
        if (nc <= 0) {
            err = "tokenizing the input failed";
            goto finish;
        }
    }
    if (llama_vocab_get_add_bos(g_vocab) && llama_vocab_bos(g_vocab) != LLAMA_TOKEN_NULL)
        prompt[n_prompt++] = llama_vocab_bos(g_vocab);
    for (int64_t i = 0; n_prompt < want; i++) prompt[n_prompt++] = content[i % nc];

    /* a stopped decode's positions stay in the KV cache until here: the next run clears them */
    llama_memory_clear(llama_get_memory(rs.ctx), true);
    llama_sampler_reset(g_smpl);
    llama_set_abort_callback(rs.ctx, rs.mech == MECH_ABORT_CALLBACK ? cb_token_reader : NULL,
                             rs.mech == MECH_ABORT_CALLBACK ? (void *)g_tok : NULL);

    /* prefill: n_batch tokens per llama_decode */
    for (int64_t pos = 0; pos < n_prompt; pos += g_set[S_N_BATCH]) {
        if (rs.mech == MECH_BETWEEN_CALLS && cb_token_is_set(g_tok)) {
            cancelled = true;
            goto finish;
        }
        int32_t n = (int32_t)(n_prompt - pos < g_set[S_N_BATCH] ? n_prompt - pos : g_set[S_N_BATCH]);
        if (step_decode(&rs, prompt + pos, n)) {
            cancelled = true;
            goto finish;
        }
        if (rs.last_rc != 0) {
            snprintf(errbuf, sizeof errbuf, "llama_decode returned %d in prefill", rs.last_rc);
            err = errbuf;
            goto finish;
        }
        progress_done(pos + n, 0);
    }

    /* generate: greedy, one token per llama_decode; end-of-generation tokens do not stop
     * it (a fixed amount of work per trial) */
    rs.phase = PHASE_GENERATE;
    emit_phase(trial, PHASE_GENERATE);
    for (int64_t i = 0; i < g_set[S_MAX_TOKENS]; i++) {
        if (rs.mech == MECH_BETWEEN_CALLS && cb_token_is_set(g_tok)) {
            cancelled = true;
            goto finish;
        }
        llama_token tok = llama_sampler_sample(g_smpl, rs.ctx, -1);
        out[n_gen++] = tok;
        if (step_decode(&rs, &tok, 1)) {
            cancelled = true;
            goto finish;
        }
        if (rs.last_rc != 0) {
            snprintf(errbuf, sizeof errbuf, "llama_decode returned %d in generate", rs.last_rc);
            err = errbuf;
            goto finish;
        }
        progress_done(n_prompt, n_gen);
    }

finish:;
    if (rs.ctx) llama_set_abort_callback(rs.ctx, NULL, NULL);
    trial_outcome to;
    trial_end(&to);
    /* a cancel received before the terminal decision (line or word) is never dropped */
    if (!err && to.received_t) cancelled = true;
    cJSON *o = msg("done");
    cJSON_AddStringToObject(o, "trial", trial);
    cJSON_AddStringToObject(o, "outcome", err ? "error" : cancelled ? "cancelled" : "completed");
    add_i64(o, "t", to.t_terminal);
    cJSON_AddStringToObject(o, "phase", rs.phase);
    if (to.received_t) {
        add_i64(o, "cancel_received_t", to.received_t);
        cJSON_AddStringToObject(o, "cancel_via", to.via_word ? "word" : "line");
    }
    if (rs.native_returned_t && to.received_t) add_i64(o, "native_returned_t", rs.native_returned_t);
    if (to.received_t && to.at_receipt.set) add_at_receipt(o, &to.at_receipt);
    if (err) cJSON_AddStringToObject(o, "error", err);
    if (!err && !cancelled) {
        sha256_ctx sc;
        char hex[65];
        sha256_init(&sc);
        for (int64_t i = 0; i < n_gen; i++) { /* token ids as 4-byte little-endian integers */
            uint32_t v = (uint32_t)out[i];
            uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
            sha256_update(&sc, b, 4);
        }
        sha256_hex(&sc, hex);
        cJSON_AddStringToObject(o, "output_sha256", hex);
    }
    add_counters(o, &rs, n_gen, n_prompt, to.cpu_after_ns);
    add_cpu(o, &to);
    emit(o);
    free(prompt);
    free(content);
    free(out);
}

/* ------------------------------------------------------------------ eval reader calibration */

static bool g_eval_calibrated = false;

/* Shows the eval reader real, unallocated tensors of the loaded ggml (none is computed), so it
 * finds ne[], op, flags and src[] in this ggml's struct ggml_tensor and weighs graph nodes by
 * their shapes: a [k, m] input times [k, n] (mul_mat, then in a graph), a flash attention, and
 * the view ops that move no data. The same tensors as llama_runtime.calibrate_eval_reader.
 * Returns whether every step checked; if not, nodes weigh 1 (ranges sized by count). Once, in
 * main, after the backends are loaded and before any graph runs. */
static bool calibrate_eval_reader(void) {
    struct ggml_init_params ip = {(1 << 16) + ggml_graph_overhead_custom(16, false), NULL, true};
    struct ggml_context *ctx = ggml_init(ip);
    if (!ctx) return false;
    const int64_t k = 48, m = 80, n = 7;
    struct ggml_tensor *a = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
    struct ggml_tensor *b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
    struct ggml_tensor *mm = ggml_mul_mat(ctx, a, b);
    ggml_set_input(a);
    ggml_set_output(mm);
    bool ok = cb_eval_calibrate(a, b, mm, k, m, n);
    if (ok) { /* outside a graph a node is not computed (its dispatch alone); in one, its m*n*k */
        double before = cb_node_work(mm);
        ggml_build_forward_expand(ggml_new_graph_custom(ctx, 16, false), mm);
        ok = before <= 1024 && 1024 < m * n * k && m * n * k < cb_node_work(mm);
    }
    if (ok) { /* head dim 64, 8 query tokens, 32 kv, 2 heads, F16 */
        struct ggml_tensor *q = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, 64, 8, 2);
        struct ggml_tensor *kt = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, 64, 32, 2);
        struct ggml_tensor *vt = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, 64, 32, 2);
        ok = cb_eval_calibrate_flash_attn(q, kt, ggml_flash_attn_ext(ctx, q, kt, vt, NULL, 0.125f, 0.0f, 0.0f));
    }
    struct ggml_tensor *views[4] = {NULL};
    if (ok) {
        views[0] = ggml_reshape_1d(ctx, a, k * m);
        views[1] = ggml_view_1d(ctx, a, k, 0);
        views[2] = ggml_permute(ctx, a, 1, 0, 2, 3);
        views[3] = ggml_transpose(ctx, a);
    }
    for (int i = 0; ok && i < 4; i++) ok = cb_eval_calibrate_no_op(a, views[i]);
    ggml_free(ctx);
    return ok;
}

/* ------------------------------------------------------------------ the shared cancel word */

/* Maps the region the agent handed over read-only (CB_WORD_FD_ENV names its descriptor), or
 * leaves g_word NULL: no variable, not a descriptor number, or not a region (cancels then go by
 * the line alone). The mapping outlives the descriptor, which is closed. */
static void map_cancel_word(void) {
    const char *v = getenv(CB_WORD_FD_ENV);
    if (!v || !v[0]) return;
    char *end = NULL;
    errno = 0;
    long fd = strtol(v, &end, 10);
    if (errno || *end || fd < 0 || fd > INT32_MAX) {
        logf_("%s=%.32s is not a descriptor number: no cancel word", CB_WORD_FD_ENV, v);
        return;
    }
    g_word = cb_word_map((int)fd);
    if (!g_word) logf_("%s=%ld could not be mapped (%s): no cancel word", CB_WORD_FD_ENV, fd, strerror(errno));
    close((int)fd);
}

/* ------------------------------------------------------------------ hello */

static void emit_hello(void) {
    cJSON *o = msg("hello");
    add_i64(o, "protocol", 1);
    cJSON *eng = cJSON_AddObjectToObject(o, "engine");
    cJSON_AddStringToObject(eng, "name", "c-text");
    cJSON_AddStringToObject(eng, "version", SUT_ENGINE_VERSION);

    cJSON *build = cJSON_AddObjectToObject(o, "build");
    char backends[1024] = "";
    for (size_t i = 0; i < ggml_backend_reg_count(); i++) {
        const char *name = ggml_backend_reg_name(ggml_backend_reg_get(i));
        if (strlen(backends) + strlen(name) + 2 < sizeof backends) {
            if (backends[0]) strcat(backends, ",");
            strcat(backends, name);
        }
    }
    cJSON_AddStringToObject(build, "backend", "cpu");
    cJSON_AddStringToObject(build, "ggml_backends", backends);
    char sysinfo[1024];
    snprintf(sysinfo, sizeof sysinfo, "%s", llama_print_system_info());
    for (char *p = sysinfo; *p; p++)
        if (*p == '\n') *p = ' ';
    cJSON_AddStringToObject(build, "system_info", sysinfo);
    cJSON_AddStringToObject(build, "llama_cpp_python", SUT_LLAMA_CPP_PYTHON_VERSION);
#if defined(__clang__)
    cJSON_AddStringToObject(build, "compiler", "clang " __clang_version__);
#elif defined(__GNUC__)
    cJSON_AddStringToObject(build, "compiler", "gcc " __VERSION__);
#else
    cJSON_AddStringToObject(build, "compiler", "unknown");
#endif
    cJSON_AddStringToObject(build, "cjson", cJSON_Version());
    cJSON_AddStringToObject(build, "eval_reader_calibrated", g_eval_calibrated ? "yes" : "no");

    cJSON_AddStringToObject(o, "clock", "CLOCK_MONOTONIC");
    cJSON_AddStringToObject(o, "input", "text");
    cJSON *phases = cJSON_AddArrayToObject(o, "phases");
    const char *pn[2] = {PHASE_PREFILL, PHASE_GENERATE};
    for (int i = 0; i < 2; i++) {
        cJSON *p = cJSON_CreateObject();
        cJSON_AddStringToObject(p, "name", pn[i]);
        cJSON_AddTrueToObject(p, "steps");
        cJSON_AddItemToArray(phases, p);
    }
    cJSON *mechs = cJSON_AddArrayToObject(o, "mechanisms");
    cJSON *mb = cJSON_CreateObject();
    cJSON_AddStringToObject(mb, "name", "between_calls");
    cJSON_AddStringToObject(mb, "reaches", "a flag checked before every llama_decode call (between steps)");
    cJSON_AddItemToArray(mechs, mb);
    cJSON *ma = cJSON_CreateObject();
    cJSON_AddStringToObject(ma, "name", "abort_callback");
    cJSON_AddStringToObject(ma, "reaches",
                            "inside llama_decode on CPU: the engine's abort reader (llama_set_abort_callback) "
                            "reads the flag after every graph node");
    cJSON_AddItemToArray(mechs, ma);
    cJSON *mg = cJSON_CreateObject();
    cJSON_AddStringToObject(mg, "name", "graph_eval");
    cJSON_AddStringToObject(mg, "reaches",
                            "inside llama_decode's graph (CPU here): the eval reader as ggml's scheduler eval "
                            "callback syncs node ranges of about graph_slice_us and stops the graph at the next "
                            "range's sync (a node's ask when none is due); the stopped decode's outputs are dropped");
    cJSON_AddItemToArray(mechs, mg);
    cJSON *settings = cJSON_AddArrayToObject(o, "settings");
    for (int i = 0; i < S_COUNT; i++) {
        cJSON *s = cJSON_CreateObject();
        cJSON_AddStringToObject(s, "name", SETTINGS[i].name);
        cJSON_AddStringToObject(s, "type", "int");
        add_i64(s, "default", SETTINGS[i].def);
        add_i64(s, "min", SETTINGS[i].min);
        add_i64(s, "max", SETTINGS[i].max);
        cJSON_AddStringToObject(s, "doc", SETTINGS[i].doc);
        cJSON_AddItemToArray(settings, s);
    }
    /* the shared cancel word is compiled in: declared whether or not this process was handed one */
    cJSON *caps = cJSON_AddArrayToObject(o, "capabilities");
    cJSON_AddItemToArray(caps, cJSON_CreateString("cancel_word"));
    emit(o);
}

/* ------------------------------------------------------------------ main */

static void quit(int status) {
    pthread_mutex_lock(&g_out_mu);
    fflush(stdout);
    pthread_mutex_unlock(&g_out_mu);
    fflush(stderr);
    /* _exit: the reader thread is blocked in read(); skip library destructors */
    _exit(status);
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--verbose") == 0 || strcmp(argv[i], "-v") == 0)
            g_verbose = 1;
        else if (strcmp(argv[i], "--version") == 0) {
            printf("cancelbench-text-engine %s (protocol 1)\n", SUT_ENGINE_VERSION);
            return 0;
        } else {
            fprintf(stderr, "usage: %s [--verbose] [--version]\n"
                            "speaks the cancelbench engine protocol 1 on stdin/stdout\n", argv[0]);
            return 2;
        }
    }
    if (cb_abi_version() / 1000 != CANCELBENCH_ABI_VERSION_MAJOR ||
        cb_abi_version() % 1000 < CANCELBENCH_ABI_VERSION_MINOR) {
        fprintf(stderr, "libcancelbench ABI %d is not %d.%d or a later minor\n", cb_abi_version(),
                CANCELBENCH_ABI_VERSION_MAJOR, CANCELBENCH_ABI_VERSION_MINOR);
        return 1;
    }
    if (pthread_getcpuclockid(pthread_self(), &g_trial_clock) != 0) {
        fprintf(stderr, "no CPU clock for the main thread\n");
        return 1;
    }
    g_trial_tid = cb_thread_id();
#ifdef __linux__
    {
        char path[64];
        snprintf(path, sizeof path, "/proc/self/task/%llu/schedstat", (unsigned long long)g_trial_tid);
        g_sched_fd = open(path, O_RDONLY | O_CLOEXEC); /* -1: no run delay in done.cpu */
    }
#endif
    g_tok = cb_token_new();
    if (!g_tok) {
        fprintf(stderr, "out of memory (cancel token)\n");
        return 1;
    }
    map_cancel_word();
    llama_log_set(llama_log_cb, NULL);
    llama_backend_init();
    if (!ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU) && SUT_LLAMA_LIB_DIR[0])
        ggml_backend_load_all_from_path(SUT_LLAMA_LIB_DIR); /* a wheel built with dynamic backends */
    g_eval_calibrated = calibrate_eval_reader();
    if (!g_eval_calibrated) logf_("eval reader calibration failed: graph_eval weighs every node 1");
    emit_hello();

    pthread_t reader;
    if (pthread_create(&reader, NULL, reader_main, NULL) != 0) {
        logf_("cannot start the stdin reader thread: %s", strerror(errno));
        return 1;
    }
    for (;;) {
        bool eof;
        cJSON *m = dequeue(&eof);
        if (eof) {
            logf_("end of input: exiting");
            quit(0);
        }
        const char *ty = cJSON_GetObjectItemCaseSensitive(m, "type")->valuestring;
        if (strcmp(ty, "load") == 0)
            do_load(m);
        else if (strcmp(ty, "run") == 0)
            do_run(m);
        else if (strcmp(ty, "shutdown") == 0) {
            cJSON_Delete(m);
            quit(0);
        }
        cJSON_Delete(m);
    }
}

