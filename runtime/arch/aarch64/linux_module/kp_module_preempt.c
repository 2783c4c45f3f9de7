/*
 * arm64 with the kernel's CRCs (Module.symvers): as without them (kp_module_no_preempt.c): the detour's
 * masked interrupts keep the handlers from being preempted.  Included by kp_module_runtime.c with
 * KP_MODULE_CRCS.
 */
#include "kp_module_no_preempt.c"
