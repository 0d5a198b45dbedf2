/*
 * cancelbench native cancel token: the whole exported interface.
 *
 * Two builds of one source (cancel_token.c):
 *   - libcancelbench, the C library with a versioned ABI: installed by
 *     native/build_libcancelbench.sh (`make setup`) as <prefix>/include/cancelbench/
 *     cancel_token.h, <prefix>/lib/libcancelbench.so.<major> (+ .a) and
 *     <prefix>/lib/pkgconfig/cancelbench.pc, prefix build/libcancelbench/ here.
 *     The shipped C engine (native/sut_text_engine.c) links it; docs/native-readers.md.
 *   - the Python package's ctypes library, built by setup.py (Linux and macOS)
 *     and loaded by cancelbench.native (native/__init__.py); its declarations
 *     there are checked against this header by tests/test_native_interface.py.
 *
 * ABI versioning: CANCELBENCH_ABI_VERSION_MAJOR is the shared library's SONAME
 * version (libcancelbench.so.<major>); it changes when an exported function is
 * removed or changes its signature or meaning, or a documented layout guarantee
 * (the flag byte at offset 0) changes. _MINOR grows when functions are added.
 * A program built against major M, minor m runs with a library whose
 * cb_abi_version() has the same major and a minor >= m.
 *
 * Units: every *_ns value is nanoseconds on the agent clock, cb_now_ns()
 * (CLOCK_MONOTONIC plus a test-only skew); every *_us argument is microseconds.
 *
 * Threads, in the terms used below:
 *   - "any thread": lock-free atomics only; may run concurrently with anything,
 *     including a graph polling the token (a counter read then is a snapshot).
 *   - "the graph thread": the thread running the ggml scheduler that was given
 *     the token as cb_eval user data; the eval reader's range state is plain
 *     memory owned by that thread, so one token serves one running graph at a
 *     time.
 *   - "between graphs": no native call that polls the token (abort reader or
 *     eval reader) is in flight; in cancelbench, the trial thread before or
 *     after a trial's native calls.
 *
 * Token reset contract (cb_token_reset):
 *   Who:   the trial thread (the agent before each trial; CancelControl when it
 *          moves a trial to the token a hooked context polls).
 *   When:  between trials, never while a native call polls the token, and
 *          serialized with cb_token_set by the caller (a set racing a reset
 *          can be lost; cancelbench holds the control's lock across both).
 *   Clears (trial state): the flag, the watched word (cb_token_watch), set_by_word,
 *          word_cpu_ns, word_thread, word_wait_ns,
 *          set_ns, seen_ns, seen_cpu_ns, seen_where, polls, syncs,
 *          max_range_ns, the debug counters (probes, reprobes, max_range_est_ns,
 *          max_range_cpu_ns), and
 *          the eval reader's current range (its start, nodes, work, and any
 *          key being probed).
 *   Keeps (configuration and what was learned about the model):
 *          the slice (cb_token_set_slice_ns), the learned cost per unit of
 *          work (ns_per_work) and the learned per-key scales (a key: an op
 *          and the log2 bucket of a node's work). These describe
 *          the model, backend and slice, not a trial; re-learning them every
 *          trial would make each trial's first ranges probes. They are
 *          forgotten by cb_token_forget_costs (call it when the token is bound
 *          to a new model/context) and by cb_token_set_slice_ns.
 *   The process-wide tensor layout from cb_eval_calibrate* belongs to the
 *   loaded ggml, not to a token or a model, and is never cleared.
 */
#ifndef CANCELBENCH_CANCEL_TOKEN_H
#define CANCELBENCH_CANCEL_TOKEN_H

#include <stdbool.h>
#include <stdint.h>

#define CANCELBENCH_ABI_VERSION_MAJOR 1
#define CANCELBENCH_ABI_VERSION_MINOR 3
/* major * 1000 + minor: what cb_abi_version() returns from this build */
#define CANCELBENCH_ABI_VERSION (CANCELBENCH_ABI_VERSION_MAJOR * 1000 + CANCELBENCH_ABI_VERSION_MINOR)

/* Every function below is exported; both builds compile with -fvisibility=hidden,
 * so nothing else in cancel_token.c is. */
