/* Test helper: write a seeded random-weight GGUF with `moed-gguf gen` into a fresh temporary
 * directory, for unit tests that run the forward pass. */
#ifndef MD_TEST_GEN_MODEL_H
#define MD_TEST_GEN_MODEL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* Run `moed_gguf gen ARGS... DIR/NAME` (args: NULL-terminated, at most 30) with DIR a new
 * directory under $TMPDIR (or /tmp). path gets DIR/NAME, dir gets DIR. Returns 0 or -1 with
 * a message on stderr. */
static int gen_model(const char *moed_gguf, const char *const *args, const char *name, char *dir,
		     size_t dir_len, char *path, size_t path_len)
{
	const char *tmp = getenv("TMPDIR");
	snprintf(dir, dir_len, "%s/moed-unit-XXXXXX", tmp && *tmp ? tmp : "/tmp");
	if (!mkdtemp(dir)) {
		perror("mkdtemp");
		return -1;
	}
	snprintf(path, path_len, "%s/%s", dir, name);
	const char *argv[34];
	int n = 0;
	argv[n++] = moed_gguf;
	argv[n++] = "gen";
	for (int i = 0; args[i] && n < 32; i++)
		argv[n++] = args[i];
	argv[n++] = path;
	argv[n] = NULL;
	pid_t pid = fork();
	if (pid < 0) {
		perror("fork");
		return -1;
	}
	if (pid == 0) {
		/* Quiet: gen prints its tensor table; a failure shows as the exit status. */
		if (!freopen("/dev/null", "w", stdout) || !freopen("/dev/null", "w", stderr))
			_exit(127);
		execv(moed_gguf, (char *const *)argv);
		_exit(127);
	}
	int st = 0;
	if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
		fprintf(stderr, "'%s gen' failed (status 0x%x)\n", moed_gguf, (unsigned)st);
		return -1;
	}
	return 0;
}

/* Remove what gen_model made. */
static void gen_model_cleanup(const char *dir, const char *path)
{
	unlink(path);
	rmdir(dir);
}

#endif
