/* Plain driver for libFuzzer targets: runs LLVMFuzzerTestOneInput over files and directories. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path, long *n)
{
	FILE *f = fopen(path, "rb");
	uint8_t *buf;
	long len;

	if (!f) {
		fprintf(stderr, "fuzz_main: cannot open '%s'\n", path);
		return 1;
	}
	if (fseek(f, 0, SEEK_END) != 0 || (len = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
		fprintf(stderr, "fuzz_main: cannot size '%s'\n", path);
		fclose(f);
		return 1;
	}
	/* Exact-size heap copy, so sanitizers catch reads past the input. */
	buf = malloc(len ? (size_t)len : 1);
	if (!buf || fread(buf, 1, (size_t)len, f) != (size_t)len) {
		fprintf(stderr, "fuzz_main: cannot read '%s'\n", path);
		free(buf);
		fclose(f);
		return 1;
	}
	fclose(f);
	LLVMFuzzerTestOneInput(buf, (size_t)len);
	free(buf);
	(*n)++;
	return 0;
}

static int run_path(const char *path, long *n)
{
	struct stat st;
	struct dirent **ents;
	int m, rc = 0;

	if (stat(path, &st) != 0) {
		fprintf(stderr, "fuzz_main: cannot stat '%s'\n", path);
		return 1;
	}
	if (!S_ISDIR(st.st_mode))
		return run_file(path, n);
	m = scandir(path, &ents, NULL, alphasort);
	if (m < 0) {
		fprintf(stderr, "fuzz_main: cannot list '%s'\n", path);
		return 1;
	}
	for (int i = 0; i < m; i++) {
		if (ents[i]->d_name[0] != '.') {
			char sub[4096];

			snprintf(sub, sizeof(sub), "%s/%s", path, ents[i]->d_name);
			rc |= run_path(sub, n);
		}
		free(ents[i]);
	}
	free(ents);
	return rc;
}

int main(int argc, char **argv)
{
	long n = 0;
	int rc = 0;

	for (int i = 1; i < argc; i++)
		rc |= run_path(argv[i], &n);
	printf("ran %ld input(s)\n", n);
	if (n == 0) {
		fprintf(stderr, "fuzz_main: no inputs\n");
		return 1;
	}
	return rc;
}
