/*
 * Trace events compiled from kprobe_events lines and `fetch` strings: the
 * kernel's struct fetch_insn programs (kernel/trace/trace_probe.h), emitted as
 * data by kprewrite at rewrite time and interpreted by kp_fetch.c on each hit.
 */
#ifndef _KP_TRACE_H
#define _KP_TRACE_H
#include "kp_internal.h"
#pragma GCC visibility push(hidden)

/* enum fetch_op; the numbers are rewriter/probes/fetch.py's OPS. */
enum {
	KP_FETCH_END, KP_FETCH_REG, KP_FETCH_STACK, KP_FETCH_STACKP, KP_FETCH_RETVAL,
	KP_FETCH_COMM, KP_FETCH_ARG, KP_FETCH_IMM, KP_FETCH_IMM_LINK, KP_FETCH_DATA,
	KP_FETCH_DEREF, KP_FETCH_UDEREF, KP_FETCH_ST_RAW, KP_FETCH_ST_MEM, KP_FETCH_ST_UMEM,
	KP_FETCH_ST_STRING, KP_FETCH_ST_USTRING, KP_FETCH_MOD_BF, KP_FETCH_LP_ARRAY,
};

/* How a fetched value is printed (the fetch type's print function). */
enum { KP_PRINT_U, KP_PRINT_S, KP_PRINT_X, KP_PRINT_CHAR, KP_PRINT_SYMBOL, KP_PRINT_STRING, KP_PRINT_SYMSTR };

struct kp_fetch_insn {
	unsigned char op;
	unsigned char size;		/* bytes stored (ST_*), container bytes (MOD_BF) */
	unsigned char lshift, rshift;	/* MOD_BF */
	unsigned int param;		/* pt_regs offset, stack/arg index, array count */
	long imm;			/* immediate, link-time address, dereference offset */
	const char *data;		/* immediate string */
};

struct kp_probe_arg {
	const char *name;
	const struct kp_fetch_insn *code;
	unsigned char print;		/* KP_PRINT_* */
	unsigned char size;		/* bytes of one element */
	unsigned short count;		/* array length; 0: a scalar */
};

struct kp_trace_event {
	const char *name;		/* event name */
	const char *where;		/* kprobe: "(SYM+off/size)"; kretprobe: "FUNC" */
	const struct kp_probe_arg *args;
	unsigned int nargs;
	unsigned int is_return;
	const char *head;		/* kprobe: "EVENT: (SYM+off/size)", written in one copy */
	unsigned int head_len;
	unsigned int index;		/* in kp_trace_events[] */
};

/* Every event of the image (a kernel registers an output type for each at boot). */
extern const struct kp_trace_event *const kp_trace_events[];
extern const unsigned int kp_ntrace_events;

/* kallsyms for symbol/symstr types and return addresses, link-time addresses. */
struct kp_sym { unsigned long addr, size; unsigned int name; };
extern const struct kp_sym kp_syms[];
extern const unsigned int kp_nsyms;
extern const char kp_symnames[];

/* What the fetch programs can read besides pt_regs. */
struct kp_fetch_ctx {
	struct pt_regs *regs;
	char *comm;			/* KP_TASK_COMM_LEN + 1 bytes, filled at the first use */
	int tid;
	int have_comm;
};

/* The task's name into c->comm, once per hit ($comm, or a line written whole). */
static inline const char *kp_fetch_comm(struct kp_fetch_ctx *c)
{
	if (!c->have_comm) {
		kp_platform_task_comm(c->comm);
		c->have_comm = 1;
	}
	return c->comm;
}

#include "kp_line.h"

/*
 * A hit's record: the fetched values in binary, what the kernel's kprobe events store in
 * the ring buffer (store_trace_args()), printed only when the trace is read
 * (print_probe_args()).  Per argument, in the order of the event's args, either
 * KP_REC_ARG_FAULT (the value or a dereference could not be read: "(fault)") or one item
 * per element (a scalar: 1; an array: its count): KP_REC_VAL and the value's a->size low
 * bytes, KP_REC_FAULT, or KP_REC_STR, a 16-bit length and the string's bytes (no NUL).
 * A record that runs out of room ends at an item's boundary; its line ends in "...".
 */
enum { KP_REC_VAL = 1, KP_REC_FAULT, KP_REC_STR, KP_REC_ARG_FAULT };
struct kp_rec { unsigned char *p, *end; int full; };

/* kp_fetch.c */
void kp_fetch_arg(struct kp_rec *r, const struct kp_probe_arg *a, struct kp_fetch_ctx *c);
/* One argument's text from the record at *p (advanced); 0 when the record ended first. */
int kp_print_arg(struct kp_line *l, const struct kp_probe_arg *a, const unsigned char **p, const unsigned char *end);

/*
 * kp_trace.c: one hit of a trace event.  A kprobe event calls
 * kp_trace_kprobe() from its generated pre_handler, with the probe's address
 * (p->addr, the ip of a kernel's trace entry); a kretprobe event calls
 * kp_trace_kretprobe() from its return handler, with the return address
 * (ri->ret_addr) and the probed function's address (rp->kp.addr).
 */
void kp_trace_kprobe(const struct kp_trace_event *ev, struct pt_regs *regs, unsigned long addr);
void kp_trace_kretprobe(const struct kp_trace_event *ev, struct pt_regs *regs,
			unsigned long ret_addr, unsigned long func_addr);
void kp_trace_configure(char **envp);
/* A record's line body, "EVENT: (SYM+off/size) name=value ...\n" (print_kprobe_event()) or
 * "EVENT: (CALLER+off/size <- FUNC) ...\n" (print_kretprobe_event()), into l; its length. */
unsigned long kp_trace_format(struct kp_line *l, const struct kp_trace_event *ev, unsigned long ret_addr,
			      const unsigned char *rec, unsigned long len);

#pragma GCC visibility pop
#endif
