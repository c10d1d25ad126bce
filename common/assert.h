/* Always-on assertions for invariants, and thread-ownership checks. */
#ifndef MD_ASSERT_H
#define MD_ASSERT_H

/*
 * MD_ASSERT stays on in release builds (NDEBUG does not remove it), like libuv's ASSERT and
 * GGML_ASSERT: it guards invariants whose violation would corrupt memory or answers, never
 * client input (that gets an error reply). A failure logs file:line and the condition through
 * md_log and aborts.
 *
 * Thread ownership: a piece of state names the thread that may touch it with a
 * struct md_thread_owner. The owning thread claims it once (md_owner_claim); functions that
 * must run there say so with MD_ASSERT_OWNER. An owner nobody has claimed yet passes the
 * check, so set-up code that runs before the thread starts needs no special case.
 */

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

_Noreturn void md__assert_fail(const char *cond, const char *file, int line, const char *func);

#define MD_ASSERT(cond) \
	((cond) ? (void)0 : md__assert_fail(#cond, __FILE__, __LINE__, __func__))

struct md_thread_owner {
	pthread_t _tid;
	atomic_bool _claimed;
	const char *_name; /* static string for the failure message: "loop", "engine" */
};

/* The calling thread becomes the owner (name: a static string). */
void md_owner_claim(struct md_thread_owner *o, const char *name);
/* Forget the owner (the thread is about to exit; another may claim it). */
void md_owner_release(struct md_thread_owner *o);
/* True on the owning thread, or while nobody has claimed o. */
bool md_owner_is_current(const struct md_thread_owner *o);

_Noreturn void md__owner_fail(const struct md_thread_owner *o, const char *file, int line,
			      const char *func);
#define MD_ASSERT_OWNER(o) \
	(md_owner_is_current(o) ? (void)0 : md__owner_fail((o), __FILE__, __LINE__, __func__))

/* The process's loop thread (libuv): claimed by main before the loop runs. */
extern struct md_thread_owner md_loop_thread;
#define MD_ASSERT_LOOP_THREAD() MD_ASSERT_OWNER(&md_loop_thread)

#endif
