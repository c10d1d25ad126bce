/* Runtime CPU feature detection and the choice of compute kernels (env MOED_KERNELS). */
#include "engine/kern/cpu.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct md_cpu_features feats;
static const struct md_kern *active;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void detect(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_cpu_init();
	feats.avx2 = __builtin_cpu_supports("avx2");
	feats.fma = __builtin_cpu_supports("fma");
	/* f16c is implied by every AVX2 CPU shipped; GCC's builtin has no name for it. */
	feats.f16c = feats.avx2;
	feats.avx512f = __builtin_cpu_supports("avx512f");
	feats.avx512bw = __builtin_cpu_supports("avx512bw");
	feats.avx512vl = __builtin_cpu_supports("avx512vl");
	feats.avx512vnni = __builtin_cpu_supports("avx512vnni");
	feats.avx512bf16 = __builtin_cpu_supports("avx512bf16");
#endif
}

const struct md_cpu_features *md_cpu_features(void)
{
	pthread_once(&once, detect);
	return &feats;
}

const struct md_kern *md_kern_by_name(const char *name)
{
	const struct md_cpu_features *f = md_cpu_features();

	if (strcmp(name, "scalar") == 0)
		return &md_kern_scalar;
	if (strcmp(name, "avx2") == 0)
		return f->avx2 && f->fma && f->f16c ? md_kern_avx2_table() : NULL;
	if (strcmp(name, "avx512") == 0)
		return f->avx512f && f->avx512bw && f->avx512vl && f->avx512vnni && f->fma && f->f16c ?
			       md_kern_avx512_table() : NULL;
	return NULL;
}

static const struct md_kern *best(const char *from)
{
	static const char *const order[] = { "avx512", "avx2", "scalar" };
	int start = 0;

	for (int i = 0; i < 3; i++)
		if (from && strcmp(order[i], from) == 0)
			start = i;
	for (int i = start; i < 3; i++) {
		const struct md_kern *k = md_kern_by_name(order[i]);
		if (k)
			return k;
	}
	return &md_kern_scalar;
}

static void choose(void)
{
	const char *env = getenv("MOED_KERNELS");

	if (env && strcmp(env, "ref") == 0) {
		active = NULL;
		return;
	}
	if (!env || !*env || strcmp(env, "auto") == 0) {
		active = best(NULL);
		return;
	}
	active = md_kern_by_name(env);
	if (!active) {
		active = best(strcmp(env, "avx512") == 0 ? "avx2" : NULL);
		fprintf(stderr, "moed: MOED_KERNELS='%s' not available here, using '%s'\n", env,
			active->name);
	}
}

static pthread_once_t choose_once = PTHREAD_ONCE_INIT;

const struct md_kern *md_kern_active(void)
{
	pthread_once(&choose_once, choose);
	return active;
}

void md_kern_set_active(const struct md_kern *k)
{
	pthread_once(&choose_once, choose);
	active = k;
}
