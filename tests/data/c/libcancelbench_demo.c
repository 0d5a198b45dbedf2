/*
 * libcancelbench_demo: a program that uses libcancelbench through its installed
 * header and pkg-config alone (tests/test_libcancelbench.py builds and runs it).
 *
 *   libcancelbench_demo TEXT_MODEL [ASR_TEXT_MODEL ASR_MMPROJ]
 *
 * 1. token: set, read (cb_token_is_set, the flag byte at offset 0), reset.
 * 2. llama.cpp: cb_token_reader on llama_set_abort_callback stops a real
 *    llama_decode of TEXT_MODEL mid-graph: a second thread sets the token once
 *    the reader has been polled (decode under way), llama_decode returns 2.
 * 3. mtmd/clip (with the ASR fixture): cb_token_eval_reader as
 *    mtmd_context_params.cb_eval stops the audio encoder's clip graph: the same
 *    encode is run once unstopped (its node count) and once with the token set
 *    from a second thread once nodes are asked.
 *
 * Output: key=value lines, one fact each, for the test to assert on. Whether a
 * cancel landed mid-graph depends on the scheduler (a busy host can finish the
 * graph before the setter runs): each stop is tried a few times with the setter
 * thread, then once with the token set before the call ("mode=preset").
 */
#define _GNU_SOURCE
#include <cancelbench/cancel_token.h>

#include "llama.h"
#include "ggml-backend.h"
#ifdef DEMO_WITH_MTMD
#include "mtmd.h"
#endif

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ATTEMPTS 5

/* ----------------------------------------------------------- the setter thread */

struct setter {
    cb_token *t;
    atomic_int stop;          /* the call under test returned */
    uint64_t polls_at_set;    /* the reader's polls when the token was set (0 = not set) */
    pthread_t th;
};

/* Waits on observable state (the reader's poll count), never on a clock. */
static void *setter_main(void *arg) {
    struct setter *s = arg;
    while (!atomic_load(&s->stop)) {
        const uint64_t p = cb_token_polls(s->t);
        if (p > 0) {
            cb_token_set(s->t);
            s->polls_at_set = p;
            return NULL;
        }
        sched_yield();
    }
    return NULL;
}

static void setter_start(struct setter *s, cb_token *t) {
    s->t = t;
    atomic_store(&s->stop, 0);
    s->polls_at_set = 0;
    if (pthread_create(&s->th, NULL, setter_main, s) != 0) {
        fprintf(stderr, "pthread_create failed\n");
        exit(1);
    }
}

static void setter_join(struct setter *s) {
    atomic_store(&s->stop, 1);
    pthread_join(s->th, NULL);
}

static void print_stamps(const char *p, const cb_token *t) {
    const int64_t set = cb_token_set_ns(t), seen = cb_token_seen_ns(t);
    printf("%s.set_ns=%lld\n", p, (long long)set);
    printf("%s.seen_ns=%lld\n", p, (long long)seen);
    printf("%s.seen_after_set=%d\n", p, set > 0 && seen >= set);
    printf("%s.seen_where=%d\n", p, cb_token_seen_where(t));
    printf("%s.seen_cpu_ns=%lld\n", p, (long long)cb_token_seen_cpu_ns(t));
    printf("%s.polls=%llu\n", p, (unsigned long long)cb_token_polls(t));
    printf("%s.syncs=%llu\n", p, (unsigned long long)cb_token_syncs(t));
}

/* ----------------------------------------------------------- 1. the token */

