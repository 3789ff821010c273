/* AMX tile state shared by the kernels that use tiles (cpu_amx.c, onednn_calls.c): asking the
 * OS for it, and the one configuration they all run, eight tiles of 16 rows x 64 bytes.
 * Include only where the build has AMX (__AMX_TILE__ and __AMX_BF16__). */
#ifndef TRAE_CPU_TILES_H
#define TRAE_CPU_TILES_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Ask the kernel for the AMX tile state (Linux 5.16+): 1 where this process may use tiles */
static inline int request_tiles(void) {
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* This thread's eight tiles as 16 rows x 64 bytes each */
static inline void configure_tiles(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}
#endif