#ifndef CB_EXPORT
#define CB_EXPORT __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Opaque. Its first byte is the cancel flag (non-zero = abort), so a binding
 * that only knows "a byte at this address" can read or set it. */
typedef struct cb_token cb_token;

/* --- ABI version ------------------------------------------------------ */

/* The library's ABI version, major * 1000 + minor (CANCELBENCH_ABI_VERSION of
 * the header it was built from). Check at start-up: cb_abi_version() / 1000 ==
 * CANCELBENCH_ABI_VERSION_MAJOR and cb_abi_version() % 1000 >=
 * CANCELBENCH_ABI_VERSION_MINOR. Any thread. */
CB_EXPORT int cb_abi_version(void);

/* --- agent clock ------------------------------------------------------- */

/* Adds a constant skew (ns) to cb_now_ns. Test hook only (clock-offset
 * estimation); zero in production. Any thread; set it before the first
 * timestamp is taken (cancelbench.native does so when it loads the library). */
CB_EXPORT void cb_set_clock_skew_ns(int64_t skew);

/* The agent clock: CLOCK_MONOTONIC in ns plus the test skew. Any thread. */
CB_EXPORT int64_t cb_now_ns(void);

/* --- token lifetime and trial state ------------------------------------ */

/* A new zeroed token (flag clear, slice 0, nothing learned); NULL if out of
 * memory. Any thread. */
CB_EXPORT cb_token *cb_token_new(void);

/* Frees the token. Only once no context can poll it any more (the contexts
 * that hold it as callback user data are freed or never run again). */
CB_EXPORT void cb_token_free(cb_token *t);

/* Clears the trial state, keeps slice and learned costs (see the reset
 * contract above). The trial thread, between trials; never while a native
 * call polls the token. */
CB_EXPORT void cb_token_reset(cb_token *t);

/* Sets the flag; returns the set time (ns). A second set keeps the first
 * time. Any thread, at any time: this is the cancel path. */
CB_EXPORT int64_t cb_token_set(cb_token *t);

/* Whether the flag is set (acquire load), or the watched word holds the trial's
 * sequence number (cb_token_watch; the flag is then latched). Any thread. */
CB_EXPORT bool cb_token_is_set(const cb_token *t);

/* When cb_token_set first stored the flag (ns); 0 = not set. Any thread. */
CB_EXPORT int64_t cb_token_set_ns(const cb_token *t);

/* When a native reader first saw the flag set (ns); 0 = never. Any thread. */
CB_EXPORT int64_t cb_token_seen_ns(const cb_token *t);

/* The eval reader's stamp of seen_ns also stamps the CPU clock of the thread that
 * computes the graph (CLOCK_THREAD_CPUTIME_ID, ns); 0 = the flag was not first seen
 * by the eval reader (another reader, or not seen). Cleared by reset. Any thread. */
CB_EXPORT int64_t cb_token_seen_cpu_ns(const cb_token *t);

/* Where the eval reader stamped seen_ns: 0 = not the eval reader, 1 = at the sync of a range
 * it asked to see (the cancel came while that range was computed), 2 = at a node's ask (it
 * came where no sync was due: a graph's unsynced tail, the caller's work between or before
 * graphs). Cleared by reset. Any thread. */
CB_EXPORT int cb_token_seen_where(const cb_token *t);

/* Abort-reader calls plus graph nodes the eval reader was asked about, since
 * the last reset. Any thread. */
CB_EXPORT uint64_t cb_token_polls(const cb_token *t);

/* --- the shared cancel word (ABI 1.1) ---------------------------------- */

/* The cancel word is the first 8 bytes (a uint64_t, 8-byte aligned) of a small
 * shared-memory region (CB_WORD_REGION_BYTES) that the agent creates per engine
 * process and the engine inherits as a file descriptor, named by the environment
 * variable CB_WORD_FD_ENV (docs/sut-protocol.md, "The shared cancel word"): on
 * Linux a read-only descriptor of a memfd sealed against future writes; on macOS
 * (not run in CI) a duplicate of the agent's shm descriptor, which cb_word_map
 * maps read-only. To cancel trial N the agent stores N (the run's cancel_seq, >= 1) in the
 * word before it writes the cancel line; 0 means no cancel. A trial's token
 * watches the word for its own sequence number only, so a word left at N never
 * cancels trial N + 1. */