static int demo_token(void) {
    cb_token *t = cb_token_new();
    if (!t) return 1;
    printf("abi.runtime=%d\n", cb_abi_version());
    printf("abi.header=%d\n", CANCELBENCH_ABI_VERSION);
    printf("token.before_set=%d\n", cb_token_is_set(t));
    printf("token.reader_before_set=%d\n", cb_token_reader(t));
    const int64_t set_ns = cb_token_set(t);
    const int64_t again = cb_token_set(t);
    printf("token.set_ns_positive=%d\n", set_ns > 0);
    printf("token.second_set_keeps_first=%d\n", again == set_ns && cb_token_set_ns(t) == set_ns);
    printf("token.is_set=%d\n", cb_token_is_set(t));
    printf("token.flag_byte=%d\n", *(volatile const uint8_t *)t != 0);
    printf("token.reader_after_set=%d\n", cb_token_reader(t));
    printf("token.seen_after_set=%d\n", cb_token_seen_ns(t) >= set_ns);
    printf("token.polls=%llu\n", (unsigned long long)cb_token_polls(t));
    cb_token_set_slice_ns(t, 123456);
    cb_token_reset(t);
    printf("token.reset_clears=%d\n", !cb_token_is_set(t) && cb_token_set_ns(t) == 0 && cb_token_seen_ns(t) == 0
                                          && cb_token_polls(t) == 0 && *(volatile const uint8_t *)t == 0);
    printf("token.reset_keeps_slice=%d\n", cb_token_slice_ns(t) == 123456);
    cb_token_free(t);
    return 0;
}

/* ----------------------------------------------------------- 2. llama_decode + abort callback */

