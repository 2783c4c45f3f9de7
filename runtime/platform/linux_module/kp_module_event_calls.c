/*
 * A module's trace events as the kernel's own event calls (events/kprobes/<EVENT>/), the module's side
 * of the kernel image's kp_trace_buffer.c (built with KP_MODULE_EVENTS: its entries, fields, print_fmt,
 * reg and .trace function): each event's trace_event_call, class and fields_array laid out from the
 * kernel's BTF and listed in the module's `_ftrace_events` section, from which the module loader's
 * trace notifier registers them before the module's init (trace_module_add_events(): raw_init, the
 * output type, the tracefs files) and removes them after its exit (trace_module_remove_events()), as
 * for a module's TRACE_EVENT()s.  raw_init fills in what the names need (print_fmt, array types) first.
 * Included last by the kp_event_calls.c writer.py generates (event_calls_c()), whose macros give the
 * layout (KP_TRACE_LAYOUT: kp_kernel_trace[]; KP_CALL_*, KP_CLASS_*, KP_FIELD_DEFINE: the words each
 * pointer goes in) and the events (KP_CALLS(X): X(i, name, the bytes of its names, its types' count)).
 */

const long kp_kernel_trace[KP_TR_N] = { KP_TRACE_LAYOUT };
_Static_assert(KP_TR_N == KP_TRACE_LAYOUT_N, "kp_kernel_trace[]: the kernel platform's layout");
int trace_event_raw_init(void *call);
static int kp_module_raw_init(void *call);

#define KP_CALL_BUFFERS(i, name, names_size, ntypes)		\
	static char kp_module_names_##i[names_size];		\
	static const char *kp_module_types_##i[ntypes];
KP_CALLS(KP_CALL_BUFFERS)

#define KP_CALL_TYPE(i, name, names_size, ntypes)							\
	{ .call = { [KP_CALL_CLASS] = (unsigned long)kp_module_types[i].class,				\
		    [KP_CALL_NAME] = (unsigned long)name,						\
		    [KP_CALL_EVENT_FUNCS] = (unsigned long)kp_trace_funcs },				\
	  .class = { [KP_CLASS_SYSTEM] = (unsigned long)"kprobes",					\
		     [KP_CLASS_REG] = (unsigned long)kp_trace_reg,					\
		     [KP_CLASS_RAW_INIT] = (unsigned long)kp_module_raw_init,				\
		     [KP_CLASS_FIELDS_ARRAY] = (unsigned long)kp_module_types[i].fields,		\
		     /* the class's fields: an empty list_head */						\
		     [KP_CLASS_FIELDS] = (unsigned long)&kp_module_types[i].class[KP_CLASS_FIELDS],	\
		     [KP_CLASS_FIELDS_PREV] = (unsigned long)&kp_module_types[i].class[KP_CLASS_FIELDS] },	\
	  .fields = { { [0] = ~0UL, [KP_FIELD_DEFINE] = (unsigned long)kp_trace_define_fields } } },
static struct kp_trace_type kp_module_types[KP_NCALLS] = {
	KP_CALLS(KP_CALL_TYPE)
};
#define KP_CALL_EVENT(i, name, names_size, ntypes) kp_module_types[i].call,
static void *const kp_module_ftrace_events[KP_NCALLS] __attribute__((section("_ftrace_events"), used, aligned(8))) = {
	KP_CALLS(KP_CALL_EVENT)
};
#define KP_CALL_NAMES(i, name, names_size, ntypes) kp_module_names_##i,
static char *const kp_module_names[KP_NCALLS] = { KP_CALLS(KP_CALL_NAMES) };
#define KP_CALL_ARRAYS(i, name, names_size, ntypes) kp_module_types_##i,
static const char **const kp_module_arrays[KP_NCALLS] = { KP_CALLS(KP_CALL_ARRAYS) };
#define KP_CALL_NAMES_SIZE(i, name, names_size, ntypes) names_size,
static const unsigned long kp_module_names_size[KP_NCALLS] = { KP_CALLS(KP_CALL_NAMES_SIZE) };

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
