/*
 * moed-bandwidth: streaming-read memory bandwidth, the bound of a memory-bound decode.
 *
 * DESIGN
 * A decode step of a large model reads each weight it uses once, from memory, with the
 * decode's threads: its speed is bounded by (read bandwidth) / (bytes read per token). This
 * program measures that read bandwidth the way the decode reads: T threads (persistent, started
 * together at a barrier) each sum their contiguous share of a buffer far larger than the last
 * cache level, once per sample; a sample's figure is bytes / (time from the start barrier until
 * the last thread is done). Many samples are taken and the median is the figure quoted (on a
 * shared machine single samples swing with other tenants; the median does not), min and max
 * beside it. Each thread also measures its own CPU time per sample: a sample in which every
 * thread was on a CPU for at least 90 % of the wall time is "clean" (no thread was preempted by
 * another tenant), and the median of the clean samples is printed too: what the memory gives
 * threads that run, as opposed to what a time-shared CPU lets them take.
 *
 * The buffer is either anonymous memory of -s MiB, faulted in before timing, with huge pages
 * asked for (-p huge: MADV_HUGEPAGE) or refused (-p small: MADV_NOHUGEPAGE), or (-f FILE) a
 * model file mapped exactly as the engine maps one (engine/gguf.c: MAP_PRIVATE, MADV_HUGEPAGE,
 * MADV_WILLNEED, then populated): the pages a decode of that file really streams. The share of
 * the buffer the kernel backs with huge pages (from /proc/self/smaps) is printed, since TLB
 * misses on 4 KiB pages cost read bandwidth.
 *
 * The sum uses vector-typed accumulators so that even a plain -O2 build streams at memory
 * speed rather than being bound by the loop.
 *
 * Output: one line of "key value" pairs (threads, bytes, pages, huge_pct, samples, median_gbs,
 * min_gbs, max_gbs, clean, clean_median_gbs), GB = 1e9 bytes; clean_median_gbs is 0 when no
 * sample was clean.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 64
#define MAX_SAMPLES 1000
#define HUGE_SZ (2u << 20)
#define CHUNK 128 /* bytes summed per loop iteration: 4 vectors of 32 */

typedef uint64_t v4u __attribute__((vector_size(32)));

struct worker {
	const unsigned char *lo; /* borrowed: the buffer, valid for the run */
	size_t len;
	uint64_t sum;
	double cpu[MAX_SAMPLES]; /* seconds on a CPU, per sample */
	pthread_t th;
};

static struct {
	pthread_barrier_t start, done;
	int samples;
	struct worker w[MAX_THREADS];
} g;

static uint64_t sum_range(const unsigned char *p, size_t len)
{
	v4u a = { 0 }, b = { 0 }, c = { 0 }, d = { 0 }, x;
	size_t i = 0;
	uint64_t s = 0;

	for (; i + CHUNK <= len; i += CHUNK) {
		memcpy(&x, p + i, 32);
		a += x;
		memcpy(&x, p + i + 32, 32);
		b += x;
		memcpy(&x, p + i + 64, 32);
		c += x;
		memcpy(&x, p + i + 96, 32);
		d += x;
	}
	a += b + c + d;
	for (int k = 0; k < 4; k++)
		s += a[k];
	for (; i < len; i++)
		s += p[i];
	return s;
}