static int demo_llama(const char *path) {
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(path, mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", path); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_threads = 2;
    cp.n_threads_batch = 2;
    cp.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context\n"); return 1; }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    enum { N = 384 };
    static llama_token toks[N];
    for (int i = 0; i < N; i++) toks[i] = (llama_token)((i * 7 + 1) % n_vocab);

    cb_token *t = cb_token_new();
    llama_set_abort_callback(ctx, cb_token_reader, t);
    int rc = -1;
    const char *mode = "thread";
    uint64_t polls_at_set = 0;
    for (int a = 0; a <= ATTEMPTS; a++) {
        llama_memory_clear(llama_get_memory(ctx), true);
        cb_token_reset(t);  /* between calls: nothing polls the token */
        struct setter s;
        if (a < ATTEMPTS) {
            setter_start(&s, t);
        } else {
            mode = "preset";  /* the setter never landed inside a decode: set it first */
            cb_token_set(t);
        }
        rc = llama_decode(ctx, llama_batch_get_one(toks, N));
        if (a < ATTEMPTS) {
            setter_join(&s);
            polls_at_set = s.polls_at_set;
        }
        printf("llama.attempt%d.rc=%d\n", a, rc);
        if (rc == 2) break;
    }
    printf("llama.mode=%s\n", mode);
    printf("llama.rc=%d\n", rc);
    printf("llama.polls_at_set=%llu\n", (unsigned long long)polls_at_set);
    print_stamps("llama", t);
    /* the context stays usable after the abort */
    llama_set_abort_callback(ctx, NULL, NULL);
    llama_memory_clear(llama_get_memory(ctx), true);
    printf("llama.after_abort_rc=%d\n", llama_decode(ctx, llama_batch_get_one(toks, 8)));
    llama_free(ctx);
    llama_model_free(model);
    cb_token_free(t);
    return 0;
}

/* ----------------------------------------------------------- 3. mtmd/clip + eval reader */

#ifdef DEMO_WITH_MTMD
static int demo_mtmd(const char *text_model, const char *mmproj) {
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(text_model, mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", text_model); return 1; }
    cb_token *t = cb_token_new();
    cb_token_set_slice_ns(t, 0);  /* sync after every node: polls = nodes asked */
    struct mtmd_context_params p = mtmd_context_params_default();
    p.use_gpu = false;
    p.n_threads = 2;
    p.print_timings = false;
    p.warmup = false;
    p.cb_eval = (ggml_backend_sched_eval_callback)cb_token_eval_reader;
    p.cb_eval_user_data = t;
    mtmd_context *m = mtmd_init_from_file(mmproj, model, p);
    if (!m) { fprintf(stderr, "cannot load the mmproj %s\n", mmproj); return 1; }
    printf("mtmd.audio=%d\n", mtmd_support_audio(m));
    const int rate = mtmd_get_audio_sample_rate(m);
    const size_t n = (size_t)(rate > 0 ? rate : 16000);  /* one second of a 440 Hz tone */
    float *pcm = malloc(n * sizeof *pcm);
    for (size_t i = 0; i < n; i++) pcm[i] = 0.3f * sinf(2.0f * 3.14159265f * 440.0f * (float)i / (float)n);
    mtmd_bitmap *bmp = mtmd_bitmap_init_from_audio(n, pcm);
    mtmd_input_chunks *chunks = mtmd_input_chunks_init();
    const char *marker = mtmd_default_marker();
    struct mtmd_input_text txt = {marker, strlen(marker), false, true};
    const mtmd_bitmap *bitmaps[1] = {bmp};
    const int32_t tk = mtmd_tokenize(m, chunks, &txt, bitmaps, 1);
    printf("mtmd.tokenize_rc=%d\n", tk);
    const mtmd_input_chunk *audio = NULL;
    for (size_t i = 0; i < mtmd_input_chunks_size(chunks); i++) {
        const mtmd_input_chunk *c = mtmd_input_chunks_get(chunks, i);
        if (mtmd_input_chunk_get_type(c) == MTMD_INPUT_CHUNK_TYPE_AUDIO) audio = c;
    }
    if (tk != 0 || !audio) { fprintf(stderr, "no audio chunk\n"); return 1; }

    /* the whole encode, unstopped: how many nodes the reader is asked about */
    cb_token_reset(t);
    const int32_t rc_full = mtmd_encode_chunk(m, audio);
    const uint64_t polls_full = cb_token_polls(t);
    printf("mtmd.full_rc=%d\n", rc_full);
    printf("mtmd.full_polls=%llu\n", (unsigned long long)polls_full);
    printf("mtmd.full_seen_ns=%lld\n", (long long)cb_token_seen_ns(t));

    const char *mode = "thread";
    int32_t rc = -1;
    uint64_t polls_at_set = 0;
    for (int a = 0; a <= ATTEMPTS; a++) {
        cb_token_reset(t);
        struct setter s;
        if (a < ATTEMPTS) {
            setter_start(&s, t);
        } else {
            mode = "preset";
            cb_token_set(t);
        }
        rc = mtmd_encode_chunk(m, audio);
        if (a < ATTEMPTS) {
            setter_join(&s);
            polls_at_set = s.polls_at_set;
        }
        const uint64_t polls = cb_token_polls(t);
        printf("mtmd.attempt%d.polls=%llu\n", a, (unsigned long long)polls);
        if (cb_token_seen_ns(t) > 0 && polls < polls_full) break;
    }
    printf("mtmd.mode=%s\n", mode);
    printf("mtmd.rc=%d\n", rc);
    printf("mtmd.polls_at_set=%llu\n", (unsigned long long)polls_at_set);
    print_stamps("mtmd", t);
    mtmd_input_chunks_free(chunks);
    mtmd_bitmap_free(bmp);
    free(pcm);
    mtmd_free(m);
    llama_model_free(model);
    cb_token_free(t);
    return 0;
}
#endif

static void quiet(enum ggml_log_level level, const char *text, void *ud) {
    (void)ud;
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char **argv) {
    if (argc != 2 && argc != 4) {
        fprintf(stderr, "usage: %s TEXT_MODEL [ASR_TEXT_MODEL ASR_MMPROJ]\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (cb_abi_version() / 1000 != CANCELBENCH_ABI_VERSION_MAJOR) {
        fprintf(stderr, "libcancelbench ABI %d, built against %d\n", cb_abi_version(), CANCELBENCH_ABI_VERSION);
        return 1;
    }
    llama_log_set(quiet, NULL);
#ifdef DEMO_WITH_MTMD
    mtmd_log_set(quiet, NULL);
#endif
    llama_backend_init();
#ifdef DEMO_LLAMA_LIB_DIR
    if (!ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)) ggml_backend_load_all_from_path(DEMO_LLAMA_LIB_DIR);
#endif
    if (demo_token() != 0) return 1;
    if (demo_llama(argv[1]) != 0) return 1;
#ifdef DEMO_WITH_MTMD
    if (argc == 4 && demo_mtmd(argv[2], argv[3]) != 0) return 1;
#endif
    llama_backend_free();
    printf("done=1\n");
    return 0;
}
