/* The CUDA entry points of a build without CUDA: there is no device backend to return. */
#include "engine/backend.h"

/*
 * engine/meson.build links this file behind engine_dep when CUDA is off, and cuda/backend_cuda.c
 * instead when it is on, so the choice is made once, at link time, for every caller. Rejected:
 * inline stubs in backend.h under #ifdef, which gave the stub to any file compiled without the
 * macro (the engine library itself) even in a CUDA build.
 */

struct md_backend *md_backend_cuda(void)
{
	return NULL;
}

const char *md_backend_cuda_error(void)
{
	return "built without cuda";
}