static double clock_s(clockid_t id)
{
	struct timespec t;

	clock_gettime(id, &t);
	return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double now(void)
{
	return clock_s(CLOCK_MONOTONIC);
}

static void *work(void *arg)
{
	struct worker *w = arg;

	for (int n = 0; n < g.samples; n++) {
		pthread_barrier_wait(&g.start);
		double c0 = clock_s(CLOCK_THREAD_CPUTIME_ID);
		w->sum += sum_range(w->lo, w->len);
		w->cpu[n] = clock_s(CLOCK_THREAD_CPUTIME_ID) - c0;
		pthread_barrier_wait(&g.done);
	}
	return NULL;
}

/* kB of the mapping holding addr backed by huge pages (anonymous or file) and resident. */
static int huge_share(const void *addr, long *huge_kb, long *rss_kb)
{
	FILE *f = fopen("/proc/self/smaps", "r");
	char line[512];
	int in = 0;

	*huge_kb = *rss_kb = 0;
	if (!f)
		return -errno;
	while (fgets(line, sizeof(line), f)) {
		unsigned long lo, hi;
		long kb;

		if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
			in = (uintptr_t)addr >= lo && (uintptr_t)addr < hi;
			continue;
		}
		if (!in)
			continue;
		if (sscanf(line, "Rss: %ld kB", &kb) == 1)
			*rss_kb += kb;
		else if (sscanf(line, "AnonHugePages: %ld kB", &kb) == 1 ||
			 sscanf(line, "FilePmdMapped: %ld kB", &kb) == 1)
			*huge_kb += kb;
	}
	fclose(f);
	return 0;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

/* median of v[0..n) (sorts v); 0 when n is 0 */
static double median(double *v, int n)
{
	if (n == 0)
		return 0;
	qsort(v, (size_t)n, sizeof(*v), cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: moed-bandwidth [-t THREADS] [-n SAMPLES] [-s MIB] [-p huge|small] [-f FILE]\n"
		"  THREADS threads (default 2) each sum their share of the buffer, SAMPLES times\n"
		"  (default 21); prints the median, min and max read bandwidth in GB/s.\n"
		"  -s MIB        anonymous buffer size in MiB (default 1024), faulted in first\n"
		"  -p huge|small ask for huge pages (MADV_HUGEPAGE, default) or refuse them\n"
		"  -f FILE       read FILE mapped as moed maps a model, instead of anonymous memory\n");
}

int main(int argc, char **argv)
{
	int threads = 2, samples = 21, huge = 1, opt;
	size_t mib = 1024, len;
	const char *file = NULL;
	unsigned char *base, *buf;
	size_t map_len;
	double *gbs, *clean;
	int n_clean = 0;
	long huge_kb, rss_kb;
	uint64_t all = 0;

	while ((opt = getopt(argc, argv, "t:n:s:p:f:h")) != -1) {
		switch (opt) {
		case 't': threads = atoi(optarg); break;
		case 'n': samples = atoi(optarg); break;
		case 's': mib = strtoull(optarg, NULL, 10); break;
		case 'p':
			if (strcmp(optarg, "huge") && strcmp(optarg, "small")) {
				fprintf(stderr, "moed-bandwidth: -p takes huge or small, not '%s'\n",
					optarg);
				return 2;
			}
			huge = !strcmp(optarg, "huge");
			break;
		case 'f': file = optarg; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (threads < 1 || threads > MAX_THREADS || samples < 1 || samples > MAX_SAMPLES ||
	    mib < 1 || mib > (1u << 20)) {
		fprintf(stderr, "moed-bandwidth: threads 1-%d, samples 1-%d, size 1 MiB-1 TiB\n",
			MAX_THREADS, MAX_SAMPLES);
		return 2;
	}
	if (file) {
		int fd = open(file, O_RDONLY);
		struct stat st;

		if (fd < 0 || fstat(fd, &st) != 0 || st.st_size < 1) {
			fprintf(stderr, "moed-bandwidth: cannot read '%s': %s\n", file,
				fd < 0 ? strerror(errno) : "empty or unreadable");
			return 1;
		}
		len = map_len = (size_t)st.st_size;
		base = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
		close(fd);
		if (base == MAP_FAILED) {
			fprintf(stderr, "moed-bandwidth: cannot map '%s': %s\n", file, strerror(errno));
			return 1;
		}
		buf = base;
#ifdef MADV_HUGEPAGE
		(void)madvise(buf, len, MADV_HUGEPAGE);
#endif
		(void)madvise(buf, len, MADV_WILLNEED);
#ifdef MADV_POPULATE_READ
		(void)madvise(buf, len, MADV_POPULATE_READ);
#endif
		all += sum_range(buf, len); /* in the page cache and mapped, as a served model */
	} else {
		len = mib << 20;
		map_len = len + HUGE_SZ;
		base = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
			    0);
		if (base == MAP_FAILED) {
			fprintf(stderr, "moed-bandwidth: cannot allocate %zu MiB\n", mib);
			return 1;
		}
		buf = base + ((HUGE_SZ - (uintptr_t)base % HUGE_SZ) % HUGE_SZ);
		(void)madvise(buf, len, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
		memset(buf, 1, len); /* every page faulted in before timing */
	}
	huge_share(buf, &huge_kb, &rss_kb);

	gbs = calloc((size_t)samples, sizeof(*gbs));
	clean = calloc((size_t)samples, sizeof(*clean));
	if (!gbs || !clean || pthread_barrier_init(&g.start, NULL, (unsigned)threads + 1) ||
	    pthread_barrier_init(&g.done, NULL, (unsigned)threads + 1)) {
		fprintf(stderr, "moed-bandwidth: out of memory\n");
		return 1;
	}
	g.samples = samples;
	for (int t = 0; t < threads; t++) {
		/* contiguous shares, cut at CHUNK multiples */
		size_t lo = len / CHUNK * t / threads * CHUNK;
		size_t hi = t == threads - 1 ? len : len / CHUNK * (t + 1) / threads * CHUNK;

		g.w[t].lo = buf + lo;
		g.w[t].len = hi - lo;
		if (pthread_create(&g.w[t].th, NULL, work, &g.w[t]) != 0) {
			fprintf(stderr, "moed-bandwidth: cannot start thread %d\n", t);
			return 1;
		}
	}
	for (int n = 0; n < samples; n++) {
		double t0 = now();

		pthread_barrier_wait(&g.start);
		pthread_barrier_wait(&g.done);
		double wall = now() - t0;
		int ran = 1;

		gbs[n] = (double)len / wall / 1e9;
		for (int t = 0; t < threads; t++)
			ran &= g.w[t].cpu[n] >= 0.9 * wall;
		if (ran)
			clean[n_clean++] = gbs[n];
	}
	for (int t = 0; t < threads; t++) {
		pthread_join(g.w[t].th, NULL);
		all += g.w[t].sum;
	}
	double med = median(gbs, samples);

	printf("threads %d bytes %zu pages %s huge_pct %.0f samples %d median_gbs %.2f "
	       "min_gbs %.2f max_gbs %.2f clean %d clean_median_gbs %.2f%s\n",
	       threads, len, file ? "file" : huge ? "huge" : "small",
	       rss_kb ? 100.0 * (double)huge_kb / (double)rss_kb : 0.0, samples, med, gbs[0],
	       gbs[samples - 1], n_clean, median(clean, n_clean),
	       all == 42 ? " " : ""); /* keeps the sums alive */
	munmap(base, map_len);
	free(clean);
	free(gbs);
	return 0;
}