#define CB_WORD_FD_ENV "CANCELBENCH_CANCEL_WORD_FD"
#define CB_WORD_REGION_BYTES 4096

/* Maps the region of fd (the inherited descriptor) read-only and returns the
 * word's address, or NULL (errno set: not a region of at least
 * CB_WORD_REGION_BYTES, or mmap failed). The mapping lives until the process
 * exits. Any thread, once at start-up. */
CB_EXPORT const void *cb_word_map(int fd);

/* The word's value (an acquire load); 0 = no cancel stored. Any thread. */
CB_EXPORT uint64_t cb_word_load(const void *word);

/* The agent's side: stores seq in the word (a release store). Any thread. */
CB_EXPORT void cb_word_store(void *word, uint64_t seq);

/* From now until the next cb_token_reset, the token counts as set once
 * *word == seq: every reader of the token (cb_token_reader, cb_token_eval_reader,
 * cb_token_is_set, cb_probe_busy, cb_sim_wait) that finds it so latches the flag
 * as cb_token_set would (set_ns = that moment, unless cb_token_set came first)
 * and then behaves as for a set flag. word NULL or seq 0: stop watching.
 * cb_token_reset clears the watch (a watch is trial state: watch again after
 * each reset, with the new trial's sequence number). A thread's first watch
 * opens its schedstat (Linux: one file descriptor per watching thread, closed
 * when the thread exits) for cb_token_word_wait_ns. The trial thread, between
 * graphs, after cb_token_reset. */
CB_EXPORT void cb_token_watch(cb_token *t, const void *word, uint64_t seq);

/* 1 if the flag was latched from the watched word (a reader found *word == seq
 * before any cb_token_set), else 0. Cleared by reset. Any thread. */
CB_EXPORT int cb_token_set_by_word(const cb_token *t);

/* ABI 1.2: the latch's stamps, for the stop's CPU account (docs/sut-protocol.md, done.cpu).
 * The reader that latched the word stamps its own thread's CPU clock
 * (CLOCK_THREAD_CPUTIME_ID, ns) and that thread's id (cb_thread_id) at the latch; both 0 =
 * not latched from the word. A caller compares the thread with its trial thread's
 * cb_thread_id: the CPU clock is that thread's only. Cleared by reset. Any thread. */
CB_EXPORT int64_t cb_token_word_cpu_ns(const cb_token *t);
CB_EXPORT uint64_t cb_token_word_thread(const cb_token *t);

/* ABI 1.3: that thread's run delay at the latch (Linux schedstat's second field, ns: time
 * runnable but not on a CPU), read just after its CPU clock; -1 = not read: not latched
 * from the word, not Linux, or the latching thread never called cb_token_watch (the
 * watching thread opens its schedstat there, so the latch costs one pread, about 2 us).
 * Protocol done.cpu.receipt_wait. Cleared by reset. Any thread. */
CB_EXPORT int64_t cb_token_word_wait_ns(const cb_token *t);

/* The calling thread's id as the kernel numbers it (Linux: gettid; macOS:
 * pthread_threadid_np); 0 where neither exists. Any thread. */
CB_EXPORT uint64_t cb_thread_id(void);

/* --- readers (called by llama.cpp / ggml, never by Python on a hot path) - */

/* The abort reader, bool (*)(void *): llama_set_abort_callback(ctx,
 * cb_token_reader, token). Counts a poll, returns the flag, and the first
 * reader to see it set stamps seen_ns. Any thread (compute threads). */
CB_EXPORT bool cb_token_reader(void *data);

/* The eval reader, a ggml_backend_sched_eval_callback:
 * bool (*)(struct ggml_tensor *, bool ask, void *token). ask=true: count the
 * node, return true ("show me") once the range's learned work fills the slice
 * (or at once when the flag is set). ask=false: the range is computed and
 * synchronized; learn from its duration, return false to stop the split when
 * the flag is set. The graph thread only. */
CB_EXPORT bool cb_token_eval_reader(void *tensor, bool ask, void *data);

/* --- eval reader configuration and what it learned --------------------- */

