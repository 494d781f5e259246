/* For kernels that use the tile unit (AMX), included after their system headers
   (_GNU_SOURCE defined first): the tile configuration, the per-process request for the
   tile state and the per-thread configuration. */
#ifndef KB_AMX_H
#define KB_AMX_H
#ifdef __AMX_BF16__
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
/* The tile configuration ldtilecfg reads (palette 1). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} kb_tilecfg;

/* 1 when Linux grants this process the tile state (asked per process, by any thread). */
static int kb_amx_request(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

/* The calling thread's eight tiles: rows[t] rows of 64 bytes each. */
static void kb_tiles_configure(const uint8_t rows[8]) {
    kb_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = rows[t];
    }
    /* the barrier: GCC may otherwise drop the stores into cfg, which ldtilecfg reads */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

static const uint8_t kb_full_tiles[8] = {16, 16, 16, 16, 16, 16, 16, 16};
#endif
#endif
