/*
 * A module's trace events as the kernel's own event calls, the module's side (event_calls_c() generates
 * the calls' layout before it, on the kernel image's kp_trace_buffer.c): raw_init and the calls' start.
 * Read as text by rewriter/targets/linux_module/x86_64/writer.py (module_source()), from the line after
 * this comment; not compiled alone.
 */

/* The trace_event_class's raw_init, from the module loader's trace notifier (process
 * context, before the module's init): the event, its fields' total, print_fmt and the
 * array fields' types (before define_fields reads them), then the output type
 * (trace_event_raw_init(): register_trace_event()). */
static int kp_module_raw_init(void *call)
{
	struct kp_trace_type *t = call;
	unsigned int i = (unsigned int)(t - kp_module_types);
	if (i >= KP_NCALLS || i >= kp_ntrace_events)
		return -22;
	const struct kp_trace_event *ev = kp_trace_events[i];
	unsigned int fixed = 0;
	for (unsigned int k = 0; k < ev->nargs; k++) {
		const struct kp_probe_arg *a = &ev->args[k];
		fixed += kp_arg_field_size(a) * (a->count ? a->count : 1);
	}
	t->fixed = fixed;
	kp_trace_names(ev, kp_module_names[i], kp_module_names_size[i], kp_module_arrays[i]);
	t->types = kp_module_arrays[i];
	*(char **)((char *)t->call + kp_kernel_trace[KP_TR_CALL_PRINT_FMT]) = kp_module_names[i];
	t->ev = ev;
	return trace_event_raw_init(call);
}

/* From the module's init, the calls registered: each event with an output type written
 * through its trace_event_files from now on, and enabled in the top instance (as a kernel
 * image's events are); an event the notifier did not register (a module with a bad taint)
 * writes trace_printk() lines. */
void kp_module_trace_init(void)
{
	kp_trace_event_at = kp_kernel_trace[KP_TR_CALL_EVENT];
	kp_trace_calls = 1;
	for (unsigned int i = 0; i < KP_NCALLS; i++) {
		struct kp_trace_type *t = &kp_module_types[i];
		int type = *(int *)((char *)t->call + kp_kernel_trace[KP_TR_CALL_EVENT] + kp_kernel_trace[KP_TR_EVENT_TYPE]);
		if (type <= 0 || !t->ev)
			continue;
		t->type = (unsigned int)type;
		__atomic_store_n(&t->live, 1, __ATOMIC_RELEASE);
		int ret = trace_set_clr_event("kprobes", t->ev->name, 1);
		if (ret)
			_printk(KP_KERN_ERR "kprewrite: trace event %s: not enabled (%d)\n", t->ev->name, ret);
	}
	__atomic_store_n(&kp_trace_types, kp_module_types, __ATOMIC_RELEASE);
}
