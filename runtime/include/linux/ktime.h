/* kprewrite shim: the kernel header a kprobes sample includes. */
#include <kprewrite/kprobes.h>
