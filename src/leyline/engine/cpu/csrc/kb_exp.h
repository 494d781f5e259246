/* kb_exp, the kernels' vectorisable exp (the attention's softmax, SiLU). */
#ifndef KB_EXP_H
#define KB_EXP_H
#include <stdint.h>
#include <string.h>
/* e^x in fp32 without a call, so that loops calling it vectorise: x = n ln2 + r (ln 2 split
   in two, so n ln2 is exact to fp32), e^r by a degree-7 polynomial in Horner form (Cephes'
   expf coefficients), 2^n built in the exponent bits; x is clamped to [-87, 88]. Within 1.02
   ulp of the exact value over that range (tests/engine/test_layer_kernel.py). */
static inline float kb_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.44269504088896341f + 12582912.0f; /* round to nearest via 1.5 * 2^23 */
    float n = t - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}
#endif