/* Sets the target time between the eval reader's syncs (ns; 0 or less = sync
 * after every node) and forgets the learned costs (cb_token_forget_costs).
 * Between graphs. */
CB_EXPORT void cb_token_set_slice_ns(cb_token *t, int64_t slice_ns);

/* The eval reader's slice (ns; 0 = every node). Any thread. */
CB_EXPORT int64_t cb_token_slice_ns(const cb_token *t);

/* Forgets what the eval reader learned about the model it polled: the cost
 * per unit of work (ns_per_work back to 0) and every per-key scale, and drops
 * the current range. Keeps the slice, the flag, stamps and counters. Call it
 * when the token becomes the eval-reader user data of a new model/context, so
 * costs are re-learned from that model's own graphs. Between graphs. */
CB_EXPORT void cb_token_forget_costs(cb_token *t);

/* Node ranges the eval reader asked to see (each computed, then synchronized)
 * since the last reset. Any thread. */
CB_EXPORT uint64_t cb_token_syncs(const cb_token *t);

/* Longest eval-reader range since the last reset: its first node asked to
 * its sync (ns). Any thread. */
CB_EXPORT int64_t cb_token_max_range_ns(const cb_token *t);

/* Returns cb_token_max_range_ns and sets it to 0 (one atomic exchange; it
 * also sets cb_token_max_range_cpu_ns to 0: read that first), so the
 * longest range of one native call can be read apart from the calls before it
 * (a profile per graph: take before the call, take after it). A range that
 * ends while another thread takes may land on either side. Any thread. */
CB_EXPORT int64_t cb_token_take_max_range_ns(cb_token *t);

/* The learned cost of one unit of node work, sync share included (ns per
 * work unit, an exponential average); 0 = not learned yet. Any thread. */
CB_EXPORT double cb_token_ns_per_work(const cb_token *t);

/* Debug counter: eval-reader ranges ended by a node whose cost key (its op and
 * the log2 bucket of its work) had not been seen, to learn that key's scale,
 * since the last reset. Any thread. */
CB_EXPORT uint64_t cb_token_probes(const cb_token *t);

/* Debug counter: eval-reader ranges ended to learn a known key again (a range
 * that cost over twice its estimate in CPU time re-probes its biggest key),
 * since the last reset. Any thread. */
CB_EXPORT uint64_t cb_token_reprobes(const cb_token *t);

/* Debug counter: what the reader estimated the longest range since the last
 * reset (cb_token_max_range_ns) would take, ns (the nodes counted before the
 * range ended at the learned costs; a probe's new node is not in it). Any
 * thread. */
CB_EXPORT int64_t cb_token_max_range_est_ns(const cb_token *t);

/* Debug counter: the most CPU time (ns, CLOCK_THREAD_CPUTIME_ID) the graph
 * thread spent in one eval-reader range since the last reset (or take). On a
 * CPU backend computing on the graph thread it is what the longest range's work
 * cost, waits for a CPU left out: with slice 0 the largest node's CPU time, a
 * measure that holds under load. Far below cb_token_max_range_ns: ranges
 * waited (for a CPU, or on a device / compute threads of the backend). Any
 * thread. */
CB_EXPORT int64_t cb_token_max_range_cpu_ns(const cb_token *t);

/* --- eval reader profiling log (debug; off unless enabled) ------------- */

/* Gives the eval reader room to log up to max_nodes nodes asked and max_ranges
 * ranges (rows of doubles; a full log stops logging, it never wraps), clearing
 * any earlier log; 0 for either frees the log and turns it off. Kept across
 * cb_token_reset (a profile may span trials); freed by cb_token_free. Returns 1,
 * or 0 when out of memory (the log is then off). Between graphs.
 *
 * Node row (6 doubles): range sequence number, op (ggml_op value; 0 for a node
 * not computed), floor(log2(work)), work (cb_node_work), scaled work (work x its
 * key's learned scale, as counted in the range; 0 for a probe node), kind
 * (0 counted, 1 ended its range to learn its key, 2 the first node after the
 * costs were forgotten).
 * Range row (8 doubles): range sequence number, nodes, estimate in cost units
 * (ns: range work x the learned CPU cost per work where the graph thread's CPU
 * time is live, else the wall estimate), graph-thread CPU ns, wall ns (first
 * ask to sync), kind (0 plain, 1 probe, 2 re-probe, 3 first range; -1 a range
 * computed without a sync callback, e.g. a split that ended with no node asked
 * to be seen: CPU and wall -1), wall estimate (range work x ns_per_work), polls
 * at its end. The estimate is the one the reader held before learning from the
 * range. */
