/* linear_ref.h - the plain-C linear layer the tests' modules and their
   references both run (net7.h, test_composite.c): y = x W^T + b, and its
   backward in two halves, so a split backward sums exactly as a whole one. */
#ifndef LINEAR_REF_H
#define LINEAR_REF_H
static void linear_fwd(const float *x, const float *w, const float *b, float *y, int n, int in, int out) {
    for (int r = 0; r < n; r++)
        for (int o = 0; o < out; o++) {
            float acc = b[o];
            for (int i = 0; i < in; i++) acc += x[r * in + i] * w[o * in + i];
            y[r * out + o] = acc;
        }
}
/* The input gradient gx = gy W (B), and the weight and bias gradients added
   into gw += gy^T x, gb += sum of gy's rows (W). */
static void linear_bwd_input(const float *w, const float *gy, float *gx, int n, int in, int out) {
    for (int r = 0; r < n; r++)
        for (int i = 0; i < in; i++) {
            float acc = 0;
            for (int o = 0; o < out; o++) acc += gy[r * out + o] * w[o * in + i];
            gx[r * in + i] = acc;
        }
}
static void linear_bwd_weight(const float *x, const float *gy, float *gw, float *gb, int n, int in, int out) {
    for (int o = 0; o < out; o++) {
        float sb = 0;
        for (int r = 0; r < n; r++) sb += gy[r * out + o];
        gb[o] += sb;
        for (int i = 0; i < in; i++) {
            float sw = 0;
            for (int r = 0; r < n; r++) sw += gy[r * out + o] * x[r * in + i];
            gw[o * in + i] += sw;
        }
    }
}
static void linear_bwd(const float *x, const float *w, const float *gy, float *gx, float *gw, float *gb, int n, int in,
                       int out) {
    if (gx) linear_bwd_input(w, gy, gx, n, in, out);
    linear_bwd_weight(x, gy, gw, gb, n, in, out);
}
#endif
