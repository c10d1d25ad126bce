/* Always-on assertions for invariants, and thread-ownership checks. */
#include "common/assert.h"

#include <stdlib.h>

#include "common/log.h"

struct md_thread_owner md_loop_thread = { ._name = "loop" };

_Noreturn void md__assert_fail(const char *cond, const char *file, int line, const char *func)
{
	md_log(MD_LOG_ERROR, "assertion failed at %s:%d in %s(): %s", file, line, func, cond);
	abort();
}

_Noreturn void md__owner_fail(const struct md_thread_owner *o, const char *file, int line,
			      const char *func)
{
	md_log(MD_LOG_ERROR, "assertion failed at %s:%d in %s(): called off the %s thread", file,
	       line, func, o->_name ? o->_name : "owning");
	abort();
}

void md_owner_claim(struct md_thread_owner *o, const char *name)
{
	o->_tid = pthread_self();
	o->_name = name;
	atomic_store_explicit(&o->_claimed, true, memory_order_release);
}

void md_owner_release(struct md_thread_owner *o)
{
	atomic_store_explicit(&o->_claimed, false, memory_order_release);
}

bool md_owner_is_current(const struct md_thread_owner *o)
{
	if (!atomic_load_explicit(&((struct md_thread_owner *)o)->_claimed, memory_order_acquire))
		return true;
	return pthread_equal(o->_tid, pthread_self()) != 0;
}
