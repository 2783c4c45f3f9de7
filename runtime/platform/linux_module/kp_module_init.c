/*
 * A module's init and exit (struct module's, redirected here by writer.py's _redirect()):
 * kp_module_init arms the probes and chains to the module's own init; kp_module_exit chains to
 * the module's exit, disarms and prints each probe's counts.  With the kernel's CRCs
 * (KP_MODULE_CRCS), /sys/kernel/debug/kprewrite-<module>/<EVENT>/{hits,nmissed} (and a
 * kretprobe's `returns`) while the module is loaded, made with debugfs_create_ulong() (no struct
 * file_operations of ours: its layout is the kernel's).  Included by kp_module_runtime.c.
 */

#ifdef KP_MODULE_CRCS
/* debugfs (exported to modules): the counters as files, read-only. */
extern void *debugfs_create_dir(const char *name, void *parent);
extern void debugfs_create_ulong(const char *name, unsigned short mode, void *parent, unsigned long *value);
extern void debugfs_create_u32(const char *name, unsigned short mode, void *parent, unsigned int *value);
extern void debugfs_remove(void *dentry);
static void *kp_debugfs;
/* IS_ERR_OR_NULL(): debugfs returns an error pointer when it is off or the name is taken. */
static int kp_debugfs_ok(void *d)
{
	return d && (unsigned long)d < (unsigned long)-4095;
}
#endif
#ifdef KP_MODULE_EVENT_CALLS
void kp_module_trace_init(void);
#endif

int kp_module_init(void)
{
	unsigned int i = 0;
	int r;
	(void)i;
#ifdef KP_MODULE_INT3
	/* The breakpoints are in the module's text from load: the notifier comes first, before
	 * anything of the module's own init runs (nothing else enters the module before it: the
	 * loader gives no other module its symbols while it is COMING), and goes last, after its
	 * exit (unregister_die_notifier() waits for a trap being handled to end). */
	r = register_die_notifier(&kp_int3_nb);
	if (r)
		return r;
#endif
#ifdef KP_MODULE_CRCS
	kp_debugfs = debugfs_create_dir("kprewrite-" KP_MODULE_NAME, 0);
	if (kp_debugfs_ok(kp_debugfs)) {
		for (i = 0; i < KP_NK; i++) {
			void *d = debugfs_create_dir(kp_probes[i].name, kp_debugfs);
			debugfs_create_ulong("hits", 0400, d, &kp_hits[i]);
			debugfs_create_ulong("nmissed", 0400, d, &kp_probes[i].nmissed);
		}
		for (i = 0; i < KP_NR; i++) {
			void *d = debugfs_create_dir(kp_kretprobes[i].kp.name, kp_debugfs);
			debugfs_create_ulong("hits", 0400, d, &kp_kret_hits[i]);
			debugfs_create_ulong("returns", 0400, d, &kp_kret_returns[i]);
			debugfs_create_u32("nmissed", 0400, d, (unsigned int *)&kp_kretprobes[i].nmissed);
		}
	}
#endif
#ifdef KP_MODULE_EVENT_CALLS
	kp_module_trace_init();	/* the events' calls, registered before init (event_calls_c()) */
#endif
	kp_armed = 1;
	r = init_module();
	if (r) {
		kp_armed = 0;
#ifdef KP_MODULE_CRCS
		if (kp_debugfs_ok(kp_debugfs))
			debugfs_remove(kp_debugfs);
#endif
#ifdef KP_MODULE_INT3
		unregister_die_notifier(&kp_int3_nb);
#endif
	}
	return r;
}

void kp_module_exit(void)
{
	unsigned int i;
	cleanup_module();
	kp_armed = 0;
#ifdef KP_MODULE_CRCS
	if (kp_debugfs_ok(kp_debugfs))
		debugfs_remove(kp_debugfs);
#endif
#ifdef KP_MODULE_INT3
	unregister_die_notifier(&kp_int3_nb);
#endif
	for (i = 0; i < KP_NK; i++)
		_printk("\0016kprewrite: " KP_MODULE_NAME ": %s %s+%#x hits %lu nmissed %lu\n", kp_probes[i].name,
			kp_probes[i].symbol_name, kp_probes[i].offset, kp_hits[i], kp_probes[i].nmissed);
	for (i = 0; i < KP_NR; i++)
		_printk("\0016kprewrite: " KP_MODULE_NAME ": %s %s+%#x hits %lu returns %lu nmissed %d\n",
			kp_kretprobes[i].kp.name, kp_kretprobes[i].kp.symbol_name, kp_kretprobes[i].kp.offset,
			kp_kret_hits[i], kp_kret_returns[i], kp_kretprobes[i].nmissed);
}
