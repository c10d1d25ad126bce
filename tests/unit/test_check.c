/* Tests of tests/check.h itself: which comparisons fail, and what a failure prints. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/check.h"

/* Failures counted by the checks under test; the real verdicts of this test go to bad. */
static int bad;

#define EXPECT(cond)                                                                     \
	do {                                                                             \
		if (!(cond)) {                                                           \
			fprintf(stdout, "%s:%d: expectation failed: %s\n", __FILE__,     \
				__LINE__, #cond);                                        \
			bad++;                                                           \
		}                                                                        \
	} while (0)

static char out[4096]; /* what the last capture() block printed on stderr */
static FILE *cap;
static int saved_fd;

/* Sends stderr to a temporary file until end_capture() reads it into out. */
static void start_capture(void)
{
	fflush(stderr);
	cap = tmpfile();
	if (cap == NULL) {
		perror("tmpfile");
		exit(1);
	}
	saved_fd = dup(2);
	dup2(fileno(cap), 2);
	failures = 0;
}

static void end_capture(void)
{
	size_t n;

	fflush(stderr);
	dup2(saved_fd, 2);
	close(saved_fd);
	rewind(cap);
	n = fread(out, 1, sizeof(out) - 1, cap);
	out[n] = '\0';
	fclose(cap);
}

int main(void)
{
	/* Passing checks count nothing and print nothing. */
	start_capture();
	CHECK(1 + 1 == 2);
	CHECK_EQ_I(-3, -3);
	CHECK_EQ_U(7u, 7u);
	CHECK_EQ_F(0.5f, 0.5f);
	CHECK_NEAR(1.0, 1.0 + 1e-9, 1e-6);
	CHECK_STR_EQ("abc", "abc");
	CHECK_STR_EQ((const char *)NULL, (const char *)NULL);
	CHECK_MEM_EQ("abcd", "abcx", 3);
	CHECK_MSG(1, "never printed");
	end_capture();
	EXPECT(failures == 0);
	EXPECT(out[0] == '\0');

	/* Strings: both printed, escaped; NULL against a string fails. */
	start_capture();
	CHECK_STR_EQ("a\"b\n\xff", "ab");
	end_capture();
	EXPECT(failures == 1);
	EXPECT(strstr(out, "test_check.c:") != NULL);
	EXPECT(strstr(out, "\"a\\\"b\\n\\xff\"") != NULL);
	EXPECT(strstr(out, "want: \"ab\"") != NULL);
	start_capture();
	CHECK_STR_EQ((const char *)NULL, "x");
	CHECK_STR_EQ("x", (const char *)NULL);
	end_capture();
	EXPECT(failures == 2);
	EXPECT(strstr(out, "got:  (null)") != NULL);

	/* Memory: the first differing offset and the bytes from there. */
	start_capture();
	CHECK_MEM_EQ("abcdef", "abcXef", 6);
	end_capture();
	EXPECT(failures == 1);
	EXPECT(strstr(out, "(6 bytes) failed: first difference at byte 3") != NULL);
	EXPECT(strstr(out, "[3..]: 64 65 66") != NULL);
	EXPECT(strstr(out, "[3..]: 58 65 66") != NULL);

	/* Near: outside the tolerance, and NaN on either side, fail with values and tolerance. */
	start_capture();
	CHECK_NEAR(1.0, 1.5, 0.25);
	CHECK_NEAR(NAN, 1.0, 1e9);
	CHECK_NEAR(1.0, NAN, 1e9);
	CHECK_NEAR(2.0, 2.25, 0.25); /* on the boundary: passes */
	end_capture();
	EXPECT(failures == 3);
	EXPECT(strstr(out, "1.0 ~= 1.5 failed: 1 vs 1.5, |diff| 0.5 > tolerance 0.25") != NULL);

	/* Integers and floats print both values; floats compare bitwise. */
	start_capture();
	CHECK_EQ_I(-1, 2);
	CHECK_EQ_U(255u, 256u);
	CHECK_EQ_F(0.0f, -0.0f);
	end_capture();
	EXPECT(failures == 3);
	EXPECT(strstr(out, "-1 == 2 failed: -1 != 2") != NULL);
	EXPECT(strstr(out, "255 (0xff) != 256 (0x100)") != NULL);

	/* Context prefixes later failures until cleared; CHECK_MSG adds its message. */
	start_capture();
	CHECK_CONTEXT("case %d", 7);
	CHECK_MSG(0, "wanted %s", "more");
	CHECK_CONTEXT_CLEAR();
	CHECK(0);
	end_capture();
	EXPECT(failures == 2);
	EXPECT(strstr(out, ": case 7: check failed: 0\n  wanted more\n") != NULL);
	EXPECT(strstr(out, "case 7") != NULL && strstr(strstr(out, "case 7") + 1, "case 7") == NULL);

	/* REQUIRE ends the process after a failed check, and only then. */
	for (int fail = 0; fail < 2; fail++) {
		int status = 0;
		pid_t pid;

		fflush(stdout);
		start_capture();
		pid = fork();
		if (pid == 0) {
			REQUIRE(CHECK_EQ_I(fail, 0));
			_exit(42);
		}
		waitpid(pid, &status, 0);
		end_capture();
		EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == (fail ? 1 : 42));
	}

	failures = 0;
	if (bad) {
		fprintf(stderr, "check: %d expectation(s) failed\n", bad);
		return 1;
	}
	printf("check: ok\n");
	return 0;
}
