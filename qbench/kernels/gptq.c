/* GPTQ's inner loop (qbench/quant/gptq.py): one block of columns, quantized one column at a time, each
 * column's error pushed onto the block's later columns through the inverse Hessian's Cholesky factor.
 *
 * Rows are independent (a row's error only moves its own later weights), so rows run in parallel. Every
 * value is the torch reference loop's, bit for bit: the same float64 operations in the same order, each
 * rounded once. The build's -std=c11 keeps GCC from contracting a multiply and a subtraction into an FMA
 * (which would round once instead of twice); the pragma below says so explicitly. nearbyint() rounds half
 * to even, as torch.round does.
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>

/* W1 (N, B) float64, the block's weights (updated in place); Hinv1 (B, B) its factor block; columns
 * c0 .. c1-1 are quantized. gidx (B,) the group of each column in scales / zeros (N, ngroups) float64
 * (zeros NULL for symmetric and INT8). codes (N, B) and err (N, B) receive each column's code and scaled
 * error. bits: 4 (symmetric codes stored offset by 8, asymmetric with zero points) or 8. */
void qb_gptq_block(double *W1, const double *Hinv1, long N, long B, long c0, long c1, const long *gidx,
                   const double *scales, const double *zeros, long ngroups, int bits, double *codes, double *err,
                   int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long r = 0; r < N; r++) {
        double *w = W1 + r * B;
        for (long i = c0; i < c1; i++) {
            double s = scales[r * ngroups + gidx[i]];
            double q, dq, code;
            if (bits == 8) {
                q = fmin(fmax(nearbyint(w[i] / s), -127.0), 127.0);
                code = q;
                dq = q * s;
            } else if (zeros == 0) {
                q = fmin(fmax(nearbyint(w[i] / s), -8.0), 7.0);
                code = q + 8.0;
                dq = q * s;
            } else {
                double z = zeros[r * ngroups + gidx[i]];
                q = fmin(fmax(nearbyint(w[i] / s) + z, 0.0), 15.0);
                code = q;
                dq = (q - z) * s;
            }
            double e = (w[i] - dq) / Hinv1[i * B + i];
            codes[r * B + i] = code;
            err[r * B + i] = e;
            const double *h = Hinv1 + i * B;
            for (long j = i + 1; j < B; j++) {
                double t = e * h[j];
                w[j] = w[j] - t;
            }
        }
    }
}
