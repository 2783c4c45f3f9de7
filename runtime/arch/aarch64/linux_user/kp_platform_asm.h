/* The platform's constants for the arch's assembly (kp_regs.h): a user process. */
#ifndef _KP_PLATFORM_ASM_H
#define _KP_PLATFORM_ASM_H
#include <kp_uapi.h>
/* pstate as a user process's pt_regs reports it (EL0t, interrupts unmasked);
 * the entries merge NZCV into it (kp_regs.h). */
#define KP_PT_PSTATE 0
#endif
