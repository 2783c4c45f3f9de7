#include "../../kp_internal.h"
void kp_sighook_install(void) { }