CB_EXPORT int cb_token_log_enable(cb_token *t, int64_t max_nodes, int64_t max_ranges);

/* Copies up to max_rows node rows (6 doubles each) into out (NULL: none) and
 * returns how many are logged. Between graphs. */
CB_EXPORT int64_t cb_token_log_nodes(const cb_token *t, void *out, int64_t max_rows);

/* Copies up to max_rows range rows (8 doubles each) into out (NULL: none) and
 * returns how many are logged. Between graphs. */
CB_EXPORT int64_t cb_token_log_ranges(const cb_token *t, void *out, int64_t max_rows);

/* --- process-wide ggml tensor layout ----------------------------------- */

/* Finds ne[], op, flags and src[] in struct ggml_tensor of the loaded ggml from
 * three real tensors, none computed: a [k, m] marked input, b [k, n], and
 * mm = ggml_mul_mat(a, b) marked output. Returns 1 when every field was found
 * and checked, else 0 (nodes then weigh 1). Once per process, after ggml is
 * loaded and before a graph runs with the eval reader. */
CB_EXPORT int cb_eval_calibrate(const void *a, const void *b, const void *mm, int64_t k, int64_t m, int64_t n);

/* After cb_eval_calibrate succeeded: fa = ggml_flash_attn_ext(q, k, v, ...)
 * (not computed) teaches the reader the attention op, so it weighs n_kv
 * multiply-adds per output element. Returns 1 if checked. Same thread and
 * time as cb_eval_calibrate. */
CB_EXPORT int cb_eval_calibrate_flash_attn(const void *q, const void *k, const void *fa);

/* After cb_eval_calibrate succeeded: v = a view-type op of src (ggml_reshape_*,
 * ggml_view_*, ggml_permute, ggml_transpose; not computed) teaches the reader that
 * v's op moves no data, so a node of it weighs its dispatch alone, whatever its
 * size. Returns 1 if checked. Same thread and time as cb_eval_calibrate. */
CB_EXPORT int cb_eval_calibrate_no_op(const void *src, const void *v);

/* The eval reader's work estimate of one ggml tensor (element units; 1.0 when
 * not calibrated, for NULL, or for a node the graph does not compute). Any
 * thread, after calibration. */
CB_EXPORT double cb_node_work(const void *tensor);

/* --- known-answer probe ------------------------------------------------ */

/* Busy-works for duration_us and checks the token (as cb_token_reader) at
 * start + k * period_us, k = 1, 2, ... Returns 1 if it stopped on the token, 0
 * if it ran to the end; *out_start_ns / *out_end_ns (either may be NULL) get
 * its start and return times (ns). Blocks the calling thread, any thread. */
CB_EXPORT int cb_probe_busy(cb_token *t, int64_t duration_us, int64_t period_us,
                            int64_t *out_start_ns, int64_t *out_end_ns);

/* --- simulated engine ------------------------------------------------ */

/* A timed wait instead of compute, for the sim engine: sleeps to start +
 * k * granularity_us, k = 1, 2, ..., and checks the token there (as
 * cb_token_reader: counts a poll, stamps seen_ns), until duration_us has
 * passed (the last check is at the end). t NULL or granularity_us <= 0: sleeps
 * the whole duration without a check. Returns k, the check that found the
 * flag set (>= 1; its scheduled time is start + k * granularity_us), or 0 if it
 * ran to the end; *out_start_ns / *out_end_ns (either may be NULL) get its
 * start and return times (ns). Blocks the calling thread, any thread. */
CB_EXPORT int64_t cb_sim_wait(cb_token *t, int64_t duration_us, int64_t granularity_us,
                              int64_t *out_start_ns, int64_t *out_end_ns);

#ifdef __cplusplus
}
#endif

#endif /* CANCELBENCH_CANCEL_TOKEN_H */
