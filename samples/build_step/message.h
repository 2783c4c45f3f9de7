/* Included by handlers.c: changing it re-runs the rewrite (kprewrite --depfile). */
#define WORK_MESSAGE "work(%lu)\n"
