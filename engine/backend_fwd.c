/* What the device forward pass's ops share (backend_fwd.h). */
#include "engine/backend_fwd.h"

#include <errno.h>

int md_dev_qkv_rows_ops(const struct md_backend_fwd *op, struct md_backend *b,
			const struct md_dev_qkv *a)
{
	const int n = a->n, H = a->n_head, K = a->n_head_kv, D = a->head_dim;
	if (a->n_rot % 2 || a->n_rot > D)
		return -EINVAL;
	int rc = 0;
	if (a->norm == MD_QK_NORM_FULL) {
		rc = op->rmsnorm(b, a->q, a->q, a->q_norm, n, H * D, H * D, a->eps);
		if (!rc)
			rc = op->rmsnorm(b, a->k, a->k, a->k_norm, n, K * D, K * D, a->eps);
	} else if (a->norm == MD_QK_NORM_HEAD) {
		rc = op->rmsnorm(b, a->q, a->q, a->q_norm, n * H, D, D, a->eps);
		if (!rc)
			rc = op->rmsnorm(b, a->k, a->k, a->k_norm, n * K, D, D, a->eps);
	}
	if (!rc && a->n_rot) {
		rc = op->rope(b, a->q, n, H, D, a->n_rot, a->neox, a->cs);
		if (!rc)
			rc = op->rope(b, a->k, n, K, D, a->n_rot, a->neox, a->cs);
	}
	if (!rc)
		rc = op->rows_store(b, a->kc, a->wrow, a->k, n, K * D);
	if (!rc)
		rc = op->rows_store(b, a->vc, a->wrow, a->v, n, K * D);
	return rc;
}
