/* A kernel's per-thread scratch (kb_scratch), included after its system headers. */
#ifndef KB_SCRATCH_H
#define KB_SCRATCH_H
#include <stdlib.h>
/* A thread's scratch floats, kept between calls and grown as needed: no allocation per
   call (NULL when memory runs out). */
static _Thread_local float *kb_tls;
static _Thread_local int64_t kb_tls_floats;

static float *kb_scratch(int64_t floats) {
    if (floats > kb_tls_floats) {
        free(kb_tls);
        kb_tls = malloc(sizeof(float) * (size_t)floats);
        kb_tls_floats = kb_tls ? floats : 0;
    }
    return kb_tls;
}
#endif
