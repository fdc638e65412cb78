/* AMX tile state for the C kernels (w8a8_linear.c, int8_bf16.c): Linux hands it out per
 * process on request, and each thread loads its own tile configuration. */
#ifndef REDSERVE_AMX_H
#define REDSERVE_AMX_H
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int amx_permission = -1; /* -1: not asked yet; 0: refused; 1: granted */

/* 1 once the kernel lets this process use the tile registers (asked the first time). */
static int amx_granted(void) {
    if (amx_permission < 0) {
        const long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
        amx_permission = syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0;
    }
    return amx_permission;
}
#endif
